"""Simulated workloads: who sends what, when.

Each ``SimRequest`` is token ids and an output length, with the time it is
sent. Two datasets, named as in ``vllm bench serve``:

- ``random``: uniform random prompts; prompt and output lengths uniform in
  ``[len x (1 - range_ratio), len x (1 + range_ratio)]``; sent on a Poisson
  (or gamma, ``burstiness``) schedule.
- ``multiturn``: agent-like conversations. Every session shares one system
  prompt; turn ``k`` sends the whole conversation so far (system prompt,
  earlier user turns and answers) plus a new user message, and is sent only
  ``think_time`` seconds after the answer to turn ``k - 1`` came back. The
  answers are drawn up front and replayed by the simulated executor, so the
  next turn's prompt holds exactly the tokens the engine produced: what the
  prefix cache can reuse. Sessions start on the arrival schedule.
"""

from __future__ import annotations

import random

import numpy as np
from dataclasses import dataclass
from typing import Optional

from minivllm.benchmarks.serve import arrival_times


@dataclass
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0  # when it is sent (ignored while ``after`` is pending)
    priority: int = 0
    # Replayed as the output (its length is output_len); None: synthetic tokens.
    output_token_ids: Optional[list[int]] = None
    # Sent think_time seconds after this request finished (a conversation's next turn).
    after: Optional[str] = None
    think_time: float = 0.0
    session: Optional[str] = None
    ignore_eos: bool = True  # False: the executor samples EOS as the last token


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int,
            avoid: frozenset[int]) -> list[int]:
    """``n`` uniform token ids outside ``avoid`` (numpy: 10,000 prompts are many tokens)."""
    out = rng.integers(0, vocab_size, n)
    if avoid:
        bad = np.isin(out, list(avoid))
        while bad.any():
            out[bad] = rng.integers(0, vocab_size, int(bad.sum()))
            bad = np.isin(out, list(avoid))
    return out.tolist()


def _check(name: str, value, low=1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, request_rate: float = float("inf"),
                    burstiness: float = 1.0, seed: int = 0, prefix_len: int = 0,
                    avoid_token_ids: frozenset[int] = frozenset()) -> list[SimRequest]:
    """vLLM's random dataset; ``prefix_len`` tokens shared by every prompt go first."""
    _check("num_prompts", num_prompts)
    _check("random_input_len", input_len)
    _check("random_output_len", output_len)
    _check("random_prefix_len", prefix_len, 0)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} is invalid: must be in [0, 1)")
    rng, tok = random.Random(seed), np.random.default_rng(seed)
    prefix = _tokens(tok, prefix_len, vocab_size, avoid_token_ids)
    times = arrival_times(num_prompts, request_rate, burstiness, seed)
    return [SimRequest(str(i), prefix + _tokens(tok, _length(rng, input_len, range_ratio),
                                                vocab_size, avoid_token_ids),
                       _length(rng, output_len, range_ratio), times[i])
            for i in range(num_prompts)]


def multiturn_requests(num_sessions: int, num_turns: int, system_len: int, user_len: int,
                       output_len: int, vocab_size: int, request_rate: float = float("inf"),
                       burstiness: float = 1.0, think_time: float = 0.0, seed: int = 0,
                       avoid_token_ids: frozenset[int] = frozenset()) -> list[SimRequest]:
    """``num_sessions`` conversations of ``num_turns`` turns each (ids "s<i>-t<k>")."""
    for name, v in (("num_sessions", num_sessions), ("multiturn_num_turns", num_turns),
                    ("multiturn_user_len", user_len), ("multiturn_output_len", output_len)):
        _check(name, v)
    _check("multiturn_system_len", system_len, 0)
    if not think_time >= 0:
        raise ValueError(f"multiturn_think_time={think_time} is invalid: must be >= 0")
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab_size, avoid_token_ids)
    starts = arrival_times(num_sessions, request_rate, burstiness, seed)
    out = []
    for s in range(num_sessions):
        history = list(system)
        for k in range(num_turns):
            history += _tokens(rng, user_len, vocab_size, avoid_token_ids)
            answer = _tokens(rng, output_len, vocab_size, avoid_token_ids)
            out.append(SimRequest(f"s{s}-t{k}", list(history), output_len, starts[s],
                                  output_token_ids=answer,
                                  after=f"s{s}-t{k - 1}" if k else None,
                                  think_time=think_time if k else 0.0, session=f"s{s}"))
            history += answer
    return out


__all__ = ["SimRequest", "random_requests", "multiturn_requests"]
