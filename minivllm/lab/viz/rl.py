"""RL rollout figures (chapter 26): a GRPO run, step by step.

- ``grpo_steps_figure``: the mean reward of each step's rollouts (top), and the gap
  between the engine's logprobs and the trainer's on the same tokens and weights
  (bottom, log scale: the largest and the mean over the step's tokens).
"""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

# The smallest gap drawn: an exact zero has no place on a log axis.
FLOOR = 1e-12


def grpo_steps_figure(rewards: Sequence[float], gap_max: Sequence[float],
                      gap_mean: Sequence[float], title: str = "GRPO on the engine") -> go.Figure:
    """One point per training step in each of the three series (equal lengths)."""
    n = len(rewards)
    if n == 0 or len(gap_max) != n or len(gap_mean) != n:
        raise ValueError(f"rewards has {n} steps, gap_max {len(gap_max)} and gap_mean "
                         f"{len(gap_mean)}: give one value per step in each, at least one")
    if any(g < 0 for g in [*gap_max, *gap_mean]):
        raise ValueError("gap_max and gap_mean are absolute differences: must be >= 0")
    steps = list(range(1, n + 1))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("mean reward of the step's rollouts",
                                        "|engine logprob - trainer logprob| per token"))
    fig.add_trace(go.Scatter(x=steps, y=list(rewards), mode="lines+markers", name="reward"),
                  row=1, col=1)
    for name, values, dash in (("gap max", gap_max, "solid"), ("gap mean", gap_mean, "dot")):
        fig.add_trace(go.Scatter(x=steps, y=[max(v, FLOOR) for v in values], name=name,
                                 mode="lines+markers", line=dict(dash=dash)), row=2, col=1)
    fig.update_yaxes(title_text="reward", row=1, col=1)
    fig.update_yaxes(title_text="nats", type="log", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_layout(title=title, height=520, margin=dict(l=60, r=20, t=70, b=50))
    return fig


__all__ = ["FLOOR", "grpo_steps_figure"]
