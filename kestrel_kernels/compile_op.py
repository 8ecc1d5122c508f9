"""``paged_attention`` as one opaque ``torch.library`` op, for code that ``torch.compile`` traces.

Dynamo cannot trace the attention backends: the FlashAttention binding is a CuTe DSL kernel
compiled at first use, and the torch reference reads ``max(seqused_k)`` on the host (and, on a
CPU, checks every length). Under ``torch.compile`` ``kestrel_kernels.paged_attention`` therefore
calls ``torch.ops.kestrel.paged_attention``: inductor sees one node per layer whose output is a
fresh ``[B, Lq, Hq, D]`` tensor like ``q`` (the fake implementation), and at run time the op does
what the eager ``paged_attention`` does with a plan: validation, then the backend. The forward's
attention plan (``plan_attention``: the resolved backend and, for ``fa``, the segment plan) is
traced as plain tensor ops, once per forward; its tensors are passed to the op so no layer
rebuilds them.

The backend is an object chosen before tracing (``backends.resolve_backend``); the op is handed
its key, a constant of the graph like a CUDA graph's kernels (the name of a registered
backend; any other object, a measured ``TritonDecode`` or a stand-in, is registered under a
key of its own when it is made, while it lives: ``plan.register``), and turns it back into
the object. This op is the one function of the package whose parameters are a flat list (a
``torch.library`` schema takes tensors and scalars, not values made of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels.contract import KvScales, validate_attention_inputs
from kestrel_kernels.dispatch import run_attention
from kestrel_kernels.plan import AttentionMeta, AttentionPlan, backend_of
from kestrel_kernels.segments import SegmentPlan

__all__ = ["OP_NAME", "attention_op"]

OP_NAME = "kestrel::paged_attention"

_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seqused_k, "
    "Tensor? seqused_q, Tensor? bidir_regions, bool causal, float softmax_scale, str backend, "
    "int segs_per_row, Tensor? cu_seqlens_q, Tensor? causal_k, Tensor? noncausal_k, "
    "Tensor? inside_BL, Tensor? valid_BL, Tensor? segment_pages, Tensor? k_scale, "
    "Tensor? v_scale) -> Tensor"
)


@torch.library.custom_op(OP_NAME, mutates_args=(), schema=_SCHEMA)
def _paged_attention_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
    causal: bool,
    softmax_scale: float,
    backend: str,
    segs_per_row: int,
    cu_seqlens_q: Tensor | None,
    causal_k: Tensor | None,
    noncausal_k: Tensor | None,
    inside_BL: Tensor | None,
    valid_BL: Tensor | None,
    segment_pages: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> Tensor:
    """What the eager ``AttentionBackend.forward`` does (every device): validate, then run
    the backend ``backend`` keys (chosen before tracing) with the forward's segments."""
    scales = None if k_scale is None or v_scale is None else KvScales(k_scale, v_scale)
    meta = AttentionMeta(page_table, seqused_k, seqused_q, bidir_regions, causal)
    shape = validate_attention_inputs(q, k_cache, v_cache, meta, scales)
    segments = None
    if cu_seqlens_q is not None:
        segments = SegmentPlan(
            segs_per_row, cu_seqlens_q, causal_k, noncausal_k, inside_BL, valid_BL
        )
    plan = AttentionPlan(backend_of(backend), shape.q_len, meta, segments, segment_pages)
    out = run_attention(q, k_cache, v_cache, plan, shape, softmax_scale, scales)
    return out.contiguous()  # the fake promises a fresh contiguous tensor


@_paged_attention_op.register_fake
def _paged_attention_fake(q: Tensor, *args: object) -> Tensor:
    return q.new_empty(q.shape)


def attention_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    softmax_scale: float,
    kv_scales: KvScales | None,
) -> Tensor:
    """Call ``kestrel::paged_attention`` over ``plan`` (its tensors and its backend's key)."""
    s, m = plan.segments, plan.meta
    return torch.ops.kestrel.paged_attention(
        q, k_cache, v_cache, m.page_table, m.seqused_k, m.seqused_q, m.bidir_regions, m.causal,
        float(softmax_scale), plan.backend.key,
        0 if s is None else s.segs_per_row,
        None if s is None else s.cu_seqlens_q,
        None if s is None else s.causal_k,
        None if s is None else s.noncausal_k,
        None if s is None else s.inside_BL,
        None if s is None else s.valid_BL,
        plan.segment_pages,
        None if kv_scales is None else kv_scales.k,
        None if kv_scales is None else kv_scales.v,
    )  # fmt: skip
