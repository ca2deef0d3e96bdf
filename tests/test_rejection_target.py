"""The rejection sampler's target distribution is the Sampler's, row for row.

Random logits and random sampling knobs (temperature, penalties, top-k, top-p,
min-p, min_tokens): position j of a request with drafts must be processed
exactly as the plain Sampler processes that request once the first j drafts
are its output. The rows here are built by hand, not by the rejection sampler.
"""

import random

import torch

from minivllm import SamplingParams
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sample.knobs import process_logits, sampling_probs
from minivllm.sample.sampler import SamplingMetadata, SamplingRow

VOCAB = 50


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 5, 20]),
        top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]),
        presence_penalty=rng.choice([0.0, 0.8]), frequency_penalty=rng.choice([0.0, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.3]), min_tokens=rng.choice([0, 4]),
        stop_token_ids=[rng.randrange(VOCAB)])


def test_target_equals_the_samplers_processing():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = rng.randint(1, 4)
        rows = [SamplingRow(_random_params(rng), [rng.randrange(VOCAB) for _ in range(6)],
                            [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))])
                for _ in range(n)]
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in rows]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=gen) * 3
        greedy, probs, _ = RejectionSampler.target(logits, rows, drafts)
        i = 0
        for row, d in zip(rows, drafts):
            for j in range(len(d) + 1):
                alone = SamplingRow(row.sampling_params, row.prompt_token_ids,
                                    list(row.output_token_ids) + d[:j])
                md = SamplingMetadata.from_rows([alone], VOCAB)
                processed = process_logits(logits[i:i + 1], md)
                assert int(greedy[i]) == int(processed.argmax())
                if not row.sampling_params.greedy:
                    expected = sampling_probs(processed, md)[0]
                    torch.testing.assert_close(probs[i], expected, rtol=0, atol=0)
                i += 1
