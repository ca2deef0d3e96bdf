"""Turning logits into tokens: the sampler, the per-request logits processors, and the
rejection sampler that verifies speculative drafts with the same processing. It sits below
``worker/`` (its caller), ``spec_decode/`` and ``cpu/`` (a subclass), importing none."""
