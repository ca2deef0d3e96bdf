"""The instruments around the engine: imported by no engine module (tests/test_layering.py).

- ``sim/``: the real scheduler on simulated hardware (cost model, calibration, fleets);
  ``minivllm simulate``.
- ``bench/``: the benchmarks; ``minivllm bench``.
- ``viz/``: the book's figure builders (plotly), tested through their data.
"""
