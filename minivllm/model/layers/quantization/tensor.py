"""``QuantizedTensor``, one GGUF tensor ([rows, row_bytes] of one block type; a column
slice must fall on block boundaries), and ``QuantizedWeight``, a layer's rows in
segments of one block type each (mixed files ship ``attn_v`` in Q6_K, q, k in Q4_K)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model.layers.quantization.ggml_types import BLOCK_TYPES, dequantize


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: str  # a key of BLOCK_TYPES
    cols: int  # weights per row

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def narrow_rows(self, start: int, size: int) -> "QuantizedTensor":
        return QuantizedTensor(self.data.narrow(0, start, size), self.qtype, self.cols)

    def narrow_cols(self, start: int, size: int, why: str) -> "QuantizedTensor":
        """Columns [start, start + size): whole blocks only, else ``why`` is refused."""
        t = BLOCK_TYPES[self.qtype]
        if start % t.block_size or size % t.block_size:
            raise ValueError(f"{why}: columns {start}..{start + size} of a {self.qtype} "
                             f"weight do not fall on its {t.block_size}-weight block "
                             f"boundaries, so its blocks cannot be split there")
        # A copy of its own: the kernels read each row's blocks back to back.
        data = self.data.narrow(1, t.row_bytes(start), t.row_bytes(size)).contiguous()
        return QuantizedTensor(data, self.qtype, size)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype)


class QuantizedWeight:
    """A layer's [rows, cols] weight as row segments of quantized blocks."""

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.segments: list[tuple[int, QuantizedTensor]] = []  # (first row, rows)

    def put(self, offset: int, t: QuantizedTensor) -> None:
        if t.cols != self.cols or offset < 0 or offset + t.rows > self.rows:
            raise ValueError(f"weight shape mismatch: checkpoint rows {offset}.."
                             f"{offset + t.rows} x {t.cols} columns, layer expects "
                             f"{self.rows} x {self.cols}")
        self.segments = sorted(self.segments + [(offset, t)], key=lambda s: s[0])
        self._join()

    def _join(self) -> None:
        joined: list[tuple[int, QuantizedTensor]] = []
        for offset, t in self.segments:
            if joined:
                last_off, last = joined[-1]
                if last.qtype == t.qtype and last_off + last.rows == offset:
                    data = torch.cat([last.data, t.data])
                    joined[-1] = (last_off, QuantizedTensor(data, t.qtype, t.cols))
                    continue
            joined.append((offset, t))
        self.segments = joined

    @property
    def complete(self) -> bool:
        return sum(t.rows for _, t in self.segments) == self.rows

    @property
    def qtypes(self) -> list[str]:
        return [t.qtype for _, t in self.segments]

    @property
    def nbytes(self) -> int:
        return sum(t.data.numel() for _, t in self.segments)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix these blocks encode."""
        return torch.cat([t.dequantize() for _, t in self.segments])

    def rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``index`` (an embedding lookup): only those rows' blocks."""
        if len(self.segments) == 1:
            t = self.segments[0][1]
            return dequantize(t.data[index.reshape(-1)], t.qtype).reshape(*index.shape, -1)
        return self.dequantize()[index]


__all__ = ["QuantizedTensor", "QuantizedWeight"]
