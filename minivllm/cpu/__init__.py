"""Everything that makes minivllm fast on a CPU, apart from the reference path.

The reference (``minivllm/model``, ``minivllm/sample/sampler.py``) is plain
PyTorch with one path per layer. This package plugs in at three seams,
chosen once when the engine starts, never per call:

1. the attention backend ``"cpu"`` (``attention.py``), picked by the selector;
2. accelerated twins of the layers that have a kernel (``layers.py``),
   swapped in once when the model is loaded;
3. the fused decode step (``fused_decode.py``): the model runner replays a
   pure decode step through one C++ call, as vLLM replays CUDA graphs.

The C++ sources are in ``csrc/``; ``_custom_ops.py`` builds them for this
CPU's instruction set (``features.py``) and wraps them as Python calls;
``prepack.py`` packs the GEMM weights once.
"""
