"""The A/B harness and the operator profile chapter 15 measures with."""

from __future__ import annotations

import pytest
import torch

from minivllm.lab.bench.ab_timing import Timings, alternate
from minivllm.lab.bench.op_profile import profile_ops


def test_alternate_takes_turns_and_times_every_round():
    log = []
    t = alternate({"a": lambda: log.append("a"), "b": lambda: log.append("b")},
                  rounds=4, calls=2, warmup=1)
    warm, timed = log[:2], log[2:]
    assert warm == ["a", "b"]
    # Rounds alternate who goes first: a a b b, then b b a a, ...
    assert timed == ["a", "a", "b", "b", "b", "b", "a", "a"] * 2
    assert set(t.rounds) == {"a", "b"}
    assert all(len(v) == 4 and all(s >= 0 for s in v) for v in t.rounds.values())


def test_timings_ratios_are_medians_and_per_round():
    t = Timings({"slow": [4.0, 9.0, 5.0], "fast": [1.0, 3.0, 2.0]})
    assert t.median("slow") == 5.0 and t.best("fast") == 1.0
    assert t.ratio("slow", "fast") == 2.5
    assert t.round_ratios("slow", "fast") == [4.0, 3.0, 2.5]


@pytest.mark.parametrize("kwargs,field", [({"rounds": 0}, "rounds"), ({"calls": 1.5}, "calls"),
                                          ({"warmup": -1}, "warmup")])
def test_alternate_names_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        alternate({"a": lambda: None}, **kwargs)
    with pytest.raises(ValueError, match="contenders"):
        alternate({})


def test_profile_counts_the_operators_python_called():
    x = torch.ones(4)

    def four_ops():
        y = x + 1  # aten::add
        return torch.nn.functional.linear(y[None], torch.eye(4))  # unsqueeze, eye, linear

    prof = profile_ops(four_ops)
    # aten::linear calls aten::t and aten::addmm/matmul inside: counted as one.
    assert prof.calls == {"aten::add": 1, "aten::unsqueeze": 1, "aten::eye": 1,
                          "aten::linear": 1}
    assert prof.num_ops == sum(prof.calls.values())
    assert "aten::addmm" not in prof.calls and "aten::mm" not in prof.calls
    assert 0 < prof.op_seconds and prof.outside_ops >= 0
    assert set(prof.top(2)) <= set(prof.calls)
