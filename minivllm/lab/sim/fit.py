"""Fit the cost model's constants to measured step times, within physical bounds.

The constants and what bounds them:

- ``flops_efficiency``, ``bandwidth_efficiency``, ``attention_efficiency``: a
  fraction of the peaks measured in the same run, so in ``(0, 1]``; a kernel
  that beats its probe shows up as a constant pinned at 1, not as 5e21;
- ``step_overhead_s``: at least 0 and at most the shortest measured step (a
  fixed cost cannot exceed a whole step); ``per_seq_overhead_s``: at least 0,
  at most the smallest step time per scheduled sequence.

``per_token_overhead_s`` is not fitted (it stays as given, 0 by default): on
every step whose matrix products are compute-bound it moves the prediction
exactly as ``flops_efficiency`` does, so no workload separates the two.

The residuals are log(predicted / measured) per step (a relative error, so
short and long steps weigh alike), minimised by bounded least squares
(``scipy.optimize.least_squares``, trust region reflective). Each kind of step
(``step_kinds``: lone decodes, batched decodes, lone prefills, mixed steps)
weighs alike in all, whatever the workload's mix: the calibration workload is
mostly decode steps, and unweighted they set the constants a prefill is priced
with, while a served request's TTFT is mostly its prefill. Each constant's
standard error comes from the Jacobian at the optimum and the residual
variance, ``cov = s^2 A^-1 (J^T W^2 J) A^-1`` with ``A = J^T W J`` over the
constants not pinned at a bound (the weights say what matters, not which steps
are noisier, so the plain ``s^2 A^-1`` would claim too small an error).
A fit is refused (``CalibrationError``, nothing written) when the solver does
not converge, when a constant does not move any step's prediction, when two
cannot be told apart (``J^T J`` singular), or when a constant's standard error
exceeds ``max_relative_error`` of its value *and* moves some calibration
step's predicted time by more than ``negligible``: then the workload did not
identify it, and its value would be noise. (An overhead of a fraction of a
millisecond under steps of tens of milliseconds may stay relatively uncertain;
it is kept when its whole uncertainty changes no step's time by more than
``negligible``, over a workload that spans the batch sizes and contexts the
simulator is asked about.)

An overhead (lower bound 0) that fails that test but whose value is within
``ZERO_Z`` standard errors of 0 is not refused: the data are consistent with
no such cost, so it is pinned at 0 and the rest refitted without it (reported
as pinned, as an efficiency at its bound of 1 is). An efficiency cannot be 0,
and an overhead clearly above 0 but uncertain is still refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minivllm.lab.sim.cost_model import times_of
from minivllm.lab.sim.hardware import Hardware

FITTED = ("flops_efficiency", "bandwidth_efficiency", "attention_efficiency",
          "step_overhead_s", "per_seq_overhead_s")
# What each constant needs in the workload, for the refusal's message.
NEEDS = {"flops_efficiency": "steps whose matrix products are compute-bound (long prefill "
         "chunks, large batches)",
         "bandwidth_efficiency": "steps bound by reading the weights (single-sequence decode)",
         "attention_efficiency": "steps with long contexts (decode and prefill chunks after "
         "1000+ cached tokens)",
         "step_overhead_s": "steps of very different sizes (lone short prefills, batch-1 "
         "decode)",
         "per_seq_overhead_s": "decode steps with different numbers of sequences (1, 4, 16)"}
MIN_EFFICIENCY = 1e-3
# Constants that may be 0 (a cost the engine need not have), and how many standard
# errors from 0 an unidentified one may be to count as consistent with 0 (about the
# two-sided 95 % interval of a normal estimate).
ZERO_PINNABLE = ("step_overhead_s", "per_seq_overhead_s")
ZERO_Z = 1.96


KINDS = ("lone decode", "batched decode", "lone prefill", "mixed")


def step_kinds(rows: np.ndarray) -> np.ndarray:
    """Each step's index into ``KINDS``, from its tokens and sequences."""
    tokens, seqs = rows[:, 0], rows[:, 1]
    decode = tokens == seqs
    return np.where(decode, np.where(seqs == 1, 0, 1), np.where(seqs == 1, 2, 3))


def kind_weights(rows: np.ndarray) -> np.ndarray:
    """Per-step weights (mean 1) under which each kind present weighs alike."""
    kinds = step_kinds(rows)
    counts = np.bincount(kinds, minlength=len(KINDS))
    return len(rows) / (np.count_nonzero(counts) * counts[kinds])


class CalibrationError(ValueError):
    """The fit is not worth writing: it names the constant and why."""


@dataclass
class FitResult:
    hardware: Hardware
    values: dict[str, float]
    stderr: dict[str, float]  # nan where the constant sits on a bound
    at_bound: dict[str, str]  # name -> "lower" / "upper" / "zero" for pinned constants
    bounds: dict[str, tuple[float, float]]
    residual_std: float  # of log(predicted / measured), unweighted
    effect: dict[str, float]  # the most a constant's stderr moves a step's prediction
    predicted: np.ndarray = field(repr=False, default=None)
    # Pinned at 0 because unidentified and consistent with 0: name -> (the value
    # and standard error of the refused free fit).
    zeroed: dict[str, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> list[str]:
        out = []
        for n in FITTED:
            v, lo_hi = self.values[n], self.bounds[n]
            if n in self.zeroed:
                was, err = self.zeroed[n]
                err = (f"pinned at 0: unidentified and consistent with 0 ({was:.2g} +- "
                       f"{err:.2g} when fitted), the rest refitted without it")
            elif n in self.at_bound:
                err = f"at its {self.at_bound[n]} bound ({lo_hi[0]:.3g}..{lo_hi[1]:.3g})"
            else:
                err = (f"+- {self.stderr[n]:.2g} ({self.stderr[n] / v:.0%}; moves a "
                       f"step's time by at most {self.effect[n]:.1%})")
            out.append(f"{n:<22} {v:.4g} {err}")
        return out


def bounds_of(rows: np.ndarray, measured: np.ndarray) -> dict[str, tuple[float, float]]:
    seqs = np.maximum(rows[:, 1], 1)
    return {"flops_efficiency": (MIN_EFFICIENCY, 1.0),
            "bandwidth_efficiency": (MIN_EFFICIENCY, 1.0),
            "attention_efficiency": (MIN_EFFICIENCY, 1.0),
            "step_overhead_s": (0.0, float(measured.min())),
            "per_seq_overhead_s": (0.0, float((measured / seqs).min()))}


def fit_steps(base: Hardware, rows: np.ndarray, measured: np.ndarray, tp: int = 1,
              max_relative_error: float = 0.5, negligible: float = 0.01) -> FitResult:
    """The constants of ``FITTED`` that best predict ``measured`` from ``rows``;
    an overhead the steps do not identify and that is consistent with 0 is
    pinned at 0 and the rest refitted (see the module's docstring)."""
    rows, measured = np.asarray(rows, float), np.asarray(measured, float)
    if len(measured) <= len(FITTED) or not (measured > 0).all():
        raise CalibrationError(f"{len(measured)} measured steps are too few (or not all > 0) "
                               f"to fit {len(FITTED)} constants")
    bounds = bounds_of(rows, measured)
    zeroed: dict[str, tuple[float, float]] = {}
    while True:
        try:
            res = _fit_free(base, rows, measured, tp, bounds, tuple(zeroed),
                            max_relative_error, negligible)
        except _Unidentified as e:
            if e.name not in ZERO_PINNABLE or e.value > ZERO_Z * e.stderr:
                raise CalibrationError(str(e)) from None
            zeroed[e.name] = (e.value, e.stderr)
            continue
        res.zeroed = zeroed
        return res


class _Unidentified(CalibrationError):
    """A constant's uncertainty is too large (``fit_steps`` may pin it at 0)."""

    def __init__(self, name: str, value: float, stderr: float, message: str) -> None:
        super().__init__(message)
        self.name, self.value, self.stderr = name, value, stderr


def _fit_free(base, rows, measured, tp, bounds, zeroed, max_rel, negligible) -> FitResult:
    """The bounded fit of every constant of ``FITTED`` but those in ``zeroed`` (held at 0)."""
    from scipy.optimize import least_squares

    free = [n for n in FITTED if n not in zeroed]
    lo = np.array([bounds[n][0] for n in free])
    hi = np.array([bounds[n][1] for n in free])
    # The solver works on constants scaled to their ranges (all of order 1).
    scale = hi - lo
    held = {n: 0.0 for n in zeroed}
    root_w = np.sqrt(kind_weights(rows))

    def hw_of(z):
        return base.with_(**held, **{n: float(v) for n, v in zip(free, lo + z * scale)})

    def residuals(z):
        return root_w * np.log(times_of(rows, hw_of(z), tp) / measured)

    overhead = np.array([n.endswith("_s") for n in free])
    best = None
    for start in (0.5, 0.1, 0.9):  # a few starts: the roofline's max() has kinks
        z0 = np.where(overhead, min(start, 0.5) * 0.2, start)  # overheads start small
        res = least_squares(residuals, z0, bounds=(0.0, 1.0), method="trf",
                            x_scale="jac", max_nfev=2000)
        if res.success and (best is None or res.cost < best.cost):
            best = res
    if best is None:
        raise CalibrationError(f"the fit did not converge ({res.message}); nothing written")
    return _with_uncertainty(best, hw_of, free, lo, scale, bounds, max_rel, len(measured),
                             negligible, held, root_w)


def _with_uncertainty(res, hw_of, names, lo, scale, bounds, max_rel, n, negligible,
                      held, root_w) -> FitResult:
    z, jac = res.x.copy(), res.jac
    step_jac = jac / root_w[:, None]  # how each step's own prediction moves
    pinned = {name: "zero" for name in held}
    for i, name in enumerate(names):
        if z[i] <= 1e-4 or z[i] >= 1 - 1e-4:  # within 0.01 % of its range: on the bound
            pinned[name] = "lower" if z[i] <= 1e-4 else "upper"
            z[i] = 0.0 if z[i] <= 1e-4 else 1.0  # exactly the bound, not a hair above it
    values = lo + z * scale
    # A constant that moves no prediction is not identified, pinned or not.
    for i, name in enumerate(names):
        if np.max(np.abs(step_jac[:, i])) < 1e-6:
            raise CalibrationError(
                f"{name} is not identified: it does not change the predicted time of "
                f"any calibration step; the workload needs {NEEDS[name]}")
    free = [i for i, name in enumerate(names) if name not in pinned]
    dof = max(n - len(free), 1)
    s2 = float(np.sum((res.fun / root_w) ** 2) / dof)
    stderr = {name: float("nan") for name in FITTED}
    if free:
        jf = jac[:, free]
        jtj = jf.T @ jf  # A = J^T W J (the solver's Jacobian carries sqrt(W))
        eigval, eigvec = np.linalg.eigh(jtj)
        if eigval[0] <= 1e-10 * max(eigval[-1], 1e-300):
            # The direction the data cannot see: the constants with weight in it.
            weight = np.abs(eigvec[:, 0])
            tied = [names[free[k]] for k in np.argsort(-weight) if weight[k] > 0.2]
            raise CalibrationError(
                f"{' and '.join(tied)} are not identified: the calibration steps cannot "
                f"tell them apart; the workload needs {NEEDS[tied[0]]}")
        inv, jww = np.linalg.inv(jtj), jf * root_w[:, None]
        cov = s2 * inv @ (jww.T @ jww) @ inv
        for k, i in enumerate(free):
            stderr[names[i]] = float(np.sqrt(max(cov[k, k], 0.0)) * scale[i])
    effect = {}
    for i in free:
        name = names[i]
        # The most its uncertainty moves any step's prediction (relative).
        effect[name] = float(np.max(np.abs(step_jac[:, i])) * stderr[name] / scale[i])
        if not (stderr[name] <= max_rel * values[i] or effect[name] <= negligible):
            raise _Unidentified(
                name, float(values[i]), stderr[name],
                f"{name} is not identified: {values[i]:.3g} +- {stderr[name]:.2g} "
                f"(more than {max_rel:.0%} of its value, moving predictions by up to "
                f"{effect[name]:.1%}); the workload needs {NEEDS[name]}")
    hw = hw_of(z)
    fitted = dict(held, **{name: float(v) for name, v in zip(names, values)})
    return FitResult(hw, {name: fitted[name] for name in FITTED}, stderr, pinned,
                     bounds, float(np.sqrt(s2)), effect)


__all__ = ["fit_steps", "FitResult", "CalibrationError", "FITTED", "bounds_of", "NEEDS",
           "ZERO_PINNABLE", "ZERO_Z", "KINDS", "step_kinds", "kind_weights"]
