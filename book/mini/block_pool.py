"""A pool of KV blocks: a free queue and a reference count per block (chapter 5)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.free = deque(range(num_blocks))  # head: handed out next
        self.ref_cnt = [0] * num_blocks

    def allocate(self, n: int):
        if n > len(self.free):
            return None  # all or nothing: half a request's blocks help nobody
        ids = [self.free.popleft() for _ in range(n)]
        for i in ids:
            self.ref_cnt[i] = 1
        return ids

    def release(self, ids):
        for i in ids:
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self.free.append(i)  # tail: reused last (a prefix cache may still want it)
