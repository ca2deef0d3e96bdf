"""Turning logits into tokens: the sampler, the per-request logits processors, and
the rejection sampler that verifies speculative drafts with the same processing.

It sits below ``worker/`` (which calls it), ``spec_decode/`` and ``cpu/`` (whose
sampler is a subclass), and imports none of them.
"""
