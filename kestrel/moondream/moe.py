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
MLP output is sum_k w_k y_k. Two forms of the same MLP:

- ``moe_mlp`` (prefill, CPU decode): tokens grouped by expert, one matmul pair per expert that
  at least one token chose, so a forward reads only the experts its tokens routed to. Grouping
  needs the per-expert counts on the host (``.tolist()``): a host synchronisation, and shapes
  that depend on the routing.
- ``moe_mlp_static`` (CUDA decode, the graph-captured step): static shapes, no host
  synchronisation. For N tokens, ``gathers_experts`` picks the branch from N alone: while
  N * k < E it gathers each token's k expert slices and runs them as one batched matmul pair
  (reads N * k slices: exactly the chosen experts at N = 1); from N * k >= E on, when nearly
  every expert is touched anyway, it runs all E experts over all N tokens with the routing
  weights zeroed outside each token's top k (reads each expert once; E / k times the FLOPs,
  which a memory-bound decode step does not notice). Prefill keeps the grouped form: its
  N * k is far above E and the all-experts branch would multiply its FLOPs by E / k.

FP8 experts (``MoeWeights.fp8``: float8_e4m3 stacks with per-row scales, ``fp8.py``) stay FP8 in
memory. Where the row-scaled FP8 GEMM runs (``fp8.fp8_gemm_supported``: Hopper, bfloat16) each
expert matrix goes through ``torch._scaled_mm``; elsewhere (CPU, older GPUs) an expert's rows are
dequantised into the activations' dtype right before its matmul. Either way only the experts a
forward reads are touched: the grouped form one expert at a time, the gathered branch the N * k
gathered slices, the all-experts branch one expert per step of a fixed loop over E (static,
so a CUDA graph captures it). The whole stack is never widened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.fp8 import dequantize_rows, expert_linear, fp8_gemm_supported
from kestrel.moondream.model import MoeWeights, TauWeights

__all__ = [
    "Routing",
    "expert_activation",
    "gathers_experts",
    "moe_mlp",
    "moe_mlp_static",
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


def _scaled_mm(w: MoeWeights, x: Tensor) -> bool:
    """Whether FP8 experts go through the row-scaled FP8 GEMM for activations ``x``."""
    return w.fp8 and fp8_gemm_supported(x.device, x.dtype)


def _up(x: Tensor, w: MoeWeights, e: int, scaled: bool) -> Tensor:
    """x @ up[e]^T for one expert, whatever the stack's form."""
    if w.up_scale is None:
        return F.linear(x, w.up[e])
    return expert_linear(x, w.up[e], w.up_scale[e], scaled_mm=scaled)


def _down(x: Tensor, w: MoeWeights, e: int, scaled: bool) -> Tensor:
    if w.down_scale is None:
        return F.linear(x, w.down[e])
    return expert_linear(x, w.down[e], w.down_scale[e], scaled_mm=scaled)


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
    scaled = _scaled_mm(w, x_NC)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue  # an expert no token chose is never read
        tok = token_of[start : start + n]
        h, g = _up(x_NC[tok], w, e, scaled).chunk(2, dim=-1)  # [n, inner] each
        y = _down(expert_activation(h, g), w, e, scaled)  # [n, C]
        out_NC.index_add_(0, tok, y * weight_of[start : start + n, None])
        start += n
    return out_NC.view(B, T, C), r


def gathers_experts(n_tokens: int, cfg: TextMoeConfig) -> bool:
    """The static MoE's branch for ``n_tokens`` rows: True (gather each row's k experts) while
    ``n_tokens * k < num_experts``, False (every expert, weights zeroed outside the top k) from
    there on. A function of the shape only, so a captured graph holds one fixed branch."""
    return n_tokens * cfg.experts_per_token < cfg.num_experts


def moe_mlp_static(x_BTC: Tensor, w: MoeWeights, cfg: TextMoeConfig) -> tuple[Tensor, Routing]:
    """``moe_mlp`` with static shapes and no host synchronisation (see the module doc)."""
    B, T, C = x_BTC.shape
    x_NC = x_BTC.reshape(B * T, C)
    r = route(x_NC, w, cfg)
    if _scaled_mm(w, x_NC) and gathers_experts(B * T, cfg):
        out_NC = _gathered_scaled(x_NC, w, r)
    elif gathers_experts(B * T, cfg):
        out_NC = _gathered_experts(x_NC, w, r)
    elif w.fp8:
        out_NC = _each_expert(x_NC, w, r, _scaled_mm(w, x_NC))
    else:
        out_NC = _all_experts(x_NC, w, r)
    return out_NC.view(B, T, C), r


def _gathered_stack(stack: Tensor, scale: Tensor | None, chosen: Tensor, dtype) -> Tensor:
    """The chosen experts' matrices [M, rows, cols] in ``dtype``: only those are dequantised."""
    picked = stack.index_select(0, chosen)
    if scale is None:
        return picked
    return dequantize_rows(picked, scale.index_select(0, chosen), dtype)


def _routing_weights(x_NC: Tensor, n_experts: int, r: Routing) -> Tensor:
    """[N, E]: each token's routing weight per expert, zero outside its top k."""
    weights = torch.zeros(x_NC.shape[0], n_experts, dtype=r.weights.dtype, device=x_NC.device)
    return weights.scatter(1, r.experts, r.weights)


def _each_expert(x_NC: Tensor, w: MoeWeights, r: Routing, scaled: bool) -> Tensor:
    """The all-experts branch for FP8 stacks: a fixed loop over E, one expert's matrices live
    (dequantised or through the FP8 GEMM) at a time; static shapes, no host synchronisation."""
    weights_NE = _routing_weights(x_NC, w.up.shape[0], r)
    out_NC = torch.zeros_like(x_NC)
    for e in range(w.up.shape[0]):
        h, g = _up(x_NC, w, e, scaled).chunk(2, dim=-1)
        out_NC += _down(expert_activation(h, g), w, e, scaled) * weights_NE[:, e, None]
    return out_NC


def _gathered_scaled(x_NC: Tensor, w: MoeWeights, r: Routing) -> Tensor:
    """The gathered branch through the FP8 GEMM: one (token, slot) pair per step of a fixed
    loop over N * k; each step gathers its expert's FP8 rows on the device (no sync)."""
    assert w.up_scale is not None and w.down_scale is not None
    N, k = r.experts.shape
    chosen = r.experts.reshape(N * k)
    out = []
    for j in range(N * k):
        e = chosen[j : j + 1]
        x = x_NC[j // k : j // k + 1]
        up, up_s = w.up.index_select(0, e)[0], w.up_scale.index_select(0, e)[0]
        h, g = expert_linear(x, up, up_s, scaled_mm=True).chunk(2, dim=-1)
        down, down_s = w.down.index_select(0, e)[0], w.down_scale.index_select(0, e)[0]
        out.append(expert_linear(expert_activation(h, g), down, down_s, scaled_mm=True))
    y_NkC = torch.cat(out).view(N, k, -1)
    return (y_NkC * r.weights[..., None]).sum(dim=1)


def _gathered_experts(x_NC: Tensor, w: MoeWeights, r: Routing) -> Tensor:
    """Each token's k experts, gathered (token-major, topk order) and run as batched matmuls."""
    N, k = r.experts.shape
    C = x_NC.shape[1]
    chosen = r.experts.reshape(N * k)
    up = _gathered_stack(w.up, w.up_scale, chosen, x_NC.dtype)  # [N*k, 2 inner, C]
    down = _gathered_stack(w.down, w.down_scale, chosen, x_NC.dtype)  # [N*k, C, inner]
    x_M1C = x_NC[:, None, :].expand(N, k, C).reshape(N * k, 1, C)  # each token once per slot
    h, g = torch.bmm(x_M1C, up.transpose(1, 2)).chunk(2, dim=-1)  # [N*k, 1, inner] each
    y_M1C = torch.bmm(expert_activation(h, g), down.transpose(1, 2))  # [N*k, 1, C]
    return (y_M1C.view(N, k, C) * r.weights[..., None]).sum(dim=1)


def _all_experts(x_NC: Tensor, w: MoeWeights, r: Routing) -> Tensor:
    """Every expert over every token; weights are zero outside each token's top k."""
    weights_NE = _routing_weights(x_NC, w.up.shape[0], r)
    hg_ENI = torch.matmul(x_NC, w.up.transpose(1, 2))  # [E, N, 2 inner]
    h, g = hg_ENI.chunk(2, dim=-1)
    y_ENC = torch.bmm(expert_activation(h, g), w.down.transpose(1, 2))  # [E, N, C]
    return (y_ENC * weights_NE.T[..., None]).sum(dim=0)
