"""The calibration's fit: physical bounds, uncertainties that mean what they say,
refusal of what a workload cannot identify, and its design checked on the
scheduler's own steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minivllm.config import EngineArgs
from minivllm.lab.sim import Hardware, load_model_config
from minivllm.lab.sim.calibrate import calibration_workload, fit, simulated_rows
from minivllm.lab.sim.cost_model import times_of
from minivllm.lab.sim.fit import FITTED, CalibrationError, bounds_of
from tests.cpu_requirements import needs_cpu_kernels

MODEL = load_model_config("smollm2-135m", "float32", "cpu")
# Peaks of the order this 2-core machine's probes measure (float32).
BASE = Hardware("x", 1e11, 1e10, 1e10, 1e10, dtype="float32", device="cpu")
TRUTH = BASE.with_(flops_efficiency=0.45, bandwidth_efficiency=0.7, attention_efficiency=0.3,
                   step_overhead_s=4e-3, per_seq_overhead_s=3e-4)


@pytest.fixture(scope="module")
def design_rows():
    """The steps the calibration workload makes, as the real scheduler cuts them."""
    rounds = calibration_workload(MODEL.vocab_size, seed=0, scale=4)  # the command's
    return simulated_rows(MODEL, BASE, EngineArgs(max_num_batched_tokens=512), rounds)


def noisy(rows, hw, sigma, seed):
    rng = np.random.default_rng(seed)
    return times_of(rows, hw) * np.exp(rng.normal(0.0, sigma, len(rows)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_the_constants_within_their_reported_uncertainty(design_rows, seed):
    res = fit(BASE, design_rows, noisy(design_rows, TRUTH, 0.03, seed)).result
    for name in FITTED:
        truth, got, err = getattr(TRUTH, name), res.values[name], res.stderr[name]
        assert name not in res.at_bound
        assert 0 < err < 0.5 * got, (name, got, err)
        assert abs(got - truth) <= 3 * err, (name, got, truth, err)
    # The residuals' spread is the noise put in (log-normal, sigma 3 %).
    assert res.residual_std == pytest.approx(0.03, rel=0.25)


def test_noiseless_step_times_give_the_constants_back_exactly(design_rows):
    res = fit(BASE, design_rows, times_of(design_rows, TRUTH)).result
    for name in FITTED:
        assert res.values[name] == pytest.approx(getattr(TRUTH, name), rel=1e-4)


def test_efficiencies_stay_at_most_one_of_the_measured_peaks(design_rows):
    """Kernels 1.6x faster than the FLOP/s probe: the fit pins the efficiency at 1
    (and says so) instead of inventing a number beyond the peak."""
    fast = TRUTH.with_(flops_efficiency=1.6)
    measured = noisy(design_rows, fast, 0.03, 0)
    cal = fit(BASE, design_rows, measured)
    res, bounds = cal.result, bounds_of(design_rows, measured)
    assert res.at_bound["flops_efficiency"] == "upper"
    assert res.values["flops_efficiency"] == pytest.approx(1.0)
    assert np.isnan(res.stderr["flops_efficiency"])
    for name in FITTED:
        lo, hi = bounds[name]
        assert lo <= res.values[name] <= hi
        assert getattr(cal.hardware, name) == res.values[name]
    assert bounds["step_overhead_s"][1] == measured.min()
    assert any("at its upper bound" in line for line in res.describe())


def test_a_constant_no_step_depends_on_is_refused_naming_it(design_rows):
    """Steps whose attention costs nothing (no cached context anywhere): nothing in
    them can say how fast attention runs, so nothing is written."""
    rows = design_rows.copy()
    rows[:, 5:7] = 0.0  # attention FLOPs and bytes
    with pytest.raises(CalibrationError, match="attention_efficiency is not identified: it "
                                               "does not change .*long contexts"):
        fit(BASE, rows, noisy(rows, TRUTH, 0.03, 0))


def test_one_sequence_per_step_cannot_tell_the_step_from_the_sequence_cost(design_rows):
    """Without a step of more than one sequence, 'per step' and 'per sequence' add
    the same to every step: the fit names both instead of splitting them at random."""
    single = design_rows[design_rows[:, 1] == 1]
    with pytest.raises(CalibrationError,
                       match="step_overhead_s and per_seq_overhead_s are not identified|"
                             "per_seq_overhead_s and step_overhead_s are not identified"):
        fit(BASE, single, noisy(single, TRUTH, 0.03, 0))


def test_a_constant_the_noise_hides_is_refused_with_what_the_workload_needs(design_rows):
    """Step times 10x noisier: a per-step cost of 4 ms under 80 ms steps can no longer
    be told from the weights' read time, and its error would move predictions by
    several percent. Where its estimate is still clearly above 0 (over 2 standard
    errors; the draw of seed 3) and a stricter ``max_relative_error`` asks for 30 %,
    the fit says so instead of writing a number (it is not consistent with 0, so it
    is not pinned)."""
    import re

    with pytest.raises(CalibrationError, match="step_overhead_s is not identified: .*"
                                               "lone short prefills") as refused:
        fit(BASE, design_rows, noisy(design_rows, TRUTH, 0.1, 3), max_relative_error=0.3)
    value, err = map(float, re.search(r"identified: (\S+) \+- (\S+) ",
                                      str(refused.value)).groups())
    assert 2 * err < value < err / 0.3, (value, err)


def test_an_unidentified_overhead_consistent_with_zero_is_pinned_at_zero(design_rows):
    """Steps made with no per-step cost at all: the free fit's estimate of
    ``step_overhead_s`` is smaller than its uncertainty (the old fit refused it);
    the data are consistent with no such cost, so it is pinned at 0 (as an
    efficiency above its peak is pinned at 1), the rest refitted, and reported.
    The refitted constants are the true ones within their errors. (Seed 1's free
    fit lands on the bound 0 itself, which is no test of the pinning.)"""
    from minivllm.lab.sim.fit import ZERO_Z

    truth = TRUTH.with_(step_overhead_s=0.0)
    for seed in (0, 2, 3):
        res = fit(BASE, design_rows, noisy(design_rows, truth, 0.03, seed)).result
        was, err = res.zeroed["step_overhead_s"]
        assert err > 0.5 * was  # what the old rule refused: not identified
        assert was <= ZERO_Z * err  # and consistent with 0
        assert res.at_bound["step_overhead_s"] == "zero"
        assert res.values["step_overhead_s"] == 0.0 == res.hardware.step_overhead_s
        assert any(line.startswith("step_overhead_s") and "pinned at 0" in line
                   for line in res.describe())
        for name in FITTED:
            if name != "step_overhead_s":
                got, e = res.values[name], res.stderr[name]
                assert abs(got - getattr(truth, name)) <= 3 * e, (name, got, e)


def test_a_real_engine_s_steps_are_the_designed_ones_and_the_fit_keeps_its_bounds(
        tiny_model, tmp_path):
    """The calibration on a real (tiny) engine: each step it records has the
    composition the simulator's scheduler gives the same rounds (so the design
    checks above hold for real runs), and the fitted constants keep their bounds.
    A tiny model's step times are mostly noise on a busy machine, so the fit may
    also be refused (a constant no step depends on at the fitted point): then the
    refusal must name the constant."""
    from minivllm.lab.sim.calibrate import calibrate

    path, steps = tiny_model("llama"), tmp_path / "steps.npz"
    rounds = [([[5 + i] * (8 + 4 * i) for i in range(n)], [3 + n] * n) for n in (1, 3, 6)]
    try:
        cal = calibrate(path, {"num_kv_blocks": 64}, rounds=rounds, base=BASE,
                        max_relative_error=float("inf"), steps_path=steps)
    except CalibrationError as refused:
        assert any(name in str(refused) for name in FITTED), refused
        cal = None
    m = load_model_config(path, "float32", "cpu")
    designed = simulated_rows(m, BASE, EngineArgs(model=path, num_kv_blocks=64), rounds)
    kept = np.load(steps)
    assert np.array_equal(kept["rows"], designed)
    # The core's Python of every step, timed apart from its model time, and the
    # weights the engine resolved ("auto" on a float folder: none) go with the peaks.
    assert kept["python"].shape == kept["measured"].shape and (kept["python"] > 0).all()
    assert json.loads(str(kept["base"]))["quantization"] == "none"
    if cal is None:
        return
    assert cal.hardware.quantization == "none" and cal.hardware.python_step_s >= 0
    assert np.array_equal(cal.rows, designed)
    bounds = bounds_of(cal.rows, cal.measured)
    for name in FITTED:
        lo, hi = bounds[name]
        assert lo <= getattr(cal.hardware, name) <= hi
    assert cal.hardware.name == "cpu-calibrated" and "fitted to" in cal.hardware.source


def test_the_command_writes_a_fit_and_refuses_to_write_an_unidentified_one(
        design_rows, tmp_path, capsys):
    from minivllm.entrypoints.cli import main
    from minivllm.lab.sim.calibrate import save_steps
    from minivllm.lab.sim.hardware import load_hardware

    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    save_steps(good, BASE, design_rows, noisy(design_rows, TRUTH, 0.03, 0), 1)
    single = design_rows[design_rows[:, 1] == 1]
    save_steps(bad, BASE, single, noisy(single, TRUTH, 0.03, 0), 1)
    out = tmp_path / "cal.json"
    assert main(["simulate", "calibrate", "--from-steps", str(good), "--output", str(out),
                 "--no-serve"]) == 0
    hw = load_hardware(str(out))
    assert hw.name == "cpu-calibrated" and "+-" in hw.source
    assert hw.flops_efficiency == fit(BASE, design_rows,
                                      noisy(design_rows, TRUTH, 0.03, 0)).hardware.flops_efficiency
    refused = tmp_path / "refused.json"
    assert main(["simulate", "calibrate", "--from-steps", str(bad), "--output", str(refused),
                 "--no-serve"]) == 2
    assert "per_seq_overhead_s" in capsys.readouterr().err and not refused.exists()
    old = tmp_path / "old.npz"  # kept by a version that priced the LM head with the layers
    save_steps(old, BASE, design_rows[:, :9], noisy(design_rows, TRUTH, 0.03, 0), 1)
    assert main(["simulate", "calibrate", "--from-steps", str(old), "--output", str(refused),
                 "--no-serve"]) == 2
    assert "rows have 9 features" in capsys.readouterr().err and not refused.exists()


# -- the peaks: the engine's own kernels, a curve over row counts -----------------

CURVE = BASE.with_(linear_flops_by_rows=((16, 3e10), (256, 1e11), (257, 4e10), (512, 4e10)),
                   peak_flops=1e11, attention_bandwidth=2e10, attention_flops=1e10)


def test_a_row_dependent_peak_and_an_attention_bandwidth_are_recovered_and_round_trip(
        design_rows, tmp_path):
    """With the matrix products' peak a curve over the step's token rows (a kernel
    switch at 256) and attention priced at its kernels' own peaks (decode: K/V
    bandwidth, prefill: FLOP/s), the fit still gives the constants back exactly
    from noiseless steps, and the hardware file keeps all three."""
    truth = CURVE.with_(**{n: getattr(TRUTH, n) for n in FITTED})
    cal = fit(CURVE, design_rows, times_of(design_rows, truth))
    for name in FITTED:
        assert getattr(cal.hardware, name) == pytest.approx(getattr(truth, name), rel=1e-4)
    # The curve changes the prediction where the kernels switch (not a no-op).
    big = design_rows[design_rows[:, 0] > 256]
    assert big.size and (times_of(big, truth) > times_of(big, truth.with_(
        linear_flops_by_rows=())) * 1.2).any()
    truth.save(tmp_path / "hw.json")
    from minivllm.lab.sim.hardware import load_hardware

    assert load_hardware(str(tmp_path / "hw.json")) == truth
    with pytest.raises(ValueError, match="linear_flops_by_rows=.*rows increasing"):
        BASE.with_(linear_flops_by_rows=((256, 1e11), (16, 3e10)))


def test_the_cost_model_prices_a_step_at_the_curve_s_peak_for_its_rows():
    """The linear group at the curve's FLOP/s for the step's token rows, the attention
    group at the attention kernels' own peaks; the presets (no curve, no attention
    peaks) keep the peak and bandwidth of the matrix products."""
    from minivllm.lab.sim.cost_model import CostModel

    hw = CURVE.with_(bandwidth_efficiency=1.0, flops_efficiency=1.0, attention_efficiency=0.5)
    plain = hw.with_(linear_flops_by_rows=(), attention_bandwidth=0.0, attention_flops=0.0)
    for tokens, peak in ((512, 4e10), (256, 1e11), (136, 6.5e10), (8, 3e10)):
        f = CostModel(MODEL, hw).features_from(tokens, 1, 1, tokens * (tokens + 1) // 2,
                                                2 * tokens)
        got, old = CostModel(MODEL, hw).breakdown(f), CostModel(MODEL, plain).breakdown(f)
        assert got["linear"] == pytest.approx(max(f.linear_flops / peak,
                                                  f.linear_bytes / hw.mem_bandwidth))
        assert got["attention"] == pytest.approx(max(f.attention_flops / 1e10,
                                                     f.attention_bytes / 2e10) / 0.5)
        assert old["linear"] == pytest.approx(max(f.linear_flops / 1e11,
                                                  f.linear_bytes / hw.mem_bandwidth))
        assert old["attention"] == pytest.approx(max(f.attention_flops / 1e11,
                                                     f.attention_bytes / 1e10) / 0.5)


def test_the_lm_head_is_priced_at_its_own_rows():
    """Only sampling rows get logits, so a lone prefill's head is one row: a
    matrix-vector product streaming the vocabulary's weights beside layers that
    wait on FLOP/s (a profiled 64-token prefill of the default model on the Xeon:
    7.7 ms in the head's product, hidden by ``max`` when the head was priced with
    the layers). A decode batch whose layers and head are both compute-bound costs
    what one group did; a prompt chunk that samples nothing has no head."""
    from minivllm.lab.sim.cost_model import CostModel

    hw = CURVE.with_(bandwidth_efficiency=1.0, flops_efficiency=1.0)
    cm = CostModel(MODEL, hw)
    V, h, e = MODEL.vocab_size, MODEL.hidden_size, 4  # float32
    stream = (V * h + h + V) * e / hw.mem_bandwidth
    lone = cm.breakdown(cm.features_from(128, 1, 1, 128 * 129 // 2, 256))
    assert lone["lm_head"] == pytest.approx(stream)
    layers = cm.features_from(128, 1, 0, 128 * 129 // 2, 256)
    assert lone["linear"] == pytest.approx(layers.linear_flops / float(hw.linear_peak(128)))
    assert cm.breakdown(layers)["lm_head"] == 0
    f = cm.features_from(64, 64, 64, 64 * 40, 64 * 42)
    one_group = (f.linear_flops + f.head_flops) / float(hw.linear_peak(64))
    assert f.head_flops == 2 * 64 * V * h
    got = cm.breakdown(f)
    assert got["linear"] + got["lm_head"] == pytest.approx(one_group)


@needs_cpu_kernels()
def test_the_peaks_are_measured_on_the_engine_s_own_kernels_and_bound_its_steps(tiny_model):
    """Where the CPU kernels are on, the matmul peak is the engine's own layers as it
    calls them (the packed twins), at row counts either side of the kernel switch,
    and it is at least what the engine reaches on a large prefill step (so the
    fitted efficiency is a fraction, not pinned at 1); on the reference path the
    probes stand (no engine peaks)."""
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.cpu.layers import PackedLinear
    from minivllm.cpu.prepack import PANEL_MAX_ROWS
    from minivllm.lab.sim.cost_model import CostModel
    from minivllm.lab.sim.engine_peaks import engine_peaks, layer_linears

    path, n = tiny_model("llama"), 256
    # One thread, engine and probe alike: on a machine shared with other work a
    # two-thread product of this tiny size waits for a descheduled thread at its
    # barrier far more often than it runs undisturbed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(path, trace=True, num_kv_blocks=128, max_num_batched_tokens=512)
    try:
        runner = llm.engine_core.executor.runner
        linears = layer_linears(runner.model)
        assert len(linears) == 4 and all(isinstance(m, PackedLinear) for m in linears)
        assert all(m is l for m, l in zip(linears, [
            runner.model.model.layers[0].self_attn.qkv_proj,
            runner.model.model.layers[0].self_attn.o_proj,
            runner.model.model.layers[0].mlp.gate_up_proj,
            runner.model.model.layers[0].mlp.down_proj]))
        peaks = engine_peaks(runner, min_seconds=0.1)
        curve = dict(peaks.linear_by_rows)
        assert {PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1} <= set(curve)
        assert peaks.attention_bandwidth > 0 and peaks.attention_flops > 0
        # The engine's own large-batch steps: lone prefills of n tokens.
        for i in range(3):
            llm.generate([{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(n)]}],
                         SamplingParams(max_tokens=1), use_tqdm=False)
        steps = [r.duration for r in llm.trace if r.num_batched_tokens == n]
        model = llm.llm_engine.config.model
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)
    assert len(steps) == 3
    f = CostModel(model, BASE).features_from(n, 1, 1, n * (n + 1) // 2, 2 * n)
    assert curve[n] >= f.linear_flops / float(np.median(steps))
    ref = LLM(path, num_kv_blocks=16, cpu_kernels=False)
    try:
        assert engine_peaks(ref.engine_core.executor.runner) is None
    finally:
        ref.shutdown()


def test_a_peak_point_slower_than_a_larger_product_is_capped_by_it():
    """A product of fewer rows never takes longer than one of more: a measured point
    that did (other work held the cores) takes the larger product's time; points
    that keep the rule, the kernel switch's drop among them, stay as measured."""
    from minivllm.lab.sim.engine_peaks import no_slower_with_fewer_rows

    clean = ((16, 3.6e11), (64, 4.5e11), (256, 4.4e11), (257, 1e11), (512, 8e10))
    assert no_slower_with_fewer_rows(clean) == clean
    got = dict(no_slower_with_fewer_rows(((16, 8e9), *clean[1:])))
    assert got[16] == pytest.approx(16 / (64 / 4.5e11))  # the 64-row product's time
    assert {r: got[r] for r, _ in clean[1:]} == dict(clean[1:])
    for (r1, f1), (r2, f2) in zip(sorted(got.items()), sorted(got.items())[1:]):
        assert r1 / f1 <= r2 / f2 * (1 + 1e-12)


def test_the_host_bandwidth_is_the_median_of_rounds_each_pairing_one_moment(monkeypatch):
    """Every core's readers and one reader are measured in turn, round after round:
    the result is ``one`` times the median of the rounds' ratios (at least 1), so a
    slow moment on one side of one round cannot set it; with as many threads as
    cores there is nothing to share and ``one`` comes back as is."""
    import os
    import statistics

    import torch

    from minivllm.lab.sim import hardware

    cores = len(os.sched_getaffinity(0))
    readings = iter([9.0, 3.0, 1.0, 5.0, 8.0, 4.0, 6.0, 3.0, 20.0, 4.0, 7.0, 2.0, 5.0, 5.0])
    calls = []

    def fake(k, min_seconds):
        calls.append(k)
        return next(readings)

    monkeypatch.setattr(hardware, "_readers", fake)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host, ratios = hardware.host_bandwidth(2.0)
        assert torch.get_num_threads() == 1  # restored
    finally:
        torch.set_num_threads(threads)
    if cores == 1:
        assert (host, ratios) == (2.0, [])
        return
    assert calls == [cores, 1] * hardware.HOST_BANDWIDTH_ROUNDS
    assert ratios == [3.0, 0.2, 2.0, 2.0, 5.0, 3.5, 1.0]
    assert host == 2.0 * statistics.median(ratios)
    torch.set_num_threads(cores)
    try:
        assert hardware.host_bandwidth(2.0) == (2.0, [])
    finally:
        torch.set_num_threads(threads)


def test_the_host_probe_reads_more_with_every_core_than_with_one():
    """The real probe (no stand-in): every core's readers move at least as many bytes
    as one reader, within the noise of a shared machine, and each reading is a
    plausible memory bandwidth."""
    import os

    from minivllm.lab.sim.hardware import _readers

    one = _readers(1, 0.05, num_bytes=1 << 24)
    every = _readers(len(os.sched_getaffinity(0)), 0.05, num_bytes=1 << 24)
    assert 1e8 < one < 1e13 and every > 0.5 * one
