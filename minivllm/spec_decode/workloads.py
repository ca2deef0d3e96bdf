"""Prompts for measuring speculation: input-grounded ones, where the answer
repeats its prompt (rewrite, extract, quote a given passage) and n-gram
lookup has something to find, beside the plain chat prompts of the
benchmarks (``minivllm.benchmarks.datasets.CHAT_PROMPTS``)."""

from __future__ import annotations

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


__all__ = ["PASSAGES", "TASKS", "grounded_prompts"]
