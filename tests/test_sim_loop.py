"""The engine loop in the simulator: the core's Python per step is added to the model
step in the synchronous loop and hidden under it by async scheduling
(``CostModel.loop_time``); and a calibration made on other weights is refused."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.config import EngineArgs
from minivllm.lab.sim import Hardware, SimRequest, Simulator, load_model_config

# Peaks so large that every roofline term is ~0: a step's model time is then its
# overheads alone, 10 ms, and the core's Python 4 ms + 1 ms per sequence, so each
# step's time follows from the rule by hand.
HAND = Hardware("hand", 1e30, 1e30, 1e12, 1e30, step_overhead_s=10e-3,
                per_seq_overhead_s=0.0, python_step_s=4e-3, python_per_seq_s=1e-3,
                dtype="float32", device="cpu")


def run(model_path, n_seqs: int, async_scheduling, output_len: int = 6):
    sim = Simulator(load_model_config(model_path, "float32", "cpu"), HAND,
                    EngineArgs(model=model_path, num_kv_blocks=64,
                               async_scheduling=async_scheduling))
    work = [SimRequest(f"r{i}", [5 + i] * 8, output_len) for i in range(n_seqs)]
    return sim.run(work)


@pytest.mark.parametrize("n_seqs, sync_ms, async_ms", [
    (1, 10 + 4 + 1, 10),  # Python 5 ms: under the 10 ms model step, hidden
    (8, 10 + 4 + 8, 4 + 8),  # Python 12 ms: longer than the model step, it sets the pace
])
def test_async_scheduling_hides_the_core_python_under_the_model_step(
        tiny_model, n_seqs, sync_ms, async_ms):
    path = tiny_model("llama")
    sync, overlapped = run(path, n_seqs, False), run(path, n_seqs, True)
    assert [s["num_seqs"] for s in sync.steps] == [s["num_seqs"] for s in overlapped.steps]
    assert all(s["num_seqs"] == n_seqs for s in sync.steps)
    ms = lambda res: [round(s["duration"] * 1e3, 9) for s in res.steps]  # noqa: E731
    assert ms(sync) == [sync_ms] * len(sync.steps)
    # The first step after an idle engine has nothing in flight to hide behind.
    assert ms(overlapped) == [sync_ms] + [async_ms] * (len(sync.steps) - 1)
    for a, b in zip(sync.requests, overlapped.requests):  # TPOT: one step per token
        assert (a.e2e - a.ttft) / (a.output_tokens - 1) == pytest.approx(sync_ms / 1e3)
        assert (b.e2e - b.ttft) / (b.output_tokens - 1) == pytest.approx(async_ms / 1e3)


def test_the_default_loop_is_the_engine_s(tiny_model):
    """EngineArgs' async_scheduling None is resolved as the engine resolves it."""
    from minivllm.config import EngineArgs as Args

    path = tiny_model("llama")
    engine = bool(Args(model=path).create_engine_config().async_scheduling)
    sim = Simulator(load_model_config(path, "float32", "cpu"), HAND,
                    EngineArgs(model=path, num_kv_blocks=64))
    assert sim.async_scheduling is engine is sim.cost_model.async_scheduling


def test_the_core_python_fit_gives_the_constants_back():
    from minivllm.lab.sim.calibrate import fit_python, with_python

    rows = np.zeros((6, 11))
    rows[:, 1] = [1, 1, 8, 32, 64, 24]
    python = 0.7e-3 + 25e-6 * rows[:, 1]
    a, b, err = fit_python(rows, python)
    assert (a, b) == (pytest.approx(0.7e-3), pytest.approx(25e-6)) and err < 1e-9
    hw, line = with_python(HAND, rows, python)
    assert (hw.python_step_s, hw.python_per_seq_s) == (pytest.approx(a), pytest.approx(b))
    assert with_python(HAND.with_(python_step_s=0.0), rows, None)[0].python_step_s == 0.0


def test_a_calibration_of_other_weights_is_refused_naming_both(tiny_model, tmp_path,
                                                                capsys):
    from minivllm.entrypoints.cli import main

    path = tiny_model("llama")
    model = load_model_config(path, "float32", "cpu")  # float: quantization "none"
    with pytest.raises(ValueError, match="quantization='gguf'.*quantization='none'"):
        Simulator(model, HAND.with_(quantization="gguf"), EngineArgs(model=path))
    Simulator(model, HAND.with_(quantization="none"), EngineArgs(model=path))
    Simulator(model, HAND, EngineArgs(model=path))  # not recorded: not checked
    cal = tmp_path / "cal.json"
    HAND.with_(quantization="gguf").save(cal)
    assert main(["simulate", "--model", str(path), "--hardware", str(cal), "--num-prompts", "2",
                 "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "'gguf'" in err and "'none'" in err and "--model default" in err
