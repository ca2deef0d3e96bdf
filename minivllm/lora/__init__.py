"""Multi-LoRA serving: many PEFT adapters over one copy of the base weights.

- ``request.py``: ``LoRARequest`` (which adapter a request runs with);
- ``peft_loader.py``: a PEFT folder -> checked low-rank factors (``LoRAModel``);
- ``punica.py``: the reference delta, shrink then expand, per-token adapter index;
- ``layers.py``: the stacked per-slot weights of one wrapped linear layer;
- ``model_manager.py``: ``max_loras`` slots filled from an LRU CPU cache.

It imports ``model/`` and ``config`` only; the model runner and the scheduler
get what they need from it as plain data.
"""

from minivllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
