"""``lab/bench/beam_search``: a checkout timed against itself finds the same beams
and computes the same tokens on both sides (the harness runs each side's package in
its own process and reads its numbers back)."""

from __future__ import annotations

import pytest

from minivllm.lab.bench import beam_search as bench


@pytest.mark.slow
def test_a_checkout_against_itself(tmp_path, default_model_path):
    args = bench.argparse.Namespace(
        against=bench.THIS, rounds=1, repeats=1, beam_width=2, max_tokens=4,
        prompt="Name a colour.", engine_args="{}", other_engine_args=None, threads=None,
        extensions_dir=None)
    summary = bench.run(args)
    assert summary["same_beams"]
    # The same engine and prompt: the same tokens computed, a prompt and then one
    # request per beam and step over the prefix cache.
    assert summary["this"]["computed_tokens"] == summary["other"]["computed_tokens"] > 0
    assert summary["ratio"] > 0
