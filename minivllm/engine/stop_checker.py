"""Stop strings on streamed text: hold back what might still become a stop.

Stop *token IDs* and EOS are checked on tokens in the engine core; stop
*strings* can only be checked on text, so they live on the output path, after
the detokenizer. A stop string can arrive split across several deltas
("<|en" + "d|>"), so the checker keeps back the end of the text while it
could still be the start of a stop string, and emits it once it cannot:

    stop = ["###"], deltas "ab#", "#c", ...
      "ab#"  -> emit "ab", hold "#"        ("#" might begin "###")
      "#c"   -> text "##c": no match, no suffix begins "###" -> emit "##c"

On a match the text before the stop string is emitted (plus the stop string
itself with ``include_stop_str_in_output``); the request then finishes with
``finish_reason="stop"`` and ``stop_reason`` = that string.

Which match counts when several stop strings occur: the one that is
*completed* first, i.e. the earliest end; on a tie, the longest. That is what
a token-by-token stream sees, so the result never depends on how the text was
cut into deltas.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from minivllm.core.outputs import EngineCoreOutput


class StopStringChecker:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={stop!r} is invalid: must be a list of non-empty strings")
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: Optional[str] = None
        self._held = ""

    @property
    def held_text(self) -> str:
        """Text received but not emitted yet (it might begin a stop string)."""
        return self._held

    def process(self, delta: str) -> tuple[str, Optional[str]]:
        """Take a text delta; return (text to emit now, matched stop string or None)."""
        if self.stop_reason is not None:
            raise RuntimeError(f"stop string {self.stop_reason!r} already matched: "
                               "the request has finished and takes no more text")
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self.stop_reason = stop
            end = start + len(stop) if self.include_stop_str_in_output else start
            return text[:end], stop
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], None

    def finish(self) -> str:
        """The generation ended another way (EOS, length): flush the held text."""
        text, self._held = self._held, ""
        return text

    def apply_run(self, apply, state, o: EngineCoreOutput) -> bool:
        """A verified speculative run, applied (``apply(state, output)``, the output
        processor's) one token at a time, so that a stop string ends it at the token that
        completes it, exactly as without speculation; True if a stop string finished it."""
        for one in self.split_run(o):
            matched = apply(state, one)
            if state.finished:
                return matched
        return False

    @staticmethod
    def split_run(o: EngineCoreOutput) -> Iterator[EngineCoreOutput]:
        """A run of several tokens (verified speculation) as one output per token; the
        finish, if any, comes with the last one."""
        ids, lps = o.new_token_ids, o.new_logprobs
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            yield dataclasses.replace(
                o, new_token_ids=[token_id], new_logprobs=None if lps is None else [lps[i]],
                finish_reason=o.finish_reason if last else None,
                stop_reason=o.stop_reason if last else None, num_draft_tokens=0)

    def _first_match(self, text: str) -> Optional[tuple[int, str]]:
        """(start, stop string) of the match that ends first; longest on a tie."""
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for stop in self.stop:
            start = text.find(stop)  # the first occurrence also ends first
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop.

        No match can start before that suffix (it would have to be a stop
        prefix too), so everything before it is safe to emit.
        """
        longest = max((len(s) for s in self.stop), default=1) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0


__all__ = ["StopStringChecker"]
