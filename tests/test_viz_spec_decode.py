"""The acceptance histogram: shares per accepted count, one trace per workload."""

import pytest

from minivllm.core.trace import StepRecord
from minivllm.lab.viz.spec_decode import acceptance_histogram, accepted_counts


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


def test_slots_of_a_verification_by_kind():
    from minivllm.lab.viz.spec_decode import Verification, draft_slots_figure, slot_kinds

    # 6 known, 4 drafts in slots 6..9, 1 accepted: the request keeps 8 tokens (2 blocks).
    kinds, freed = slot_kinds(Verification("r", 6, 4, 1), block_size=4)
    assert freed == 1
    assert kinds == {4: "known", 5: "known", 6: "accepted draft", 7: "rejected, slot reused",
                     8: "rejected, block freed", 9: "rejected, block freed",
                     10: "empty, block freed", 11: "empty, block freed"}
    # All accepted: nothing is freed, nothing rejected.
    kinds, freed = slot_kinds(Verification("r", 6, 2, 2), block_size=4)
    assert freed == 0 and set(kinds.values()) == {"known", "accepted draft"}
    fig = draft_slots_figure([Verification("a", 6, 4, 1), Verification("b", 6, 2, 2)], 4)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["rejected, block freed"].x) == [8, 9]
    assert list(by_name["accepted draft"].y) == ["a", "b", "b"]
    with pytest.raises(ValueError, match="accepted <= drafts"):
        slot_kinds(Verification("r", 6, 2, 3), 4)
