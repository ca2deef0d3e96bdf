"""Speculative decoding: guess k tokens cheaply, verify them in one target step.

    propose  (ngram_proposer.py: prompt lookup; draft_model.py: a small model)
       │  Request.spec_token_ids = [d1 .. dk]
       ▼
    schedule (core/scheduler.py: the request asks for 1 + k slots)
       ▼
    verify   (model_runner: 1 + k logits rows -> rejection_sampler.py)
       │  accepted drafts + one target token; the rest of the slots are reclaimed
       ▼
    metrics  (metrics.py: acceptance rate, mean accepted length, per position)

The output distribution is the target model's, exactly: greedy output is
token for token the unspeculated one, and sampled output keeps the target's
probabilities (rejection sampling, Leviathan et al. 2023; Chen et al. 2023).
"""
