from minivllm.config.checks import InvalidRequestError
from minivllm.inputs.processor import EngineCoreRequest, InputProcessor, PromptType
from minivllm.inputs.tokenizer import load_tokenizer, read_eos_token_ids

__all__ = ["EngineCoreRequest", "InputProcessor", "InvalidRequestError", "PromptType",
           "load_tokenizer", "read_eos_token_ids"]
