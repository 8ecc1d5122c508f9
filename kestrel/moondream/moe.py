"""Moondream 3's decoder deltas: tau scaling of q and v, and the mixture-of-experts MLP.

Tau (every layer, before rotary; the first-party reference's ``text.py``): with the biased qkv
output of a position at absolute position s,
    feat = GELU_exact(qkv);  tok_q = tanh(feat @ wq^T);  tok_v = tanh(feat @ wv^T)   [.., H]
    tau_pos[h, s] = 1 + sigmoid(alpha[h] * ln(s + 1)) - 0.5
    q_h *= tok_q[h] + tau_pos[h, s];  v_h *= tok_v[h] + tau_pos[h, s];  K is not scaled.
The scaled V is what goes into the KV pages; it depends only on the token and its position, so
the prefix cache shares it like any other K/V.

MoE (layers >= moe.start_layer; the reference's ``layers.py``): router = Linear(dim -> E) on the
block's LayerNorm output; the k largest logits (``torch.topk``) are softmaxed in float32 and cast
back; expert e computes [h; g] = x @ up[e]^T, y = (GELU_exact(h) * (g + 1)) @ down[e]^T, and the
MLP output is sum_k w_k y_k. Tokens are grouped by expert: one matmul pair per expert that at
least one token chose, so a step reads only the experts its rows routed to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.model import MoeWeights, TauWeights

__all__ = [
    "Routing",
    "expert_activation",
    "moe_mlp",
    "route",
    "tau_factors",
    "tau_feature",
    "tau_position",
    "tau_token_logits",
]


def tau_feature(qkv: Tensor) -> Tensor:
    """The features tau reads: the exact (erf) GELU of the qkv output, as the reference."""
    return F.gelu(qkv)


def expert_activation(h: Tensor, g: Tensor) -> Tensor:
    """An expert's GeGLU: exact GELU(h) * (g + 1)."""
    return F.gelu(h) * (g + 1)


def tau_token_logits(qkv_BTQ: Tensor, w: TauWeights) -> tuple[Tensor, Tensor]:
    """feat @ wq^T and feat @ wv^T [B, T, H], before their tanh."""
    feat = tau_feature(qkv_BTQ)
    return feat @ w.wq.T, feat @ w.wv.T


def tau_position(positions_BT: Tensor, w: TauWeights, dtype: torch.dtype) -> Tensor:
    """tau_pos [B, T, H] = 1 + sigmoid(alpha * ln(s + 1)) - 0.5 at absolute positions s."""
    log_pos = (positions_BT.to(dtype) + 1).log()  # [B, T]
    return 1 + (torch.sigmoid(w.alpha * log_pos[..., None]) - 0.5)


def tau_factors(qkv_BTQ: Tensor, positions_BT: Tensor, w: TauWeights) -> tuple[Tensor, Tensor]:
    """The q and v factors [B, T, H] of each position and head (see the module doc)."""
    q_lin, v_lin = tau_token_logits(qkv_BTQ, w)
    tau_pos = tau_position(positions_BT, w, qkv_BTQ.dtype)
    return torch.tanh(q_lin) + tau_pos, torch.tanh(v_lin) + tau_pos


@dataclass(frozen=True, slots=True)
class Routing:
    """The router's choice for N tokens: logits [N, E], experts [N, k] (topk order), weights
    [N, k] (softmax over the chosen logits, in the activations' dtype)."""

    logits: Tensor
    experts: Tensor
    weights: Tensor


def route(x_NC: Tensor, w: MoeWeights, cfg: TextMoeConfig) -> Routing:
    logits = F.linear(x_NC, w.router.weight, w.router.bias)  # [N, E]
    top_logits, experts = torch.topk(logits, cfg.experts_per_token, dim=-1)  # [N, k]
    weights = F.softmax(top_logits, dim=-1, dtype=torch.float32).to(x_NC.dtype)
    return Routing(logits, experts, weights)


def moe_mlp(x_BTC: Tensor, w: MoeWeights, cfg: TextMoeConfig) -> tuple[Tensor, Routing]:
    """The MoE MLP output [B, T, C] of the block's LayerNorm output, and the routing taken."""
    B, T, C = x_BTC.shape
    x_NC = x_BTC.reshape(B * T, C)
    r = route(x_NC, w, cfg)
    k = cfg.experts_per_token
    flat = r.experts.flatten()  # [N*k]: (token, slot) pairs, token-major
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()
    token_of = order // k  # [N*k] token of each grouped pair
    weight_of = r.weights.flatten()[order]  # [N*k]
    out_NC = torch.zeros_like(x_NC)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue  # an expert no token chose is never read
        tok = token_of[start : start + n]
        h, g = F.linear(x_NC[tok], w.up[e]).chunk(2, dim=-1)  # [n, inner] each
        y = F.linear(expert_activation(h, g), w.down[e])  # [n, C]
        out_NC.index_add_(0, tok, y * weight_of[start : start + n, None])
        start += n
    return out_NC.view(B, T, C), r
