"""The gated delta rule (Gated DeltaNet's linear attention), in plain PyTorch.

Per head, a layer keeps a state ``S`` of shape [d_k, d_v] instead of a K/V per
token. Each token ``t`` (query ``q``, key ``k``, value ``v``, decay ``g <= 0``,
write strength ``beta`` in (0, 1)) does:

    S <- exp(g) * S                       forget a little of everything
    S <- S + k (beta * (v - S^T k))^T     replace what S recalls for k by v
    o  = S^T q                            read the state with the query

``recurrent_gated_delta_rule`` runs that loop a token at a time (decode: one
token per sequence, a batch of sequences at once). ``chunk_gated_delta_rule``
computes the same outputs and final state for a whole chunk of tokens with
matrix products (prefill): inside a chunk the updates ``delta_i = beta_i (v_i -
S_{i-1}^T k_i)`` depend on each other only through a unit lower-triangular
system, solved in one call.

Both take ``q``, ``k`` already L2-normalised and ``q`` scaled by ``d_k ** -0.5``
(``prepare_qk``); the causal convolution before them is ``causal_conv``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-length q and k per head (float32), q scaled by ``d_k ** -0.5``."""
    q = F.normalize(q.float(), dim=-1, eps=1e-6) * q.shape[-1] ** -0.5
    return q, F.normalize(k.float(), dim=-1, eps=1e-6)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One step per token. q, k [B, L, H, d_k]; v [B, L, H, d_v]; g, beta [B, L, H];
    state [B, H, d_k, d_v] (float32, updated in place). Returns o [B, L, H, d_v]."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        state.mul_(g[:, t].float().exp()[..., None, None])
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None].float() * (v[:, t].float() - recalled)
        state.add_(torch.einsum("bhk,bhv->bhkv", k[:, t], delta))
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """The same for one sequence, ``chunk_size`` tokens at a time. q, k [L, H, d_k];
    v [L, H, d_v]; g, beta [L, H]; state [H, d_k, d_v] (float32, updated in place).
    Returns o [L, H, d_v]."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, L, d]
    g, beta = g.float().t(), beta.float().t()  # [H, L]
    out = []
    for s in range(0, q.shape[1], chunk_size):
        qc, kc, vc = (x[:, s:s + chunk_size] for x in (q, k, v))
        G = g[:, s:s + chunk_size].cumsum(-1)  # decay from the chunk's start
        b = beta[:, s:s + chunk_size, None]
        # decay[i, j] = exp(G_i - G_j): what token j's write is worth at token i (j <= i).
        n = G.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        # (I + A) delta = beta (v - exp(G) k S0), A strictly lower: A_ij = beta_i d_ij k_i.k_j
        A = (b * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        eye = torch.eye(n, device=q.device).expand_as(A)
        rhs = b * (vc - (G.exp()[..., None] * kc) @ state)
        delta = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        # o_i = exp(G_i) S0^T q_i + sum_{j <= i} d_ij (q_i.k_j) delta_j
        out.append((G.exp()[..., None] * qc) @ state
                   + (decay * (qc @ kc.transpose(-1, -2))) @ delta)
        tail = (G[:, -1:] - G).exp()[..., None]  # exp(G_last - G_j)
        state.mul_(G[:, -1].exp()[:, None, None]).add_((tail * kc).transpose(-1, -2) @ delta)
    return torch.cat(out, dim=1).transpose(0, 1)


def causal_conv(x: torch.Tensor, conv_state: Optional[torch.Tensor],
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over one sequence's new tokens.

    x [L, C]; conv_state [C, K - 1] holds the inputs of the K - 1 tokens before
    (None: the sequence starts here, zeros); weight [C, K]. Returns the outputs
    [L, C] and the new state (the last K - 1 inputs)."""
    width = weight.shape[-1] - 1
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], width)
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=-1)  # [C, K - 1 + L]
    out = F.conv1d(full[None], weight[:, None, :], groups=x.shape[1])[0]  # [C, L]
    return F.silu(out).t(), full[:, full.shape[-1] - width:]


__all__ = ["prepare_qk", "recurrent_gated_delta_rule", "chunk_gated_delta_rule",
           "causal_conv"]
