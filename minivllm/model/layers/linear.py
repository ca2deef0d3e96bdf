"""Linear layers that split themselves across tensor-parallel ranks: column-parallel
splits the outputs, row-parallel the inputs (then one all-reduce); q, k, v and gate, up
are fused into one matrix each. ``weight_loader`` copies this rank's slice; with a
``quant_config`` the same slices fill a ``qweight`` of blocks instead."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.parallel import divide, tp_rank, tp_size
from minivllm.model.layers.quantization import QuantizationConfig, QuantizedTensor


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = None if quant_config is None else quant_config.get_quant_method(self)
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method.create_weights(self, in_features, out_features)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self, shard_id=None) -> tuple[int, int, int]:
        """(first row here, first row in the checkpoint tensor, rows) of a shard."""
        return 0, 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Optional[str] = None) -> None:
        dst, src, size = self.shard_rows(shard_id)
        shard = loaded.narrow(0, src, size)
        default_weight_loader(param.data.narrow(0, dst, size),
                              shard if param.dim() == 1 else self.shard_cols(shard))

    def load_quantized(self, loaded: QuantizedTensor, shard_id=None) -> None:
        dst, src, size = self.shard_rows(shard_id)
        self.qweight.put(dst, self.shard_cols(loaded.narrow_rows(src, size)))

    def shard_cols(self, loaded):
        """This rank's input columns of a checkpoint weight (all but row-parallel: all)."""
        return loaded


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one) of the same shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        super().__init__(in_features, divide(out_features, self.tp_size, "output size"),
                         bias, dtype, quant_config)

    def shard_rows(self, shard_id=None):
        rows = self.out_features
        return 0, self.tp_rank * rows, rows


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked: e.g. [gate; up] of the MLP."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, quant_config)

    def shard_rows(self, shard_id=None):
        index = int(shard_id)
        size = self.output_sizes[index] // self.tp_size
        offset = sum(self.output_sizes[:index]) // self.tp_size
        return offset, self.tp_rank * size, size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matrix, split by heads (with fewer KV heads than ranks, each
    rank keeps a copy of the one its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int,
                 num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, size, "num_attention_heads")
        if num_kv_heads >= size:
            self.num_kv_heads = divide(num_kv_heads, size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if size % num_kv_heads:
                raise ValueError(f"num_key_value_heads={num_kv_heads} does not divide "
                                 f"tensor_parallel_size={size}: KV heads cannot be "
                                 f"copied evenly to the ranks")
            self.num_kv_heads = 1
            self.kv_replicas = size // num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out * size, bias, dtype, quant_config)

    def shard_rows(self, shard_id=None):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        return offset, rank * size, size


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        super().__init__(divide(in_features, self.tp_size, "input size"), out_features,
                         bias, dtype, quant_config)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, on rank 0 only
            default_weight_loader(param, loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded, shard_id)

    def shard_cols(self, loaded):
        cols = self.in_features
        if isinstance(loaded, QuantizedTensor):
            return loaded.narrow_cols(self.tp_rank * cols, cols,
                                      f"tensor_parallel_size={self.tp_size}")
        return loaded.narrow(1, self.tp_rank * cols, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.tp_size == 1:
            return out
        from minivllm.model.layers.collectives import all_reduce
        return all_reduce(out)
