"""Latency and throughput: a load sweep over request rate, and the batch-size trade-off.

- ``load_sweep_figure``: what users feel (median TTFT and TPOT) and what the
  server delivers (output tokens/s) at each offered load of
  ``minivllm bench serve``, side by side.
- ``batch_tradeoff_figure``: output tokens/s against the batch size, under
  the machine's roofline ceiling, with other engines as single points; and
  the trade-off itself: per-token latency against throughput, one point per
  batch size.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minivllm.lab.viz.timeline import KIND_COLORS

LATENCY_COLORS = {"TTFT": KIND_COLORS["prefill"], "TPOT": KIND_COLORS["decode"],
                  "throughput": "#31a354", "ceiling": "#636363", "peer": "#756bb1"}


def _stat(metrics, name: str, stat: str) -> float:
    values = metrics[name] if isinstance(metrics, Mapping) else getattr(metrics, name)
    return values[stat]


def _get(metrics, name: str) -> float:
    return metrics[name] if isinstance(metrics, Mapping) else getattr(metrics, name)


def load_sweep_figure(labels: Sequence[str], metrics: Sequence, stat: str = "median",
                      title: str = "The same requests at rising load") -> go.Figure:
    """Left: TTFT and TPOT (ms, ``stat`` of each run) per load; right: output tokens/s.

    ``metrics`` are ``minivllm.lab.bench.serve.ServeMetrics`` (or their
    ``asdict``), one per label, in order of rising load.
    """
    if len(labels) != len(metrics):
        raise ValueError(f"labels has {len(labels)} entries and metrics {len(metrics)}: "
                         f"give one label per run")
    if not metrics:
        raise ValueError("metrics is empty: nothing to draw")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=(f"latency per request ({stat})",
                                        "output tokens per second"))
    x = list(labels)
    for name in ("TTFT", "TPOT"):
        ys = [_stat(m, f"{name.lower()}_ms", stat) for m in metrics]
        fig.add_trace(go.Scatter(
            name=name, x=x, y=ys, mode="lines+markers",
            line=dict(color=LATENCY_COLORS[name]),
            hovertemplate=f"%{{x}}: {stat} {name} %{{y:.1f}} ms<extra></extra>"), row=1, col=1)
    peak = [_get(m, "max_concurrent_requests") for m in metrics]
    fig.add_trace(go.Bar(
        name="output tokens/s", x=x, y=[_get(m, "output_throughput") for m in metrics],
        marker_color=LATENCY_COLORS["throughput"], customdata=peak,
        text=[f"≤{p} in flight" for p in peak], textposition="outside",
        hovertemplate="%{x}: %{y:.1f} tokens/s, at most %{customdata} requests in flight"
                      "<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="offered load (requests/s)")
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=2)
    fig.update_layout(title=title, height=430, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def batch_tradeoff_figure(batch_sizes: Sequence[int], tokens_per_s: Sequence[float],
                          tpot_ms: Sequence[float],
                          ceiling: Optional[Sequence[float]] = None,
                          peers: Optional[Mapping[str, tuple[int, float]]] = None,
                          title: str = "Batch size: throughput rises, so does the wait "
                                       "per token") -> go.Figure:
    """Left: tokens/s per batch size (``ceiling``: the roofline's, same sizes; ``peers``:
    name -> (batch size, tokens/s) as single markers). Right: per-token latency (ms)
    against tokens/s, one labelled point per batch size."""
    n = len(batch_sizes)
    if not n:
        raise ValueError("batch_sizes is empty: nothing to draw")
    for name, seq in (("tokens_per_s", tokens_per_s), ("tpot_ms", tpot_ms),
                      ("ceiling", ceiling)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} values for {n} batch sizes")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("throughput vs batch size",
                                        "the trade-off: latency per token vs throughput"))
    bs = list(batch_sizes)
    fig.add_trace(go.Scatter(
        name="minivllm", x=bs, y=list(tokens_per_s), mode="lines+markers",
        line=dict(color=LATENCY_COLORS["throughput"]),
        hovertemplate="batch %{x}: %{y:.1f} tokens/s<extra></extra>"), row=1, col=1)
    if ceiling is not None:
        fig.add_trace(go.Scatter(
            name="roofline ceiling", x=bs, y=list(ceiling), mode="lines",
            line=dict(color=LATENCY_COLORS["ceiling"], dash="dash"),
            hovertemplate="batch %{x}: at most %{y:.0f} tokens/s on this machine"
                          "<extra></extra>"), row=1, col=1)
    for name, (b, tps) in (peers or {}).items():
        fig.add_trace(go.Scatter(
            name=name, x=[b], y=[tps], mode="markers",
            marker=dict(symbol="diamond", size=12, color=LATENCY_COLORS["peer"]),
            hovertemplate=f"{name}, batch %{{x}}: %{{y:.1f}} tokens/s<extra></extra>"),
            row=1, col=1)
    fig.add_trace(go.Scatter(
        name="batch size", x=list(tokens_per_s), y=list(tpot_ms), mode="lines+markers+text",
        text=[f"batch {b}" for b in bs], textposition="top center", customdata=bs,
        line=dict(color=LATENCY_COLORS["TPOT"]), showlegend=False,
        hovertemplate="batch %{customdata}: %{x:.1f} tokens/s, %{y:.1f} ms per token"
                      "<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="max_num_seqs, sequences per step (log scale)", type="log",
                     tickvals=bs, row=1, col=1)
    fig.update_yaxes(title_text="output tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="output tokens/s", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="ms per output token (TPOT)", rangemode="tozero",
                     row=1, col=2)
    fig.update_layout(title=title, height=450, margin=dict(l=10, r=10, t=70, b=10))
    return fig


__all__ = ["load_sweep_figure", "batch_tradeoff_figure", "LATENCY_COLORS"]
