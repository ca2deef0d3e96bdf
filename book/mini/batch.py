"""One flat batch per step: every scheduled token of every request, end to end (chapter 7).

No padding and no batch dimension: a prefill chunk of 100 tokens and three
decodes of one token each are 103 rows. The attention metadata says where each
sequence starts and, per token, which cache slot its K/V go to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model.attention.backend import AttentionMetadata


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] the new tokens
    positions: torch.Tensor  # [T] their positions in their sequences
    meta: AttentionMetadata  # query_start_loc, seq_lens, slot_mapping, block_tables
    logits_indices: torch.Tensor  # rows that end a sequence's known tokens: they sample
    samplers: list  # the requests those rows belong to


def prepare_inputs(out, block_size: int) -> FlatBatch:
    ids, pos, slots, starts, seq_lens, rows, samplers = [], [], [], [0], [], [], []
    for seq in out.scheduled_requests:
        table, first = out.block_ids[seq.request_id], seq.num_computed_tokens  # cached already
        last = first + out.num_scheduled_tokens[seq.request_id]
        ids += seq.all_token_ids[first:last]
        pos += range(first, last)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(first, last)]
        starts.append(len(ids))
        seq_lens.append(last)  # cached context + the new tokens
        if last == seq.num_tokens:  # reaches the end of what is known: sample
            rows.append(len(ids) - 1)
            samplers.append(seq)
    tables = [out.block_ids[seq.request_id] for seq in out.scheduled_requests]
    width = max(map(len, tables))  # -1 pads the shorter tables
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    return FlatBatch(torch.tensor(ids), torch.tensor(pos), meta,
                     torch.tensor(rows, dtype=torch.int64), samplers)
