"""``benchmarks/decode_share.py`` times every decode step's replay and nothing else."""

import pytest

from minivllm.lab.bench.decode_share import measure, timed_replay
from minivllm.entrypoints.llm import LLM


def test_each_decode_step_is_timed_once_and_the_replay_is_restored(tiny_model):
    llm = LLM(tiny_model("llama"))
    replay = llm.engine_core.executor.runner.decode_replay
    assert replay is not None
    share = measure(llm, max_tokens=9, probe_seconds=0.01,
                    prompt=[1, 5, 9, 2])
    # The first token comes from the prefill; each of the other 8 is one replayed step.
    assert len(share.replay_seconds) == 8
    assert 0 < sum(share.replay_seconds) < share.seconds
    assert "_run" not in vars(replay)  # the class's method is back
    assert share.weight_bytes > 0 and share.bandwidth > 0


def test_an_engine_without_a_replay_says_why(tiny_model):
    llm = LLM(tiny_model("llama"))
    runner = llm.engine_core.executor.runner
    runner.decode_replay = None
    with pytest.raises(RuntimeError, match="replays no decode step"):
        with timed_replay(llm):
            pass
