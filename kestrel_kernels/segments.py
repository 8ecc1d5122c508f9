"""The segment decomposition: how a varlen kernel without mask functions serves the contract.

For one bidirectional region ``(s, e)`` the queries of a row split into at most three runs --
before ``s`` (causal), inside ``[s, e)`` (they see exactly keys ``[0, min(e, K))``,
non-causally) and from ``e`` on (causal); ``R`` regions give ``2R + 1`` runs, alternating. Each
run is a varlen "sequence" whose right-aligned causal mask, with the right key length, is the
contract's masking rule (``kestrel_kernels.contract``). ``build_segment_plan`` computes the runs
on the device (no host syncs) and ``run_segmented`` drives any varlen paged kernel over them:
one causal call and, only with regions, one non-causal call.

``build_single_call_plan`` needs only the non-causal call: each region's queries stay one
sequence, and every query outside the regions becomes a one-row sequence whose key count is its
position + 1 (for one row, non-causal over ``0..p`` is causal). The number of sequences must be
fixed on the host, so the caller gives a host-known bound on a row's queries outside the
regions; one-row sequences read their keys once per row, so ``choose_segment_plan`` takes this
form only while that bound is at most ``SINGLE_CALL_MAX_CAUSAL_ROWS`` (a miss prefill: BOS +
image and a short question), and the two-call form otherwise (long text suffixes).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kestrel_kernels.contract import KernelInputError, regions_BR2
from kestrel_kernels.counting import active_counter

__all__ = [
    "SINGLE_CALL_MAX_CAUSAL_ROWS",
    "SegmentPlan",
    "VarlenPagedKernel",
    "VarlenSeqs",
    "build_segment_plan",
    "build_single_call_plan",
    "choose_segment_plan",
    "run_segmented",
    "single_call_max_rows",
]

# Most queries outside the bidirectional regions (per batch row) that the single-call plan
# turns into one-row sequences. Each is a query tile of its own over all its keys (one row of
# it useful), where a causal sequence shares a tile among up to 128 queries: a question after
# an image (~10-40 tokens) trades that for two launches per layer, a long text suffix would
# not. ``KESTREL_FA_SINGLE_CALL_ROWS`` overrides it (0 = always the two-call plan), so that a
# GPU can measure the trade without a code change.
SINGLE_CALL_MAX_CAUSAL_ROWS = 64
_ROWS_ENV = "KESTREL_FA_SINGLE_CALL_ROWS"


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


def build_single_call_plan(
    q_len: int,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor,
    causal_rows: int,
) -> SegmentPlan:
    """The causal-with-regions rule as ONE non-causal varlen call (see the module doc).

    ``causal_rows``: a bound, known on the host, on each row's real queries outside every
    region. A row gets ``R + causal_rows + 1`` sequences: in query order, one per region run
    (keys ``[0, min(e, K))``) and one per other query (keys ``0..p``), then empty ones, the
    last of which holds the padding rows. Built on the device without host syncs; a bound that
    is too small is caught on CPU tensors only (``KernelInputError``).
    """
    k_len, device, batch = seqused_k, seqused_k.device, seqused_k.shape[0]
    regions = regions_BR2(bidir_regions)
    segs = regions.shape[1] + causal_rows + 1
    rows = torch.arange(q_len, device=device, dtype=torch.int32)[None, :]  # [1, L]
    q_used = q_len if seqused_q is None else seqused_q[:, None]
    real = None if seqused_q is None else rows < q_used
    pos = (k_len[:, None] - q_used) + rows  # absolute position of each query, [B, L]
    # a query inside region r sees keys [0, min(e_r, K)); any other sees [0, p]; the larger
    # of the two is right for both (min(e_r, K) > p inside r), and it names the sequence: it
    # is one value along a region's run and new at every other query
    ends = regions[:, :, 1].minimum(k_len[:, None])[:, :, None]  # [B, R, 1]
    inside = (pos[:, None] >= regions[:, :, 0, None]) & (pos[:, None] < ends)  # [B, R, L]
    keys_BL = (pos + 1).maximum((inside * ends).amax(1))
    first_BL = keys_BL != torch.nn.functional.pad(keys_BL[:, :-1], (1, 0))
    if real is not None:  # padding rows start nothing and add no keys
        first_BL &= real
        keys_BL = keys_BL * real
    seq_BL = torch.cumsum(first_BL, 1) - 1  # the sequence of each query (padding: the last)
    if device.type == "cpu" and not torch.compiler.is_compiling():  # a host read: not traced
        _check_bound(seq_BL, causal_rows, segs)
    seq_BL = seq_BL.clamp(0, segs - 1)
    # each sequence begins at its first query's packed row; unused ones at the padding rows
    base = torch.arange(0, (batch + 1) * q_len, q_len, device=device, dtype=torch.int32)
    fill_BS = (base[:-1, None] + q_used).expand(batch, segs)
    begin_BS = fill_BS.scatter_reduce(1, seq_BL, base[:-1, None] + rows, "amin")
    k_BS = torch.zeros_like(begin_BS).scatter_reduce_(1, seq_BL, keys_BL, "amax")
    cu = torch.cat([begin_BS.reshape(-1), base[-1:]])
    return SegmentPlan(segs, cu, None, k_BS.reshape(-1), None, real)


def _check_bound(seq_BL: Tensor, causal_rows: int, segs: int) -> None:
    """Every row's sequences fit the ``segs - 1`` it is given (CPU tensors only: a host read,
    which the GPU path skips, so a launch counter does not count it)."""
    counter = active_counter()
    with counter.paused() if counter is not None else contextlib.nullcontext():
        most = int(seq_BL[:, -1].max()) + 1 if seq_BL.numel() else 0
    if most > segs - 1:
        raise KernelInputError(
            f"a row has more than causal_rows={causal_rows} queries outside its regions"
        )


def single_call_max_rows() -> int:
    """``SINGLE_CALL_MAX_CAUSAL_ROWS``, or ``KESTREL_FA_SINGLE_CALL_ROWS`` when set."""
    raw = os.environ.get(_ROWS_ENV)
    if raw is None:
        return SINGLE_CALL_MAX_CAUSAL_ROWS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise KernelInputError(f"{_ROWS_ENV} must be a whole number >= 0, got {raw!r}")
    return value


def choose_segment_plan(
    q_len: int,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
    causal: bool,
    causal_rows: int | None = None,
) -> SegmentPlan:
    """The single-call plan where it pays (regions, and at most
    ``SINGLE_CALL_MAX_CAUSAL_ROWS`` queries outside them per row), else the two-call one.

    ``causal_rows``: the host's bound on a row's queries outside the regions (None: ``q_len``).
    """
    bound = q_len if causal_rows is None else min(max(causal_rows, 0), q_len)
    if causal and bidir_regions is not None and bound <= single_call_max_rows():
        return build_single_call_plan(q_len, seqused_k, seqused_q, bidir_regions, bound)
    return build_segment_plan(q_len, seqused_k, seqused_q, bidir_regions, causal)


@dataclass(frozen=True, slots=True)
class VarlenSeqs:
    """The sequences of one varlen call: sequence ``s`` (packed query rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``) reads keys ``0 .. seqlens_k[s] - 1`` through
    page-table row ``s // segs_per_row``; ``max_seqlen_q``: a launch hint; ``causal``:
    right-aligned causal (else every key); ``softmax_scale``: the scores' scale."""

    segs_per_row: int
    seqlens_k: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    causal: bool
    softmax_scale: float


class VarlenPagedKernel(Protocol):
    """A varlen attention over paged K/V (the shape of FA3's ``flash_attn_with_kvcache``).

    ``q_THD`` packs the sequences ``seqs`` (``VarlenSeqs``) describes; sequence ``s``'s row
    ``i`` of ``n`` sees keys ``j <= seqlens_k[s] - n + i`` when causal (right-aligned), through
    ``page_table_BP[s // segs_per_row]``. Rows that see no key may hold anything: callers
    discard them.
    """

    def __call__(
        self, q_THD: Tensor, k_cache: Tensor, v_cache: Tensor, page_table_BP: Tensor,
        seqs: VarlenSeqs,
    ) -> Tensor: ...  # fmt: skip


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
        seqs = VarlenSeqs(plan.segs_per_row, k_S, plan.cu_seqlens_q, q_len, causal, softmax_scale)
        out_THD = kernel(q_THD, k_cache, v_cache, page_table, seqs)
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
