"""Stop strings on streamed text, against a character-by-character reference."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from minivllm.engine.stop_checker import StopStringChecker


def reference(text: str, stops: list[str], include: bool) -> tuple[str, Optional[str]]:
    """Read the text one character at a time; stop as soon as a stop string
    is complete (the longest one if several end at that character)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end] if include else text[:end - len(stop)], stop
    return text, None


def stream(deltas: list[str], stops: list[str], include: bool = False
           ) -> tuple[list[str], Optional[str], StopStringChecker]:
    """Feed deltas until a match; then flush like the output processor would."""
    checker = StopStringChecker(stops, include)
    emitted = []
    for delta in deltas:
        out, matched = checker.process(delta)
        emitted.append(out)
        if matched is not None:
            return emitted, matched, checker
    emitted.append(checker.finish())
    return emitted, None, checker


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_stop_string_split_across_many_deltas():
    text = "The answer is 42.<|end|> and then garbage"
    emitted, matched, _ = stream(list(text), ["<|end|>"])
    assert "".join(emitted) == "The answer is 42."
    assert matched == "<|end|>"
    # While "<|en" was arriving nothing of it leaked out.
    assert all("<" not in piece for piece in emitted)


def test_held_text_is_exactly_the_part_that_could_start_a_stop():
    checker = StopStringChecker(["<|end|>"])
    assert checker.process("abc<|e") == ("abc", None)
    assert checker.held_text == "<|e"
    assert checker.process("x") == ("<|ex", None)  # cannot be a stop any more
    assert checker.held_text == ""


def test_overlapping_self_similar_stop():
    # "aab" inside "aaab": the held "aa" must slide by one, not be dropped.
    emitted, matched, _ = stream(list("xaaab!"), ["aab"])
    assert "".join(emitted) == "xa" and matched == "aab"


def test_several_candidates_the_first_completed_wins():
    stops = ["abcd", "bc", "cde"]
    for deltas in (["xabcde"], list("xabcde"), ["xa", "bcd", "e"]):
        emitted, matched, _ = stream(deltas, stops)
        assert ("".join(emitted), matched) == ("xa", "bc")
    # Two stops ending on the same character: the longer one is cut.
    emitted, matched, _ = stream(["say hello!"], ["lo!", "o!"])
    assert ("".join(emitted), matched) == ("say hel", "lo!")


def test_stop_string_at_the_very_start():
    emitted, matched, _ = stream(["STOP", " rest"], ["STOP"])
    assert emitted == [""] and matched == "STOP"


def test_include_stop_str_in_output():
    emitted, matched, _ = stream(["Hello ##", "# world"], ["###"], include=True)
    assert "".join(emitted) == "Hello ###" and matched == "###"


def test_no_match_flushes_everything_on_finish():
    emitted, matched, checker = stream(["abc", "<|e"], ["<|end|>"])
    assert matched is None and emitted == ["abc", "", "<|e"]
    assert checker.held_text == ""


def test_no_stop_strings_passes_text_through():
    checker = StopStringChecker([])
    assert checker.process("anything") == ("anything", None)


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_cuts_match_the_character_reference(include):
    rng = random.Random(0)
    for trial in range(2000):
        alphabet = "ab#"[:rng.randint(2, 3)]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        deltas = split_randomly(text, rng)
        emitted, matched, _ = stream(deltas, stops, include)
        assert ("".join(emitted), matched) == reference(text, stops, include), \
            (trial, stops, deltas)


def test_held_text_never_exceeds_longest_stop_minus_one():
    rng = random.Random(1)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                 for _ in range(2)]
        checker = StopStringChecker(stops)
        for delta in split_randomly("".join(rng.choice("abc") for _ in range(30)), rng):
            if checker.process(delta)[1] is not None:
                break
            assert len(checker.held_text) <= max(map(len, stops)) - 1


def test_errors():
    with pytest.raises(ValueError, match="stop="):
        StopStringChecker(["ok", ""])
    checker = StopStringChecker(["x"])
    assert checker.process("ax") == ("a", "x")
    assert checker.stop_reason == "x"
    with pytest.raises(RuntimeError, match="already matched"):
        checker.process("more")
