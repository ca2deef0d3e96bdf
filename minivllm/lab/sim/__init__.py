"""The real scheduler at scale: a simulated executor, a cost model, fleets.

    from minivllm.lab.sim import Simulator, load_hardware, load_model_config, random_requests
    sim = Simulator(load_model_config("llama-3-8b"), load_hardware("h100-sxm"))
    result = sim.run(random_requests(1000, 512, 128, 128256, request_rate=20))

``minivllm simulate`` is the same from the command line: the engine's own ``Scheduler``,
``KVCacheManager`` and ``BlockPool``, unchanged, over a simulated executor whose step
durations come from a cost model (``cost_model.py``), in virtual time, the model only its
``config.json``. The workload flags are ``bench serve``'s, and ``--output`` writes its JSON
keys plus the step trace::

    minivllm simulate --model llama-3-8b --hardware h100-sxm \
        --dataset-name random --random-input-len 1024 --random-output-len 128 \
        --num-prompts 10000 --request-rate 50 --max-num-batched-tokens 8192 --output sim.json
    minivllm simulate --dataset-name multiturn --num-replicas 4 --router prefix_aware ...
    minivllm simulate calibrate --output cpu.json   # fit the cost model to this machine
    minivllm simulate --model default --hardware cpu.json ...   # the weights serve runs
    minivllm simulate validate --calibration cpu.json   # against a real serve + bench serve
    minivllm simulate validate --fleet                  # a real fleet behind the router
    minivllm simulate published                         # against vLLM's published latency

Models: ``llama-3-8b``, ``llama-3-70b``, ``qwen3-8b``, ``smollm2-135m``, ``gemma-3-27b``,
the mixtures of experts ``qwen3-30b-a3b`` and ``mixtral-8x7b``, a model folder or a
``config.json``; ``deepseek-v3`` and ``qwen3-next-80b-a3b`` (their experts priced, their
MLA or linear attention not: use them for KV capacity). ``kv_specs.py`` prices the KV cache per group
(full, sliding window, MLA latent, linear-attention state) and counts the requests of a
length that fit: ``capacity(kv_groups(load_raw_config("gemma-3-27b")), 40e9, 32768)``.
A mixture of experts costs its active parameters' FLOPs and the bytes of the experts a
step's tokens touch (``moe_cost.py``). Hardware: ``h100-sxm``, ``h200``, ``a100-80g``, ``l4`` (data-sheet
peaks, efficiencies guessed), ``cpu`` (this machine as ``bench roofline`` measures it) or a
calibration file: ``simulate calibrate`` measures the weights ``serve`` runs by default
(``--quantization auto``: the default model's GGUF blocks; ``--model default`` simulates
them) and records them, and a simulation of other weights with it is refused. The engine
loop follows the engine's ``async_scheduling`` (``--async-scheduling``): the core's
Python per step (``python_step_s``, calibrated) adds to the model step in the
synchronous loop and hides under it in the async one (``CostModel.loop_time``).
Chapter 23 teaches it (its "In practice" cell has the details);
figures/records/simulator.md and figures/records/fleet.md (collected in
figures/RESULTS.md) record the calibration's method and every validation run.
"""

from minivllm.lab.sim.clock import VirtualClock
from minivllm.lab.sim.cost_model import CostModel, StepFeatures
from minivllm.lab.sim.executor import SimExecutor
from minivllm.lab.sim.hardware import HARDWARE_PRESETS, Hardware, load_hardware
from minivllm.lab.sim.models import MODEL_PRESETS, load_model_config
from minivllm.lab.sim.simulator import RequestRecord, SimResult, Simulator, make_engine_config
from minivllm.lab.bench.workload import SimRequest, multiturn_requests, random_requests

__all__ = ["VirtualClock", "CostModel", "StepFeatures", "SimExecutor", "Hardware",
           "HARDWARE_PRESETS", "load_hardware", "MODEL_PRESETS", "load_model_config",
           "Simulator", "SimResult", "RequestRecord", "make_engine_config", "SimRequest",
           "random_requests", "multiturn_requests"]
