"""Moondream 2 / 3 text decoder (Phi-1.5 style) over the paged KV cache.

Per block (parallel attention + MLP, one LayerNorm):
    h = LN(x);  x = x + proj(Attn(rope(qkv(h)))) + fc2(GELU_tanh(fc1(h)))
Moondream 3 scales q and v by their tau factors before rotary (the pages hold the scaled V) and
replaces the dense MLP by the routed experts from ``moe.start_layer`` on (``moe.py``); an
adapter's MLP entries do not apply to those layers, as in the reference.
Attention goes through ``kestrel_kernels``: new K/V are written to their pages first, then every
query row attends over its page table, all layers from one plan built from the forward's
``ForwardInputs`` (``forward_inputs.py``). The same function serves full prefill, append
prefill and batched decode; the kernel's right-aligned causal rule plus the optional
bidirectional region (BOS + image) provide the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor

import kestrel_kernels
from kestrel.moondream.config import TextConfig
from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.lora_batch import LoraBatch
from kestrel.moondream.model import LayerNorm, Linear, TextBlock, TextWeights
from kestrel.moondream.moe import Routing, moe_mlp, tau_factors
from kestrel.moondream.rope import rope_cos_sin
from kestrel_kernels.fused import HeadLayout, KvWrite, add_layer_norm, linear_gelu, rope_write_kv

__all__ = ["dense_activation", "embed_text", "layer_norm", "linear", "lm_head", "text_forward"]

LN_EPS = 1e-5


class PagedKV(Protocol):
    """What text_forward needs of the cache: per-layer [n_pages, n_kv_heads, head_dim] tensors."""

    k: Sequence[Tensor]
    v: Sequence[Tensor]


def linear(x: Tensor, w: Linear) -> Tensor:
    return F.linear(x, w.weight, w.bias)


def dense_activation(x: Tensor) -> Tensor:
    """The dense MLPs' GELU: the tanh approximation."""
    return F.gelu(x, approximate="tanh")


def layer_norm(x: Tensor, w: LayerNorm) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), w.weight, w.bias, LN_EPS)


def embed_text(ids: Tensor, w: TextWeights) -> Tensor:
    """Raw wte lookup (no scaling, no position embedding): ids [...] -> [..., dim]."""
    return F.embedding(ids, w.wte)


def lm_head(hidden_BC: Tensor, w: TextWeights) -> Tensor:
    """post_ln then the vocabulary projection: [B, dim] (pre-post_ln hidden) -> logits [B, V]."""
    return linear(layer_norm(hidden_BC, w.post_ln), w.lm_head)


def _add_lora(out: Tensor, x: Tensor, plan: LoraBatch | None, layer: int, module: str):
    return out if plan is None else plan.add(out, x, layer, module)


class RoutingSink(Protocol):
    """Receives each MoE layer's routing (conformance tests record it); optional."""

    def __call__(self, layer: int, routing: Routing) -> None: ...


def _mlp(h, blk: TextBlock, cfg: TextConfig, plan, i: int, sink: RoutingSink | None) -> Tensor:
    if blk.moe is not None:
        assert cfg.moe is not None
        out, routing = moe_mlp(h, blk.moe, cfg.moe)
        if sink is not None:
            sink(i, routing)
        return out
    assert blk.fc1 is not None and blk.fc2 is not None
    if plan is None:  # bias + GELU in the GEMM's epilogue where fused
        ff = linear_gelu(h, blk.fc1.weight, blk.fc1.bias)
    else:
        ff = dense_activation(_add_lora(linear(h, blk.fc1), h, plan, i, "fc1"))
    return _add_lora(linear(ff, blk.fc2), ff, plan, i, "fc2")


def text_forward(
    x_BTC: Tensor,
    w: TextWeights,
    cfg: TextConfig,
    inputs: ForwardInputs,
    kv: PagedKV,
    *,
    routing_sink: RoutingSink | None = None,
) -> Tensor:
    """Run the decoder over T new positions per row; return hidden states BEFORE post_ln.

    x_BTC: input embeddings [B, T, dim]. ``inputs`` (``forward_inputs.ForwardInputs``): the
    attention batch -- positions (RoPE), the page each position's K/V is written to, page
    table, key / query counts, bidirectional blocks, the plan's host facts, the backend --
    plus the rows' LoRA adapters. K/V of every layer are written to ``kv``.
    routing_sink: called with (layer, Routing) for each MoE layer (Moondream 3), or None.
    Padding query rows' hidden states are meaningless (the caller drops them).
    """
    batch = inputs.attention
    B, T, C = x_BTC.shape
    if (batch.rows, batch.q_len) != (B, T):
        raise ValueError(f"x_BTC is [{B}, {T}, ...] but the attention batch is "
                         f"[{batch.rows}, {batch.q_len}]")  # fmt: skip
    heads = HeadLayout(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    positions_BT = batch.positions_BT
    cos_BTR, sin_BTR = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta)
    plan = LoraBatch.plan(inputs.lora, B, x_BTC.device)
    attn_plan = kestrel_kernels.plan_batch(batch, x_BTC.dtype)
    kv_scales = getattr(kv, "kv_scales", None)  # per-layer scales of FP8 KV pages, or None
    x, blocks = x_BTC, w.blocks
    h = layer_norm(x, blocks[0].ln)
    for i, blk in enumerate(blocks):
        qkv = _add_lora(linear(h, blk.qkv), h, plan, i, "qkv")  # [B, T, (H + 2Hkv) D]
        tau_q = tau_v = None
        if blk.tau is not None:  # Moondream 3: scale q and v (not k) before rotary
            tau_q, tau_v = tau_factors(qkv, positions_BT, blk.tau)  # [B, T, H] each
        # rotary on q and k, k and v written to their pages: one launch where fused
        scales = None if kv_scales is None else kv_scales[i]
        pages = KvWrite(kv.k[i], kv.v[i], batch.slot_mapping, scales)
        q = rope_write_kv(qkv, cos_BTR, sin_BTR, pages, heads, tau_q=tau_q, tau_v=tau_v)
        attn = kestrel_kernels.attend(q, kv.k[i], kv.v[i], attn_plan, kv_scales=scales)
        # proj LoRA reads the LN output h, not the attention output (reference quirk).
        attn_out = _add_lora(linear(attn.reshape(B, T, C), blk.proj), h, plan, i, "proj")
        mlp_out = _mlp(h, blk, cfg, plan, i, routing_sink)
        if i + 1 < len(blocks):  # the residual add runs with the next block's LayerNorm
            ln = blocks[i + 1].ln
            x, h = add_layer_norm(x, (attn_out, mlp_out), ln.weight, ln.bias, LN_EPS)
        else:
            x = x + attn_out + mlp_out
    return x
