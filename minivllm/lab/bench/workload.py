"""The one workload generator: who sends what, and when.

``bench serve`` (over HTTP), ``bench throughput`` (offline) and ``simulate``
(in virtual time) all draw their requests here, so one command line
describes a measured and a simulated run alike. Datasets, named as in
``vllm bench serve``:

- ``chat``: ``CHAT_PROMPTS``, 64 short, varied user turns (questions,
  instructions, translation, code, some in Chinese), the kind of traffic a
  small chat model sees; ``chat_workload`` cycles through them.
- ``random``: token IDs drawn uniformly, prompt and output lengths uniform in
  ``[len x (1 - range_ratio), len x (1 + range_ratio)]``, meant to run with
  ``ignore_eos`` so every request produces exactly its output length
  (``random_workload`` for the benchmarks, ``random_requests`` for the simulator).
- ``multiturn``: agent-like conversations. Every session shares one system
  prompt; turn ``k`` sends the whole conversation so far (system prompt,
  earlier user turns and answers) plus a new user message, and is sent only
  ``think_time`` seconds after the answer to turn ``k - 1`` came back. The
  answers are drawn up front and replayed by the simulated executor, so the
  next turn's prompt holds exactly the tokens the engine produced: what the
  prefix cache can reuse. Sessions start on the arrival schedule.
- ``grounded``: user turns that ask to repeat, quote or rewrite a passage, so
  that the answer repeats the prompt and n-gram speculation has something to
  find (``grounded_prompts``).

When: ``request_delays`` / ``arrival_times``, Poisson or gamma (``burstiness``)
gaps of mean ``1/rate``, as ``vllm bench serve`` draws them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

from minivllm.config import check_int

# -- prompts ------------------------------------------------------------------

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "用一句话介绍一下北京。",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
    "今天天气很好，我们去公园散步吧。请把这句话翻译成英文。",
    "What is 12 times 7?",
    "Give me a short tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a CPU do?",
    "写一首关于月亮的短诗。",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a pet cat.",
    "What is the boiling point of water in Celsius?",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the three states of matter?",
    "请解释一下什么是机器学习。",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "How many continents are there? Name them.",
    "What is the difference between weather and climate?",
    "Write a short motivational message for a student before an exam.",
    "解释一下光合作用的过程。",
    "What is the largest planet in our solar system?",
    "Describe a cat to someone who has never seen one.",
    "How do I make a cup of green tea?",
    "What is an API? Explain it to a beginner.",
    "给我推荐三本适合初学者的编程书。",
    "Write a limerick about a programmer.",
    "What causes the seasons on Earth?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "What is the Pythagorean theorem?",
    "Write an email asking a colleague to reschedule a meeting.",
    "中国的四大发明是什么？",
    "Name five fruits that are red.",
    "What is the meaning of the word 'ephemeral'?",
    "Explain recursion with a simple example.",
    "What should I pack for a weekend camping trip?",
    "How does a rainbow form?",
    "请用三句话描述一下上海。",
    "Write a SQL query that counts the rows of a table named users.",
    "What are the benefits of regular exercise?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between a list and a tuple in Python?",
    "Write a two-line poem about autumn leaves.",
    "如何提高自己的时间管理能力？",
    "Who painted the Mona Lisa, and when?",
    "Explain what a black hole is in simple words.",
    "Give three tips for a good night's sleep.",
    "What is the square root of 144?",
    "Write a short story opening that starts with a knock on the door.",
    "长城有多长？请简要回答。",
    "What is photosynthesis?",
    "How do vaccines work? Keep it short.",
    "Suggest a good name for a coffee shop.",
    "What does HTTP stand for, and what is it used for?",
    "Describe the taste of a lemon.",
    "把'我爱学习'翻译成法语。",
    "Write a JavaScript snippet that prints the numbers 1 to 5.",
    "Why do we have leap years?",
    "Give an example of a metaphor and explain it.",
    "What are the primary colors?",
)


PASSAGES: tuple[str, ...] = (
    "The Great Wall of China is a series of fortifications that were built across the "
    "historical northern borders of ancient Chinese states and Imperial China as "
    "protection against various nomadic groups from the Eurasian Steppe.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to produce glucose and oxygen. It takes place mainly in the leaves, inside "
    "small structures called chloroplasts.",
    "Python is a high-level, general-purpose programming language. Its design philosophy "
    "emphasizes code readability with the use of significant indentation. Python is "
    "dynamically typed and garbage-collected.",
    "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It "
    "extends from the Arctic Ocean in the north to the Southern Ocean in the south, and "
    "is bounded by Asia and Australia in the west and the Americas in the east.",
    "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted "
    "pioneering research on radioactivity. She was the first woman to win a Nobel Prize "
    "and the only person to win Nobel Prizes in two scientific fields.",
    "A KV cache stores the keys and values of every token a model has already processed, "
    "so that each new token only needs attention over stored entries instead of "
    "recomputing the whole sequence at every step.",
    "The Amazon rainforest covers much of the Amazon basin of South America. The majority "
    "of the forest is contained within Brazil, with sixty percent of the rainforest, "
    "followed by Peru with thirteen percent and Colombia with ten percent.",
    "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur "
    "Himal sub-range of the Himalayas. The China-Nepal border runs across its summit point.",
)

TASKS: tuple[str, ...] = (
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Copy this text, then stop:\n\n{}",
    "Quote the first two sentences of this passage verbatim:\n\n{}",
    "Rewrite this passage with every sentence on its own line, changing no words:\n\n{}",
)


def grounded_prompts(n: int) -> list[str]:
    """``n`` user turns that ask to repeat, quote or rewrite a passage."""
    return [TASKS[i % len(TASKS)].format(PASSAGES[i % len(PASSAGES)]) for i in range(n)]


# -- when: the arrival schedule -------------------------------------------------

def poisson_delays(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps of mean 1/rate (0 if inf)."""
    return request_delays(num, rate, 1.0, seed)


def request_delays(num: int, rate: float, burstiness: float = 1.0,
                   seed: int = 0) -> list[float]:
    """Gaps before each request, mean ``1/rate``, as ``vllm bench serve`` draws them.

    Gamma-distributed with shape ``burstiness`` (1: exponential gaps, a Poisson
    process; below 1 burstier, above 1 more regular); all 0 for ``rate=inf``.
    """
    if not rate > 0:
        raise ValueError(f"request_rate={rate} is invalid: must be > 0 (inf = all at once)")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness={burstiness} is invalid: must be a finite number > 0")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(num)]
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, seconds after the start (the running sum of the gaps)."""
    t, out = 0.0, []
    for gap in request_delays(num, rate, burstiness, seed):
        t += gap
        out.append(t)
    return out


# -- the benchmarks' requests ---------------------------------------------------

@dataclass
class BenchRequest:
    """One request of a workload: chat messages or token IDs, and its output length."""

    messages: Optional[list[dict]]  # chat workloads
    prompt_token_ids: Optional[list[int]]  # random workloads
    max_tokens: int


def chat_workload(num_prompts: int, max_tokens: int) -> list[BenchRequest]:
    """``num_prompts`` chat requests, cycling through the built-in prompts in order."""
    _check_positive("num_prompts", num_prompts)
    _check_positive("max_tokens", max_tokens)
    return [BenchRequest([{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                         None, max_tokens) for i in range(num_prompts)]


def random_workload(num_prompts: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], vocab_size: int, seed: int = 0,
                    avoid_token_ids: frozenset[int] = frozenset()) -> list[BenchRequest]:
    """Uniform random token prompts; lengths uniform in the given inclusive ranges.

    ``avoid_token_ids`` (special tokens, EOS) are never drawn, so a prompt
    cannot contain a stray end-of-text marker.
    """
    _check_positive("num_prompts", num_prompts)
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name}=({lo}, {hi}) is invalid: need 1 <= min <= max")
    if vocab_size <= len(avoid_token_ids):
        raise ValueError(f"vocab_size={vocab_size} leaves no token to draw")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        ids: list[int] = []
        while len(ids) < n:
            t = rng.randrange(vocab_size)
            if t not in avoid_token_ids:
                ids.append(t)
        out.append(BenchRequest(None, ids, rng.randint(*output_len)))
    return out


def _check_positive(name: str, value: int) -> None:
    check_int(name, value, 1)


# -- the simulator's requests ---------------------------------------------------

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
    # Seconds more before the engine sees it, on top of the simulator's latencies
    # (a replayed request: what the real router waited for its tokens).
    extra_latency_s: float = 0.0


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
    check_int(name, value, low)


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
                       avoid_token_ids: frozenset[int] = frozenset(),
                       num_system_prompts: int = 1) -> list[SimRequest]:
    """``num_sessions`` conversations of ``num_turns`` turns each (ids "s<i>-t<k>").

    ``num_system_prompts``: tenants, each with a system prompt of its own;
    session ``i`` belongs to tenant ``i mod num_system_prompts`` (1: one prompt
    shared by all, which every replica of a fleet ends up caching).
    """
    for name, v in (("num_sessions", num_sessions), ("multiturn_num_turns", num_turns),
                    ("multiturn_user_len", user_len), ("multiturn_output_len", output_len)):
        _check(name, v)
    _check("multiturn_system_len", system_len, 0)
    _check("multiturn_num_system_prompts", num_system_prompts)
    if not think_time >= 0:
        raise ValueError(f"multiturn_think_time={think_time} is invalid: must be >= 0")
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_len, vocab_size, avoid_token_ids)
               for _ in range(num_system_prompts)]
    starts = arrival_times(num_sessions, request_rate, burstiness, seed)
    out = []
    for s in range(num_sessions):
        history = list(systems[s % num_system_prompts])
        for k in range(num_turns):
            history += _tokens(rng, user_len, vocab_size, avoid_token_ids)
            answer = _tokens(rng, output_len, vocab_size, avoid_token_ids)
            out.append(SimRequest(f"s{s}-t{k}", list(history), output_len, starts[s],
                                  output_token_ids=answer,
                                  after=f"s{s}-t{k - 1}" if k else None,
                                  think_time=think_time if k else 0.0, session=f"s{s}"))
            history += answer
    return out


__all__ = ["CHAT_PROMPTS", "PASSAGES", "TASKS", "grounded_prompts", "request_delays",
           "poisson_delays", "arrival_times", "BenchRequest", "chat_workload", "random_workload",
           "SimRequest", "random_requests", "multiturn_requests"]
