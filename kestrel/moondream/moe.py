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
MLP output is sum_k w_k y_k.

``moe_mlp`` is one form for prefill, decode and the CUDA graphs: the N * k (token, expert)
pairs are sorted by expert on the device, each expert's offset found without reading it back,
and the up and down projections run as one grouped GEMM each over the chosen experts only
(``kestrel_kernels.moe``: static shapes, no host synchronisation; FP8 experts, stored
float8_e4m3 with per-row scales (``fp8.py``), go through the row-scaled FP8 grouped GEMM on a
Hopper GPU and are widened on use elsewhere, never the whole stack on a CPU). A forward reads
only the experts its tokens routed to, whatever N is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.containers import MoeWeights, TauWeights
from kestrel_kernels.moe import (
    combine,
    gather_rows,
    geglu,
    grouped_linear,
    plan_experts,
    scaled_grouped_supported,
    tau_scales,
)

__all__ = [
    "Routing",
    "expert_activation",
    "moe_mlp",
    "route",
    "scaled_experts",
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
    lin = F.linear(tau_feature(qkv_BTQ), w.wqv)  # [B, T, 2H]: q logits, then v logits
    return tau_scales(lin, positions_BT, w.alpha)


@dataclass(frozen=True, slots=True)
class Routing:
    """The router's choice for N tokens: logits [N, E], experts [N, k] (topk order), weights
    [N, k] (softmax over the chosen logits, float32; the combine rounds them to the
    activations' dtype, as the reference casts them)."""

    logits: Tensor
    experts: Tensor
    weights: Tensor


def route(x_NC: Tensor, w: MoeWeights, cfg: TextMoeConfig) -> Routing:
    logits = F.linear(x_NC, w.router.weight, w.router.bias)  # [N, E]
    top_logits, experts = torch.topk(logits, cfg.experts_per_token, dim=-1)  # [N, k]
    weights = F.softmax(top_logits, dim=-1, dtype=torch.float32)
    return Routing(logits, experts, weights)


def scaled_experts(w: MoeWeights, x: Tensor) -> bool:
    """Whether FP8 experts go through the row-scaled FP8 grouped GEMM for activations ``x``."""
    return w.fp8 and scaled_grouped_supported(x.device, x.dtype)


def moe_mlp(x_BTC: Tensor, w: MoeWeights, cfg: TextMoeConfig) -> tuple[Tensor, Routing]:
    """The MoE MLP output [B, T, C] of the block's LayerNorm output, and the routing taken:
    the chosen experts as two grouped GEMMs, static shapes, no host sync (module doc)."""
    B, T, C = x_BTC.shape
    x_NC = x_BTC.reshape(B * T, C)
    r = route(x_NC, w, cfg)
    quantize = scaled_experts(w, x_NC)
    plan = plan_experts(r.experts, w.expert_ids)
    rows = gather_rows(x_NC, plan, quantize=quantize)
    hg = grouped_linear(rows, w.up, plan.offs, w.up_scale)  # [N*k, 2 inner]
    act = geglu(hg, quantize=quantize)  # [N*k, inner]
    y = grouped_linear(act, w.down, plan.offs, w.down_scale)  # [N*k, C]
    return combine(y, plan, rows, r.weights).view(B, T, C), r
