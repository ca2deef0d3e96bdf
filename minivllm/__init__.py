"""minivllm: a compact, tested re-implementation of a vLLM V1-style inference engine."""

from minivllm.config import EngineArgs
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # Each imported when first asked for: LLM pulls in torch and the model, the others are optional.
    if name == "LLM":
        from minivllm.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from minivllm.lora.request import LoRARequest
        return LoRARequest
    if name == "BeamSearchParams":
        from minivllm.entrypoints.beam_search import BeamSearchParams
        return BeamSearchParams
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "EngineArgs", "LoRARequest", "RequestOutputKind", "BeamSearchParams", "__version__"]
