"""The acceptance histogram: shares per accepted count, one trace per workload."""

import pytest

from minivllm.trace import StepRecord
from minivllm.viz.spec import acceptance_histogram, accepted_counts


def test_shares_per_accepted_count():
    fig = acceptance_histogram({"chat": [0, 0, 1, 0], "passage": [3, 3, 2]}, k=3)
    chat, passage = fig.data
    assert list(chat.x) == [0, 1, 2, 3]
    assert list(chat.y) == [0.75, 0.25, 0.0, 0.0]
    assert list(passage.y) == pytest.approx([0, 0, 1 / 3, 2 / 3])
    assert chat.name == "chat (4)"


def test_counts_from_a_trace_and_bad_counts():
    records = [StepRecord(step=0, start=0.0, duration=0.0, spec_decode={"a": (4, 2), "b": (4, 0)}),
               StepRecord(step=1, start=0.0, duration=0.0, spec_decode={"a": (4, 4)})]
    assert accepted_counts(records) == [2, 0, 4]
    with pytest.raises(ValueError, match="k=3"):
        acceptance_histogram({"x": [4]}, k=3)
