from minivllm.inputs.processor import InputProcessor, PromptType
from minivllm.inputs.tokenizer import load_tokenizer, read_eos_token_ids

__all__ = ["InputProcessor", "PromptType", "load_tokenizer", "read_eos_token_ids"]
