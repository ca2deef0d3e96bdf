"""Everything that makes minivllm fast on a CPU, apart from the reference path.

The reference (``minivllm/model``, ``minivllm/sample/sampler.py``) is plain
PyTorch with one path per layer. This package plugs in at one seam: when
the engine starts, the model runner calls ``accelerate.cpu_path(config)``,
which returns the compute path it uses instead of the reference one
(``minivllm/worker/compute_path.py``), never changed per call:

1. the attention backend ``"cpu"`` (``attention.py``), handed to the selector;
2. the dtype to compute in, and accelerated twins of the layers that have a
   kernel (``layers.py``), swapped in once when the model is loaded;
3. a sampler whose greedy argmax is one C++ pass;
4. the fused decode step (``fused_decode.py``): the model runner replays a
   pure decode step through one C++ call, as vLLM replays CUDA graphs.

``model/`` and ``core/`` import nothing from here.

The C++ sources are in ``csrc/``; ``_custom_ops.py`` builds them for this
CPU's instruction set (``features.py``) and wraps them as Python calls;
``prepack.py`` packs the GEMM weights once.
"""
