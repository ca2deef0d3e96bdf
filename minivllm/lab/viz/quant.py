"""Quantized weights drawn: one Q4_1 block byte by byte, and the formats side by side.

- ``q4_1_block_figure``: the 20 bytes of a Q4_1 block (float16 scale ``d``,
  float16 minimum ``m``, 16 bytes of nibbles) above the 32 weights they encode,
  each weight ``d * q + m`` with its 4-bit ``q`` and the byte it came from.
- ``format_ceilings_figure``: bits per weight and the single-stream tokens/s
  ceiling each format allows at a measured bandwidth.
- ``token_share_figure``: one stream's token split into the decode-step replay
  and the Python around it, beside the time the weights alone take at the
  measured bandwidth (``minivllm.lab.bench.decode_share``'s numbers).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

Q4_1_BYTES, Q4_1_WEIGHTS = 20, 32
PART_COLORS = {"d": "#d62728", "m": "#2ca02c", "low": "#1f77b4", "high": "#9467bd"}


def q4_1_fields(block: np.ndarray) -> dict:
    """A Q4_1 block's parts: ``d``, ``m`` (floats), ``q`` (32 ints 0..15), and the weights.

    Byte ``4 + k`` holds weight ``k`` in its low nibble and weight ``k + 16`` in its
    high one (GGML's layout)."""
    block = np.asarray(block, dtype=np.uint8).reshape(-1)
    if block.size != Q4_1_BYTES:
        raise ValueError(f"block has {block.size} bytes: a Q4_1 block has {Q4_1_BYTES} "
                         f"(2 scale, 2 minimum, 16 of nibbles)")
    d, m = (float(v) for v in block[:4].view(np.float16))
    nibbles = block[4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.int64)
    # float32 arithmetic, as ggml and the engine's reference dequantize
    weights = np.float32(d) * q.astype(np.float32) + np.float32(m)
    return {"d": d, "m": m, "q": q, "weights": weights}


def q4_1_block_figure(block: np.ndarray, title: str = "One Q4_1 block") -> go.Figure:
    """Top: the block's 20 bytes, coloured by part (hover for the value). Bottom: the 32
    weights ``d * q + m`` (bars; ``q`` on each), low-nibble weights first.

    Traces: ``bytes`` (one cell per byte; ``customdata`` the byte values) and
    ``weights`` (``y`` the dequantized weights, ``text`` the nibbles)."""
    f = q4_1_fields(block)
    raw = np.asarray(block, dtype=np.uint8).reshape(-1)
    parts = ["d", "d", "m", "m"] + ["nibbles"] * 16
    colors = [PART_COLORS[p] if p != "nibbles" else "#7f7f7f" for p in parts]
    hover = ([f"byte {i}: scale d (float16) = {f['d']:.6g}" for i in (0, 1)]
             + [f"byte {i}: minimum m (float16) = {f['m']:.6g}" for i in (2, 3)]
             + [f"byte {4 + k}: 0x{raw[4 + k]:02x} → low nibble q{k} = {f['q'][k]}, "
                f"high nibble q{k + 16} = {f['q'][k + 16]}" for k in range(16)])
    fig = make_subplots(rows=2, cols=1, row_heights=[0.28, 0.72], vertical_spacing=0.16,
                        subplot_titles=("20 bytes: d (2), m (2), 16 bytes of nibbles",
                                        f"32 weights = d·q + m  (d = {f['d']:.4g}, "
                                        f"m = {f['m']:.4g})"))
    fig.add_trace(go.Bar(
        name="bytes", x=list(range(Q4_1_BYTES)), y=[1] * Q4_1_BYTES, marker_color=colors,
        customdata=raw.tolist(), text=[f"{b:02x}" for b in raw], textposition="inside",
        hovertext=hover, hoverinfo="text", showlegend=False), row=1, col=1)
    w_colors = [PART_COLORS["low"]] * 16 + [PART_COLORS["high"]] * 16
    fig.add_trace(go.Bar(
        name="weights", x=list(range(Q4_1_WEIGHTS)), y=f["weights"].tolist(),
        marker_color=w_colors, text=[str(q) for q in f["q"]], textposition="outside",
        hovertext=[f"weight {i}: q = {q} ({'low' if i < 16 else 'high'} nibble of byte "
                   f"{4 + i % 16}) → {f['d']:.4g}·{q} + {f['m']:.4g} = {w:.5g}"
                   for i, (q, w) in enumerate(zip(f["q"], f["weights"]))],
        hoverinfo="text", showlegend=False), row=2, col=1)
    fig.update_yaxes(visible=False, row=1, col=1)
    fig.update_xaxes(title_text="byte", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="weight (0-15: low nibbles, 16-31: high nibbles)", dtick=1,
                     row=2, col=1)
    fig.update_yaxes(title_text="value", row=2, col=1)
    fig.update_layout(title=title, height=520, bargap=0.08,
                      margin=dict(l=10, r=10, t=80, b=10))
    return fig


def format_ceilings_figure(bits_per_weight: Mapping[str, float],
                           tokens_per_s: Mapping[str, float],
                           title: str = "Bits per weight and the one-stream ceiling"
                           ) -> go.Figure:
    """Per format (same keys in both): bits per weight (left) and the bandwidth-bound
    tokens/s of one stream (right). Traces ``bits`` and ``ceiling``."""
    if set(bits_per_weight) != set(tokens_per_s) or not bits_per_weight:
        raise ValueError(f"bits_per_weight has {sorted(bits_per_weight)} and tokens_per_s "
                         f"{sorted(tokens_per_s)}: give the same non-empty formats")
    names = sorted(bits_per_weight, key=lambda k: -bits_per_weight[k])
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                        subplot_titles=("bits per weight", "tokens/s ceiling, one stream"))
    fig.add_trace(go.Bar(name="bits", y=names, x=[bits_per_weight[n] for n in names],
                         orientation="h", marker_color="#3182bd", showlegend=False,
                         text=[f"{bits_per_weight[n]:.4g}" for n in names]), row=1, col=1)
    fig.add_trace(go.Bar(name="ceiling", y=names, x=[tokens_per_s[n] for n in names],
                         orientation="h", marker_color="#e6550d", showlegend=False,
                         text=[f"{tokens_per_s[n]:.0f}" for n in names]), row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=140 + 34 * len(names),
                      margin=dict(l=10, r=10, t=70, b=10))
    return fig


def token_share_figure(ceiling_ms: float, replay_ms: float, outside_ms: float,
                       title: str = "Where one stream's token goes") -> go.Figure:
    """Two bars in milliseconds: the ceiling (the weights read once at the measured
    bandwidth) and a token, stacked as its replay and the Python outside it. Traces
    ``ceiling``, ``replay`` and ``outside``."""
    for name, v in (("ceiling_ms", ceiling_ms), ("replay_ms", replay_ms),
                    ("outside_ms", outside_ms)):
        if not v >= 0:
            raise ValueError(f"{name}={v} is invalid: a time in ms must be >= 0")
    rows = ["ceiling", "a token"]
    fig = go.Figure([
        go.Bar(name="ceiling", y=rows[:1], x=[ceiling_ms], orientation="h",
               marker_color="#bdbdbd", text=[f"{ceiling_ms:.2f} ms"]),
        go.Bar(name="replay", y=rows[1:], x=[replay_ms], orientation="h",
               marker_color="#3182bd", text=[f"replay {replay_ms:.2f} ms"]),
        go.Bar(name="outside", y=rows[1:], x=[outside_ms], orientation="h",
               marker_color="#e6550d", text=[f"Python {outside_ms:.2f} ms"])])
    fig.update_layout(barmode="stack", title=title, height=220, xaxis_title="ms",
                      yaxis=dict(autorange="reversed"), margin=dict(l=10, r=10, t=60, b=40))
    return fig


__all__ = ["q4_1_fields", "q4_1_block_figure", "format_ceilings_figure", "token_share_figure"]
