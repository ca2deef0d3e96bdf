"""The reader's own inference engine, one piece per file, built chapter by chapter.

    block_pool.py   chapter 5   free queue + reference counts
    kv_cache.py     chapter 5   block tables over the pool
    attention.py    chapter 6   online softmax; paged attention over the reader's cache
    scheduler.py    chapter 7   token budget, chunked prefill, preemption by recompute
    batch.py        chapter 7   the flat varlen batch and its slot mapping
    sampler.py      chapter 9   temperature / top-k / top-p / min-p, the exponential race
    detokenizer.py  chapter 10  incremental detokenizing that never splits a character
    engine.py       chapter 14  the KV tensors, and the loop that makes the pieces serve

The chapters show these files slice by slice and check each piece against the
engine; chapter 14 assembles them over the engine's model weights. There is one
copy of each piece: this one.
"""

from mini import (attention, batch, block_pool, detokenizer, engine, kv_cache,  # noqa: E402,F401
                  sampler, scheduler)
