"""The segment decomposition: how a varlen kernel without mask functions serves the contract.

For one bidirectional region ``(s, e)`` the queries of a row split into at most three runs --
before ``s`` (causal), inside ``[s, e)`` (they see exactly keys ``[0, min(e, K))``,
non-causally) and from ``e`` on (causal); ``R`` regions give ``2R + 1`` runs, alternating. Each
run is a varlen "sequence" whose right-aligned causal mask, with the right key length, is the
contract's masking rule (``kestrel_kernels.contract``). ``build_segment_plan`` computes the runs
on the device (no host syncs) and ``run_segmented`` drives any varlen paged kernel over them:
one causal call and, only with regions, one non-causal call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kestrel_kernels.contract import regions_BR2

__all__ = ["SegmentPlan", "VarlenPagedKernel", "build_segment_plan", "run_segmented"]


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Varlen sequences covering the ``B * Lq`` query rows, ``segs_per_row`` per batch row.

    Sequence ``s`` belongs to batch row ``s // segs_per_row`` and spans packed query rows
    ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])``. ``causal_k`` / ``noncausal_k`` give each sequence's
    key count for the causal / non-causal call (None = that call is not needed; 0 = the sequence's
    rows are taken from the other call or are padding). ``inside_BL`` marks rows whose output comes
    from the non-causal call; ``valid_BL`` marks real (non-padding) rows (None = all real).
    """

    segs_per_row: int
    cu_seqlens_q: Tensor
    causal_k: Tensor | None
    noncausal_k: Tensor | None
    inside_BL: Tensor | None
    valid_BL: Tensor | None


def _cu_seqlens(bounds_BS: Tensor) -> Tensor:
    lens = (bounds_BS[:, 1:] - bounds_BS[:, :-1]).reshape(-1)
    zero = torch.zeros(1, dtype=torch.int32, device=lens.device)
    return torch.cat([zero, torch.cumsum(lens, 0, dtype=torch.int32)])


def build_segment_plan(
    q_len: int,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
    causal: bool,
) -> SegmentPlan:
    """Split every row's queries into varlen sequences that realise the masking rule."""
    k_len, device = seqused_k, seqused_k.device
    full = torch.full_like(k_len, q_len)
    q_used = full if seqused_q is None else seqused_q
    rows = torch.arange(q_len, device=device, dtype=torch.int32)[None, :]
    valid = None if seqused_q is None else rows < q_used[:, None]
    zeros = torch.zeros_like(k_len)
    if not causal or bidir_regions is None:
        # One real run per row (+ a padding run when rows are padded).
        cols = [zeros, full] if seqused_q is None else [zeros, q_used, full]
        keys = [k_len] if seqused_q is None else [k_len, zeros]
        cu = _cu_seqlens(torch.stack(cols, 1))
        k_S = torch.stack(keys, 1).reshape(-1)
        causal_k, noncausal_k = (k_S, None) if causal else (None, k_S)
        return SegmentPlan(len(keys), cu, causal_k, noncausal_k, None, valid)
    offset = k_len - q_used  # absolute position of query 0
    regions = regions_BR2(bidir_regions)
    cols, causal_runs, inside_runs = [zeros], [], []
    inside = torch.zeros(k_len.shape[0], q_len, dtype=torch.bool, device=device)
    for r in range(regions.shape[1]):
        start, end, prev = regions[:, r, 0], regions[:, r, 1], cols[-1]
        has = start < end
        # the region's queries [a, c); regions are ordered, so a run never starts before the last
        a = torch.where(has, (start - offset).clamp(min=0).minimum(q_used).maximum(prev), prev)
        c = torch.where(has, (end - offset).maximum(a).minimum(q_used), a)
        cols += [a, c]
        # before it: causal with keys up to its last query; inside: all of [0, min(e, K)).
        causal_runs += [offset + a, zeros]
        inside_runs += [zeros, torch.where(c > a, end.minimum(k_len), zeros)]
        inside |= (rows >= a[:, None]) & (rows < c[:, None])
    cu = _cu_seqlens(torch.stack([*cols, q_used, full], 1))
    causal_k = torch.stack([*causal_runs, k_len, zeros], 1).reshape(-1)  # after the last: causal
    noncausal_k = torch.stack([*inside_runs, zeros, zeros], 1).reshape(-1)
    return SegmentPlan(len(cols) + 1, cu, causal_k, noncausal_k, inside, valid)


class VarlenPagedKernel(Protocol):
    """A varlen attention over paged K/V (the shape of FA3's ``flash_attn_with_kvcache``).

    ``q_THD`` packs the sequences; sequence ``s`` (rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``,
    ``n`` of them) reads keys ``0 .. seqlens_k[s] - 1`` through page-table row
    ``page_table_BP[s // segs_per_row]``; with ``causal`` its row ``i`` sees keys
    ``j <= seqlens_k[s] - n + i`` (right-aligned). Rows that see no key may hold anything:
    callers discard them.
    """

    def __call__(
        self,
        q_THD: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        page_table_BP: Tensor,
        segs_per_row: int,
        seqlens_k: Tensor,
        cu_seqlens_q: Tensor,
        max_seqlen_q: int,
        causal: bool,
        softmax_scale: float,
    ) -> Tensor: ...


def run_segmented(
    q_BLHD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    plan: SegmentPlan,
    kernel: VarlenPagedKernel,
    softmax_scale: float,
) -> Tensor:
    """Run ``kernel`` over ``plan`` (at most two calls) and assemble ``[B, Lq, Hq, D]``."""
    batch, q_len, q_heads, head_dim = q_BLHD.shape
    q_THD = q_BLHD.reshape(batch * q_len, q_heads, head_dim).contiguous()

    def call(k_S: Tensor, causal: bool) -> Tensor:
        out_THD = kernel(
            q_THD, k_cache, v_cache, page_table, plan.segs_per_row, k_S, plan.cu_seqlens_q,
            q_len, causal, softmax_scale,
        )  # fmt: skip
        return out_THD.reshape(batch, q_len, q_heads, head_dim)

    out_c = None if plan.causal_k is None else call(plan.causal_k, True)
    out_n = None if plan.noncausal_k is None else call(plan.noncausal_k, False)
    if out_c is not None and out_n is not None:
        assert plan.inside_BL is not None
        out = torch.where(plan.inside_BL[:, :, None, None], out_n, out_c)
    else:
        out = out_c if out_c is not None else out_n
    assert out is not None
    if plan.valid_BL is not None:
        out = torch.where(plan.valid_BL[:, :, None, None], out, out.new_zeros(()))
    return out
