"""The real scheduler at scale: a simulated executor, a cost model, fleets.

    from minivllm.lab.sim import Simulator, load_hardware, load_model_config, random_requests
    sim = Simulator(load_model_config("llama-3-8b"), load_hardware("h100-sxm"))
    result = sim.run(random_requests(1000, 512, 128, 128256, request_rate=20))

``minivllm simulate`` is the same from the command line.
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
