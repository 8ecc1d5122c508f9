"""The attention contract's calls: ``paged_attention`` / ``write_kv``, and the planned pair
``plan_batch`` / ``attend`` a decoder forward makes (``kestrel_kernels.contract`` has the
rule, ``backends`` the objects that run it)."""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels import torch_backend
from kestrel_kernels.backends import AttentionBackend, auto_backend
from kestrel_kernels.batch import AttentionBatch
from kestrel_kernels.contract import (
    KvScales,
    default_scale,
    validate_attention_inputs,
    validate_write_kv_inputs,
)
from kestrel_kernels.dispatch import run_attention
from kestrel_kernels.plan import AttentionMeta, AttentionPlan

__all__ = ["attend", "paged_attention", "plan_attention", "plan_batch", "write_kv"]


def plan_attention(
    meta: AttentionMeta,
    q_len: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    backend: AttentionBackend | None = None,
    causal_rows: int | None = None,
    zero_padding: bool = True,
) -> AttentionPlan:
    """``backend.plan`` (None: ``"auto"`` for queries of ``dtype`` on the metadata's device):
    built once per forward, what every layer's :func:`attend` would rebuild. No host
    synchronisation, so a forward that CUDA graphs capture records these few kernels once.
    ``causal_rows`` and ``zero_padding``: ``AttentionBackend.plan``."""
    if backend is None:
        backend = auto_backend(meta.page_table.device, dtype)
    return backend.plan(meta, q_len, causal_rows=causal_rows, zero_padding=zero_padding)


def plan_batch(batch: AttentionBatch, dtype: torch.dtype) -> AttentionPlan:
    """:func:`plan_attention` for one forward's :class:`AttentionBatch` (causal), its queries
    of ``dtype``: the plan every layer's :func:`attend` runs from."""
    return plan_attention(
        batch.meta, batch.q_len, dtype=dtype, backend=batch.backend,
        causal_rows=batch.causal_rows, zero_padding=batch.zero_padding,
    )  # fmt: skip


def attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, *,
    kv_scales: KvScales | None = None,
) -> Tensor:  # fmt: skip
    """One layer's attention over the metadata ``plan`` was built from (``plan.backend``)."""
    return plan.backend.forward(q, k_cache, v_cache, plan, kv_scales=kv_scales)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    *,
    backend: AttentionBackend | None = None,
    softmax_scale: float | None = None,
    kv_scales: KvScales | None = None,
) -> Tensor:
    """Attention of ``q`` over one layer's paged K/V; returns ``[B, Lq, Hq, D]``.

    Shapes: ``q`` ``[B, Lq, Hq, D]``; ``k_cache``/``v_cache`` ``[n_pages, Hkv, D]``; ``meta``
    (``AttentionMeta``): ``page_table`` int32 ``[B, max_pages]``, ``seqused_k`` int32 ``[B]``
    (keys per row, this call's new keys included, already written with ``write_kv``),
    ``seqused_q`` int32 ``[B]`` (real queries per row, None = all ``Lq``), ``bidir_regions``
    int32 ``[B, 2]`` of ``(start, end)`` (``start >= end`` = none), ``causal``. Masking: query
    ``i`` of a row sits at ``p = seqused_k - seqused_q + i`` and sees keys ``j <= p``, plus all
    of ``[start, end)`` when ``start <= p < end``; ``causal=False`` sees every valid key.
    Padding query rows are zeros. ``softmax_scale`` defaults to ``1/sqrt(D)``. Bad inputs
    raise ``KernelInputError``. ``backend``: None = ``"auto"`` for q's device and dtype.
    ``kv_scales``: the caches are FP8 pages with these scales (the contract's scaled-KV case).
    A forward's layers plan once and :func:`attend` instead.
    """
    if torch.compiler.is_compiling():
        backend = backend or auto_backend(q.device, q.dtype)
        plan = backend.plan(meta, q.shape[1])
        return backend.forward(q, k_cache, v_cache, plan, kv_scales=kv_scales,
                               softmax_scale=softmax_scale)  # fmt: skip
    shape = validate_attention_inputs(q, k_cache, v_cache, meta, kv_scales)
    backend = backend or auto_backend(q.device, q.dtype)
    plan = backend.plan(meta, shape.q_len)
    scale = default_scale(shape.head_dim, softmax_scale)
    return run_attention(q, k_cache, v_cache, plan, shape, scale, kv_scales)


def write_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k: Tensor,
    v: Tensor,
    kv_scales: KvScales | None = None,
) -> None:
    """Write new keys/values in place: ``k_cache[slot_mapping[n]] = k[n]`` (same for v).

    ``slot_mapping``: int32/int64 ``[N]`` physical page per new position; ``k``, ``v``:
    ``[N, Hkv, D]`` in the caches' dtype. Slots < 0 are padding and are skipped: no page changes
    because of them (page 0, the reserved padding page, included). Shared by every backend.
    With ``kv_scales`` the caches are FP8 pages and K/V are quantised by those scales.
    """
    validate_write_kv_inputs(k_cache, v_cache, slot_mapping, k, v, kv_scales)
    if kv_scales is not None:
        torch_backend.write_kv_scaled(k_cache, v_cache, slot_mapping, k, v, kv_scales)
        return
    torch_backend.write_kv_indexed(k_cache, v_cache, slot_mapping, k, v)
