from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.model.attention.layer import Attention
from minivllm.model.attention.torch_attn import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "Attention", "TorchAttentionBackend"]
