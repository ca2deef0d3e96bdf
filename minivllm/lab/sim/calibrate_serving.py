"""What serving adds to the engine's steps, fitted on a real ``minivllm serve``.

Part 2 of ``minivllm simulate calibrate`` (``simulate validate`` calls the same
``serve_calibration`` when it is given no calibration file): the offline fit
prices the model work of a step; a served engine adds, fitted here on runs of
their own prompts, never the validated ones,

- a fixed time and a time per scheduled sequence per step (the engine core's
  loop around ``step()``: the pipe, the API process turning each sequence's
  token into a streamed chunk on the same cores), fitted to the median TPOT of
  one request at a time and of all at once: the schedules of both do not
  depend on step times, so the TPOTs are linear in the two overheads (three
  simulations give the map), solved with both >= 0;
- a per-request serving latency (HTTP, IPC, queue, streaming): measured, not
  left over from a price: each one-at-a-time request's TTFT at the client less
  the server's own prefill time (its ``/metrics``: first scheduled to first
  token), in ``OUTSIDE_CHUNKS`` runs read against the server. A residual against
  the simulated TTFT (as fitted before) also took in how far this machine's
  speed moved since part 1 priced the steps, 6 to 29 ms over five calibrations;
  the served prefill's price against its measured time is printed instead,
  with a warning past ``SPEED_MOVED``;
- an idle engine's wake-up cost ``w (1 - exp(-t / tau))``: single requests
  sent after idle pauses of 0.5 and 2.5 s against back-to-back ones.

Each constant's standard error is a bootstrap over the measured requests
(resampled, medians taken again, the same solve), since each comes from a
median of a handful of requests rather than from a residual.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import numpy as np

from minivllm.lab.bench.serve import benchmark, compute_metrics
from minivllm.config import EngineArgs
from minivllm.lab.sim.fit import ZERO_Z

BOOTSTRAP = 200  # resamples for the standard errors
# A lone served prefill more than this far from part 1's price: the served engine
# runs at another speed than the one priced (the machine moved between the parts,
# or the fit misprices a served prompt's size), and every prediction moves with it.
SPEED_MOVED = 0.10


def measure_requests(base_url: str, work, rate: float, seed: int, max_concurrency=None):
    """(metrics, per-request results) of ``bench serve`` sending ``work`` at ``rate``."""
    payloads = [{"prompt": w.prompt_token_ids, "max_tokens": w.output_len,
                 "temperature": 0.0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}} for w in work]
    results, duration = asyncio.run(benchmark(base_url, payloads, False, rate,
                                              max_concurrency, 1800, 600, seed))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: "
                           f"{failed[0]}")
    return compute_metrics(results, duration), results


OUTSIDE_CHUNKS = 4  # one-at-a-time runs, each read against the server's /metrics


def server_means(base_url: str, before: dict, count: int, wait_s: float = 5.0) -> dict:
    """Mean server-side latencies of the ``count`` requests finished since ``before``
    (``real_fleet.server_latency_sums``); waits up to ``wait_s`` for their records."""
    from minivllm.lab.sim.real_fleet import server_latency_means, server_latency_sums

    deadline = time.monotonic() + wait_s
    while True:
        after = server_latency_sums([base_url])
        done = after["request_prefill_time_seconds"][1] - before["request_prefill_time_seconds"][1]
        if done >= count or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if done != count:
        raise RuntimeError(f"the server's /metrics recorded {done} requests, not the {count} sent")
    return server_latency_means(before, after)


def measure_one_at_a_time(base_url: str, work):
    """(results, seconds outside the engine per chunk, mean server prefill seconds) of
    ``work`` sent one at a time in ``OUTSIDE_CHUNKS`` runs: each run's mean client TTFT
    less the server's mean prefill time, what serving adds to a prefill step."""
    from minivllm.lab.sim.real_fleet import server_latency_sums

    results, outside, prefill = [], [], []
    for chunk in np.array_split(np.arange(len(work)), min(OUTSIDE_CHUNKS, len(work))):
        before = server_latency_sums([base_url])
        _, rs = measure_requests(base_url, [work[i] for i in chunk], float("inf"), 0, 1)
        if any(r.ttft is None for r in rs):
            raise RuntimeError("a one-at-a-time request streamed no text, so its TTFT is "
                               "unknown: use --output-len >= 2 or a prompt the model answers")
        served = server_means(base_url, before, len(rs))["request_prefill_time_seconds"]
        outside.append(statistics.fmean(r.ttft for r in rs) - served)
        prefill.append(served)
        results += rs
    return results, outside, statistics.fmean(prefill)


def measure(base_url: str, work, rate: float, seed: int, max_concurrency=None):
    return measure_requests(base_url, work, rate, seed, max_concurrency)[0]


def simulate_run(hw, model_path, work, engine_kwargs, max_concurrency=None):
    """The simulator's result for ``work`` on ``hw`` (``SimResult``)."""
    from minivllm.lab.sim.models import load_model_config
    from minivllm.lab.sim.simulator import Simulator

    quantization = engine_kwargs.get("quantization", "auto")
    sim = Simulator(load_model_config(model_path, "auto", "cpu", quantization), hw,
                    EngineArgs(model=str(model_path), **engine_kwargs))
    return sim.run(work, max_concurrency)


def simulate(hw, model_path, work, engine_kwargs, max_concurrency=None):
    from minivllm.lab.sim.report import serve_metrics

    return serve_metrics(simulate_run(hw, model_path, work, engine_kwargs, max_concurrency))


def ttft_residuals(measured_s, hw, model_path, work, engine_kwargs) -> list[float]:
    """Each request's measured TTFT (seconds, in ``work``'s order) less the one the
    simulator gives it sent alone: what serving adds to that very prompt. The
    prompts' lengths differ (+-25 %), and so do their prefills; a median of raw
    TTFTs carries that spread into the serving latency, a median of these does not."""
    alone = hw.with_(serving_latency_s=0.0, idle_wake_s=0.0)
    res = simulate_run(alone, model_path, work, engine_kwargs, 1)
    sim = {r.request_id: r.ttft for r in res.requests}
    return [m - sim[w.request_id] for m, w in zip(measured_s, work)]


def serving_hardware(hw, step_s: float, seq_s: float, latency: float = 0.0):
    """``hw`` with a served engine's per-step and per-sequence overheads (totals,
    replacing the offline ones) and its per-request ``serving_latency_s``."""
    return hw.with_(step_overhead_s=step_s, per_seq_overhead_s=seq_s,
                    serving_latency_s=latency)


def serving_jacobian(hw, runs, simulate_run):
    """(simulated TPOTs with no overheads, d TPOT / d (step, per-seq overhead)), seconds."""
    def tpots(step_s, seq_s):
        h = serving_hardware(hw, step_s, seq_s)
        return np.array([simulate_run(h, w, c) for w, c, _ in runs]) / 1000

    base = tpots(0.0, 0.0)
    jac = np.stack([(tpots(1e-3, 0.0) - base) / 1e-3, (tpots(0.0, 1e-3) - base) / 1e-3],
                   axis=1)
    return base, jac


def one_overhead(jac, want, i: int) -> float:
    """Least squares of overhead ``i`` alone (the other at 0), at least 0."""
    col = jac[:, i]
    return max(float(col @ want / (col @ col)), 0.0)


def solve_overheads(base, jac, target_s) -> tuple[float, float]:
    """Least squares of jac x = target - base with both overheads >= 0."""
    want = np.asarray(target_s) - base
    x = np.linalg.lstsq(jac, want, rcond=None)[0]
    if (x < 0).any():  # the best fit on one overhead alone, the other at 0
        best = None
        for i in range(2):
            xi = one_overhead(jac, want, i)
            err = float(np.sum((jac[:, i] * xi - want) ** 2))
            if best is None or err < best[0]:
                best = (err, i, xi)
        x = np.zeros(2)
        x[best[1]] = best[2]
    return float(x[0]), float(x[1])


def fit_serving(hw, runs, simulate_run) -> tuple[float, float]:
    """A served engine's per-step and per-sequence overheads, from runs' median TPOT.

    ``runs``: (workload, max_concurrency, measured median TPOT in ms);
    ``simulate_run(hw, workload, max_concurrency)`` gives the simulated one.
    """
    base, jac = serving_jacobian(hw, runs, simulate_run)
    return solve_overheads(base, jac, np.array([m for _, _, m in runs]) / 1000)


def bootstrap_std(samples: list[list[float]], estimate, n: int = BOOTSTRAP,
                  seed: int = 0) -> np.ndarray:
    """Standard deviation of ``estimate(medians)`` over resamples of each sample list."""
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n):
        meds = [float(np.median(rng.choice(s, len(s)))) for s in samples]
        draws.append(np.atleast_1d(estimate(meds)))
    return np.std(np.array(draws, dtype=float), axis=0, ddof=1)


def fit_wake(pauses: tuple[float, float], extra: tuple[float, float]) -> tuple[float, float]:
    """(idle_wake_s, idle_wake_tau_s) with w (1 - exp(-t / tau)) = extra at both pauses.

    ``extra``: seconds a request sent after each pause pays beyond one sent
    back to back. The ratio of the two fixes tau (bisection on log tau);
    ratios outside what the curve can give take its limits (a step, a line).
    """
    (t1, t2), (e1, e2) = pauses, extra
    if e2 <= 0:
        return 0.0, 1.0
    r = min(max(e1, 0.0) / e2, 1.0)

    def ratio(tau):
        return math.expm1(-t1 / tau) / math.expm1(-t2 / tau)

    # tau from a step (~1) to twice the longer pause: the probes say nothing of more.
    lo, hi = math.log(t1 / 20), math.log(t2 * 2)
    if r >= ratio(math.exp(lo)):
        tau = math.exp(lo)
    elif r <= ratio(math.exp(hi)):
        tau = math.exp(hi)
    else:
        for _ in range(60):  # ratio falls as tau grows
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(math.exp(mid)) > r else (lo, mid)
        tau = math.exp((lo + hi) / 2)
    return e2 / -math.expm1(-t2 / tau), tau


# Idle pauses (s) of the wake-up probe: one like a busy rate's, one like a quiet one's.
WAKE_PAUSES = (0.5, 2.5)
WAKE_PROBES = 8  # requests after each pause


def ttfts_after_pauses(base_url, work, pause: float) -> list[float]:
    """TTFTs (ms) of requests each sent ``pause`` s after the last one finished."""
    out = []
    for w in work:
        time.sleep(pause)
        out.append(measure(base_url, [w], float("inf"), 0).ttft_ms["median"])
    return out


def measure_after_pauses(base_url, work, pause: float) -> float:
    """Median TTFT (ms) of requests each sent ``pause`` s after the last one finished."""
    return statistics.median(ttfts_after_pauses(base_url, work, pause))


# The costs a served engine need not have: one whose estimate lies within ZERO_Z of its
# standard errors of 0 is consistent with none and is pinned there, as part 1's fit
# pins its overheads (minivllm.lab.sim.fit); the other overhead is solved again alone.
PINNABLE = ("step_overhead_s", "per_seq_overhead_s", "serving_latency_s", "idle_wake_s")


def pin_at_zero(served, fitted: dict, pinned: list[str], base, jac, runs):
    """``served`` and ``fitted`` with the ``pinned`` constants at 0."""
    fitted = dict(fitted)
    overheads = ("step_overhead_s", "per_seq_overhead_s")
    kept = [i for i, k in enumerate(overheads) if k not in pinned]
    if len(kept) < 2:  # one overhead (or none) left: its best fit alone, >= 0
        want = np.array([m for _, _, m in runs]) / 1000 - base
        for i in kept:
            fitted[overheads[i]] = (one_overhead(jac, want, i), fitted[overheads[i]][1])
    for k in pinned:
        fitted[k] = (0.0, fitted[k][1])
    values = {k: v for k, (v, _) in fitted.items()}
    return served.with_(**values), fitted


def serve_calibration(base_url, hw, model_path, engine_kwargs, vocab, args):
    """``hw`` with what serving adds, fitted on runs that are never validated.

    ``args``: ``input_len``, ``output_len``, ``num_prompts`` and ``seed`` of the
    requests (random token ids). Returns (hardware, {constant: (value, stderr)}).
    """
    from minivllm.lab.bench.workload import random_requests

    def work(n, seed):
        return random_requests(n, args.input_len, args.output_len, vocab, 0.25, seed=seed,
                               avoid_token_ids=frozenset(range(3)))

    # As many requests one at a time as all at once: the one-at-a-time medians fix
    # the serving latency and the wake-up's baseline, which half as many left to
    # chance (errors larger than the values on a quiet machine).
    one, alll = work(max(args.num_prompts, 8), args.seed + 1000), \
        work(args.num_prompts, args.seed + 2000)
    r_one, outside, served_prefill = measure_one_at_a_time(base_url, one)
    m_all, r_all = measure_requests(base_url, alll, float("inf"), 0)
    tpot_s = [[r.tpot for r in rs if r.tpot is not None] for rs in (r_one, r_all)]
    if not all(tpot_s):
        raise RuntimeError("the serving calibration measured no TPOT: use --output-len >= 2")

    def sim(h, w, c):
        return simulate(h, model_path, w, engine_kwargs, c)

    runs = [(w, c, statistics.median(t) * 1000) for w, c, t in zip((one, alll), (1, None), tpot_s)]
    base, jac = serving_jacobian(hw, runs, lambda h, w, c: sim(h, w, c).tpot_ms["median"])
    a, b = solve_overheads(base, jac, np.array([m for _, _, m in runs]) / 1000)
    served = serving_hardware(hw, a, b)
    # The serving latency and the wake-up cost, each request against its own
    # simulated TTFT: one at a time, and sent after idle pauses.
    probes = [work(WAKE_PROBES, args.seed + 3000 + i) for i in range(2)]
    after = [[t / 1000 for t in ttfts_after_pauses(base_url, w, p)]
             for w, p in zip(probes, WAKE_PAUSES)]
    resid = [ttft_residuals([r.ttft for r in r_one], served, model_path, one, engine_kwargs),
             *(ttft_residuals(t, served, model_path, w, engine_kwargs)
               for t, w in zip(after, probes))]
    latency = max(statistics.fmean(outside), 0.0)
    # What part 1 priced this served prefill at, against what it took (the server's).
    priced = statistics.fmean(r.ttft for r in r_one) - statistics.fmean(resid[0])

    def wake_of(meds):  # median residuals of: back to back, after pause 1, after pause 2
        return fit_wake(WAKE_PAUSES, (meds[1] - meds[0], meds[2] - meds[0]))

    wake, tau = wake_of([statistics.median(r) for r in resid])
    served = serving_hardware(hw, a, b, latency).with_(idle_wake_s=wake, idle_wake_tau_s=tau)
    # Standard errors: the same solves on resampled requests.
    ab_err = bootstrap_std(tpot_s, lambda meds: solve_overheads(base, jac, np.array(meds)))
    lat_err = statistics.stdev(outside) / math.sqrt(len(outside))
    wake_err = bootstrap_std(resid, wake_of)
    fitted = {"step_overhead_s": (a, float(ab_err[0])),
              "per_seq_overhead_s": (b, float(ab_err[1])),
              "serving_latency_s": (latency, lat_err),
              "idle_wake_s": (wake, float(wake_err[0])),
              "idle_wake_tau_s": (tau, float(wake_err[1]))}
    pinned = [k for k in PINNABLE if 0 < fitted[k][0] < ZERO_Z * fitted[k][1]]
    if pinned:
        served, fitted = pin_at_zero(served, fitted, pinned, base, jac, runs)
    what = ("served: " + ", ".join(f"{k} {v:.3g} +- {e:.2g}" for k, (v, e) in fitted.items())
            + (f"; pinned at 0 (within {ZERO_Z} standard errors of it): {', '.join(pinned)}"
               if pinned else "")
            + f" (offline step {hw.step_overhead_s:.3g}, per seq {hw.per_seq_overhead_s:.3g});"
            f" a lone served prefill took {served_prefill / priced:.2f}x its price"
            " (how far this machine's speed moved since part 1)")
    print(f"serving calibration (its own prompts; one at a time, all at once, after idle "
          f"pauses): {what}")
    warn_speed_moved(served_prefill / priced)
    return served.with_(source=hw.source + "; " + what), fitted


def warn_speed_moved(ratio: float) -> bool:
    """Print a warning when a served engine ran at another speed than part 1 priced."""
    if abs(ratio - 1) <= SPEED_MOVED:
        return False
    print(f"WARNING: a lone served prefill took {ratio:.2f}x what part 1 priced it at "
          f"({ratio - 1:+.0%}): predictions made with this calibration will be off by about "
          f"as much; if the machine was busy (`uptime`), its speed moved between the parts: "
          f"calibrate again when it is quiet")
    return True


__all__ = ["serve_calibration", "warn_speed_moved",
           "fit_serving", "fit_wake", "serving_hardware", "measure",
           "measure_requests", "simulate", "simulate_run", "ttft_residuals", "solve_overheads",
           "serving_jacobian", "bootstrap_std", "measure_one_at_a_time", "server_means", "pin_at_zero", "PINNABLE", "WAKE_PAUSES", "measure_after_pauses"]
