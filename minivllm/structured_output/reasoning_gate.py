"""Structured outputs for a reasoning model: the grammar waits for the answer.

A reasoning model thinks aloud before it answers (``<think>`` ... ``</think>``);
a response format (a JSON schema, a tool call's grammar) is meant for the answer,
not for the thinking. A request whose ``StructuredOutputsParams`` carry
``reasoning_end_token_ids`` (the server fills them in with ``--reasoning-parser``,
as vLLM's structured-output manager asks its reasoner ``is_reasoning_end``) has
its grammar held back by a gate: while the output is reasoning its rows keep
every token and the grammar is fed nothing; from the token after the first
``reasoning_end_token_ids`` on, the grammar constrains as usual.

With ``reasoning_start_token_id`` (the ``qwen3`` family, which may answer
without thinking) the first output token decides: that token opens the
reasoning; any other is the answer's first token, so the first row allows the
grammar's tokens and that one.
"""

from __future__ import annotations

from typing import Optional, Sequence


class ReasoningGate:
    """Which output tokens are reasoning (the grammar's business begins after them)."""

    def __init__(self, end_token_ids: Sequence[int],
                 start_token_id: Optional[int] = None) -> None:
        self.end = tuple(end_token_ids)
        self.start = start_token_id
        # True: reasoning; False: the answer; None: not decided (no token yet, qwen3).
        self.thinking: Optional[bool] = True if start_token_id is None else None
        self.tail: tuple[int, ...] = ()  # the last tokens, to spot a multi-token end

    @property
    def undecided(self) -> bool:
        return self.thinking is None

    def feed(self, token_id: int) -> bool:
        """Take an output token; True if it is reasoning (the grammar must not see it)."""
        if self.thinking is None:
            self.thinking = token_id == self.start
            return self.thinking
        if not self.thinking:
            return False
        self.tail = (self.tail + (token_id,))[-len(self.end):]
        if self.tail == self.end:
            self.thinking = False  # the end tag itself is reasoning's, not the answer's
        return True

    def state(self) -> tuple:
        return self.thinking, self.tail

    def restore(self, state: tuple) -> None:
        self.thinking, self.tail = state
