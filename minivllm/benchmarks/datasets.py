"""Workloads for the benchmarks: built-in chat prompts, or random token prompts.

``CHAT_PROMPTS`` are 64 short, varied user turns (questions, instructions,
translation, code, some in Chinese), the kind of traffic a small chat model
sees. ``chat_workload`` cycles through them; ``random_workload`` draws token
IDs uniformly, with prompt and output lengths drawn from ranges (vLLM's
"random" dataset), and is meant to be run with ``ignore_eos`` so every
request produces exactly its output length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

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
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


__all__ = ["BenchRequest", "CHAT_PROMPTS", "chat_workload", "random_workload"]
