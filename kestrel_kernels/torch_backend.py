"""The torch reference backend: gather through the page table, explicit mask, SDPA.

This is the numerics reference (float32 SDPA, used for golden conformance) and what CI runs. It
also holds ``varlen_paged_attention_torch``, a torch stand-in for FlashAttention's varlen paged
kernel, so that ``paged_attention_segmented`` runs the exact orchestration of the ``fa`` backend
(``segments.run_segmented``) on a CPU and tests can prove it equals the masked reference.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_kernels.contract import (
    AttentionMeta,
    AttentionShape,
    KvScales,
    dequantize_kv,
    quantize_kv,
    regions_BR2,
)
from kestrel_kernels.segments import SegmentPlan, VarlenSeqs, build_segment_plan, run_segmented

__all__ = [
    "build_attention_mask",
    "paged_attention_scaled_torch",
    "paged_attention_segmented",
    "paged_attention_torch",
    "varlen_paged_attention_torch",
    "write_kv_indexed",
    "write_kv_scaled",
]


def build_attention_mask(
    q_len: int,
    k_max: int,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """The masking rule as tensors: (visible ``[B, Lq, Kmax]`` bool, real-query ``[B, Lq]`` bool).

    Padding query rows are given key 0 so that SDPA never sees an all-masked row (which yields
    NaN); their output is zeroed afterwards.
    """
    key_pos = torch.arange(k_max, device=seqused_k.device)[None, None, :]  # [1, 1, Kmax]
    return _mask_for_keys(key_pos, q_len, seqused_k, seqused_q, bidir_regions, causal)


def _mask_for_keys(
    key_pos: Tensor,
    q_len: int,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``build_attention_mask`` over keys given by their logical position in each row
    (``key_pos`` ``[B or 1, 1, N]``, -1 = not a key of that row)."""
    device = seqused_k.device
    k_len = seqused_k.long()[:, None, None]  # [B, 1, 1]
    q_used = k_len.new_full(k_len.shape, q_len) if seqused_q is None else seqused_q.long()
    q_used = q_used.reshape(-1, 1, 1)
    i = torch.arange(q_len, device=device)[None, :, None]  # [1, Lq, 1]
    j = key_pos
    pos = k_len - q_used + i  # absolute position of each query, [B, Lq, 1]
    key_ok = (j >= 0) & (j < k_len)
    visible = key_ok & (j <= pos) if causal else key_ok
    if causal and bidir_regions is not None:
        regions = regions_BR2(bidir_regions)
        for r in range(regions.shape[1]):  # one bidirectional block per region (image)
            start = regions[:, r, 0].long()[:, None, None]
            end = regions[:, r, 1].long()[:, None, None]
            in_region_q = (pos >= start) & (pos < end)
            in_region_k = (j >= start) & (j < end)
            visible = visible | (in_region_q & in_region_k & key_ok)
    real = (i < q_used).squeeze(-1)  # [B, Lq]
    first = torch.arange(j.shape[-1], device=device)[None, None, :] == 0
    visible = torch.where(real[:, :, None], visible, first)
    return visible, real


def _grouped_sdpa(
    q_BLHD: Tensor, k_BKHD: Tensor, v_BKHD: Tensor, mask_BLK: Tensor, group: int, scale: float
) -> Tensor:
    """SDPA with GQA by folding the ``g`` query heads of a KV head into the query length.

    Each query row's softmax is independent, so this is the same arithmetic as expanding K/V,
    without copying K/V ``g`` times.
    """
    batch, q_len, q_heads, head_dim = q_BLHD.shape
    kv_heads, k_max = k_BKHD.shape[2], k_BKHD.shape[1]
    # [B, Lq, Hkv, g, D] -> [B, Hkv, g, Lq, D] -> [B, Hkv, g*Lq, D]
    q_BHMD = q_BLHD.view(batch, q_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q_BHMD = q_BHMD.reshape(batch, kv_heads, group * q_len, head_dim)
    mask_B1MK = mask_BLK[:, None, None].expand(batch, 1, group, q_len, k_max)
    mask_B1MK = mask_B1MK.reshape(batch, 1, group * q_len, k_max)
    out_BHMD = F.scaled_dot_product_attention(
        q_BHMD, k_BKHD.transpose(1, 2), v_BKHD.transpose(1, 2), attn_mask=mask_B1MK, scale=scale
    )
    # [B, Hkv, g*Lq, D] -> [B, Hkv, g, Lq, D] -> [B, Lq, Hkv, g, D] -> [B, Lq, Hq, D]
    out = out_BHMD.view(batch, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, q_heads, head_dim)


class _Workspace(threading.local):
    """Per-thread gather buffers, reused across calls on CPU.

    A fresh multi-megabyte tensor per layer and step costs the kernel's page faults on first
    touch (on a 2-core CPU, several times the copy itself); a buffer that only grows avoids
    them. Only the calling thread uses its buffers, and only within one attention call.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, Tensor] = {}

    def get(self, slot: str, like: Tensor, rows: int) -> Tensor:
        # inference-mode tensors cannot be written outside inference mode, and vice versa
        key = (slot, like.dtype, tuple(like.shape[1:]), torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = like.new_empty((max(rows, 1024), *like.shape[1:]))
            self.buffers[key] = buf
        return buf[:rows]


_WORKSPACE = _Workspace()


def _gather_pages(k_cache: Tensor, v_cache: Tensor, pages_BK: Tensor) -> tuple[Tensor, Tensor]:
    """K/V of each row's positions, ``[B, K, Hkv, D]`` (index_select beats 2-D fancy indexing).

    On CPU the result lives in this thread's workspace: valid until its next gather."""
    flat = pages_BK.reshape(-1).long()
    shape = (*pages_BK.shape, *k_cache.shape[1:])
    grad = torch.is_grad_enabled() and (k_cache.requires_grad or v_cache.requires_grad)
    if k_cache.device.type != "cpu" or grad:
        return k_cache.index_select(0, flat).view(shape), v_cache.index_select(0, flat).view(shape)
    k = torch.index_select(k_cache, 0, flat, out=_WORKSPACE.get("k", k_cache, flat.numel()))
    v = torch.index_select(v_cache, 0, flat, out=_WORKSPACE.get("v", v_cache, flat.numel()))
    return k.view(shape), v.view(shape)


def paged_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    shape: AttentionShape,
    softmax_scale: float,
) -> Tensor:
    """Reference ``paged_attention`` (inputs already validated; see ``contract``)."""
    # Gather only the columns some row uses: one host read of max(seqused_k).
    k_max = int(meta.seqused_k.max()) if shape.batch else 0
    if k_max == 0 or shape.q_len == 0:
        return torch.zeros_like(q)
    cut = dataclasses.replace(meta, page_table=meta.page_table[:, :k_max])
    out = _shared_page_attention(q, k_cache, v_cache, cut, shape, softmax_scale)
    if out is not None:
        return out
    k_BKHD, v_BKHD = _gather_pages(k_cache, v_cache, cut.page_table)
    mask_BLK, real_BL = build_attention_mask(
        shape.q_len, k_max, meta.seqused_k, meta.seqused_q, meta.bidir_regions, meta.causal
    )
    out = _grouped_sdpa(q, k_BKHD, v_BKHD, mask_BLK, shape.group, softmax_scale)
    if meta.seqused_q is not None:
        out = torch.where(real_BL[:, :, None, None], out, out.new_zeros(()))
    return out


def _shared_page_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    shape: AttentionShape,
    scale: float,
) -> Tensor | None:
    """Attention over each distinct page once, for batches whose rows share pages (questions
    about one cached image, a shared system prompt); None when sharing is too low to pay.

    Every query of the batch is scored against the union of the rows' pages, read once, and
    masked by the key's logical position in the query's own row (-1 where the page is not in
    that row). The per-row gather instead copies a shared prefix once per row, which on a CPU
    costs more than the arithmetic. Same masking rule, so the same result up to float
    summation order. ``meta``'s page table is cut to the columns some row uses.
    """
    pages_BK, seqused_k, seqused_q = meta.page_table, meta.seqused_k, meta.seqused_q
    batch, q_len = shape.batch, shape.q_len
    k_max = pages_BK.shape[1]
    if batch < 2:
        return None
    uniq, inv_BK = torch.unique(pages_BK, return_inverse=True)
    n_uniq = uniq.numel()
    if 2 * n_uniq > batch * k_max or (q_len > 1 and n_uniq > 2 * k_max):
        return None
    j_BK = torch.arange(k_max, device=q.device).expand(batch, k_max)
    valid_BK = j_BK < seqused_k.long()[:, None]
    key_pos_BU = torch.full((batch, n_uniq), -1, dtype=torch.long, device=q.device)
    key_pos_BU.scatter_reduce_(1, inv_BK, torch.where(valid_BK, j_BK, -1), reduce="amax")
    hits_BU = torch.zeros_like(key_pos_BU).scatter_add_(1, inv_BK, valid_BK.long())
    if bool((hits_BU > 1).any()):
        return None  # a page twice in one row: keep the per-row reference path
    mask_BLU, real_BL = _mask_for_keys(
        key_pos_BU[:, None, :], q_len, seqused_k, seqused_q, meta.bidir_regions, meta.causal
    )
    g, hkv, d = shape.group, shape.kv_heads, shape.head_dim
    m = batch * q_len * g
    # every (row, query, head-in-group) becomes one query row of its KV head: [1, Hkv, M, D]
    q_1HMD = q.view(batch, q_len, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(1, hkv, m, d)
    k_UHD, v_UHD = _gather_pages(k_cache, v_cache, uniq)  # in the workspace on CPU
    k_1HUD, v_1HUD = k_UHD.transpose(0, 1)[None], v_UHD.transpose(0, 1)[None]
    mask_11MU = mask_BLU[:, :, None, :].expand(batch, q_len, g, n_uniq).reshape(1, 1, m, n_uniq)
    out = F.scaled_dot_product_attention(q_1HMD, k_1HUD, v_1HUD, attn_mask=mask_11MU, scale=scale)
    out = out.view(hkv, batch, q_len, g, d).permute(1, 2, 0, 3, 4).reshape(q.shape)
    if seqused_q is not None:
        out = torch.where(real_BL[:, :, None, None], out, out.new_zeros(()))
    return out


def varlen_paged_attention_torch(
    q_THD: Tensor, k_cache: Tensor, v_cache: Tensor, page_table_BP: Tensor, seqs: VarlenSeqs
) -> Tensor:
    """Torch model of FlashAttention's varlen paged call (``segments.VarlenPagedKernel``).

    Each packed query row is treated as its own batch entry of length 1, with the right-aligned
    causal limit of its sequence; rows that see no key return zeros (as FlashAttention does).
    """
    seqlens_k, cu_seqlens_q = seqs.seqlens_k, seqs.cu_seqlens_q  # max_seqlen_q: a launch hint
    total, q_heads, head_dim = q_THD.shape
    kv_heads = k_cache.shape[1]
    t = torch.arange(total, device=q_THD.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True)  # sequence of each row
    n = (cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]).long()
    i = t - cu_seqlens_q[seq].long()
    k_len = seqlens_k.long()[seq]
    k_max = max(int(seqlens_k.max()), 1) if seqlens_k.numel() else 1
    pages_TK = page_table_BP[seq // seqs.segs_per_row, :k_max]
    j = torch.arange(k_max, device=q_THD.device)[None, :]
    visible_TK = j < k_len[:, None]
    if seqs.causal:
        visible_TK &= j <= (k_len - n + i)[:, None]
    seen = visible_TK.any(-1)
    visible_TK = torch.where(seen[:, None], visible_TK, j == 0)
    out = _grouped_sdpa(
        q_THD.view(total, 1, q_heads, head_dim),  # each row a batch entry of length 1
        *_gather_pages(k_cache, v_cache, pages_TK),
        visible_TK[:, None, :],
        q_heads // kv_heads,
        seqs.softmax_scale,
    )  # [T, 1, Hq, D]
    return torch.where(seen[:, None, None], out[:, 0], out.new_zeros(()))


def paged_attention_segmented(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    *,
    softmax_scale: float,
    segments: SegmentPlan | None = None,
) -> Tensor:
    """``paged_attention`` via the ``fa`` backend's segment decomposition, on torch kernels.

    Not a user-facing backend: it exists so CPU tests can check the decomposition the FlashAttention
    path relies on against the explicit mask. ``segments``: the plan to run (default: the
    two-call ``build_segment_plan``; ``segments.build_single_call_plan`` is the other form).
    """
    plan = segments or build_segment_plan(
        q.shape[1], meta.seqused_k, meta.seqused_q, meta.bidir_regions, meta.causal
    )
    return run_segmented(
        q, k_cache, v_cache, meta.page_table, plan, varlen_paged_attention_torch, softmax_scale
    )


def write_kv_indexed(
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor
) -> None:
    """In-place ``cache[slot] = new`` for every slot >= 0; slots < 0 change nothing.

    Sync-free (no boolean indexing, so it is CUDA-graph friendly): a negative slot is routed to
    page 0 (the reserved padding page) carrying page 0's current contents, so the write is a
    no-op. Only if the same call also writes page 0 through a real slot is page 0's result
    unspecified -- page 0 holds no real position, so nothing reads it as a key.
    """
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long()
    keep_N11 = (slots >= 0)[:, None, None]
    idx = slots.clamp(min=0)
    for cache, new in ((k_cache, k), (v_cache, v)):
        src = torch.where(keep_N11, new, cache.index_select(0, idx))
        cache.index_copy_(0, idx, src)


# --- scaled KV (FP8 pages, contract "Scaled KV") -------------------------------------------------
def write_kv_scaled(
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor, scales: KvScales
) -> None:
    """``write_kv_indexed`` into e4m3 pages: K and V are quantised by their layer's scales,
    and the bytes are written (slots < 0 change nothing, as there)."""
    kq, vq = quantize_kv(k, scales.k), quantize_kv(v, scales.v)
    as_bytes = torch.uint8
    write_kv_indexed(k_cache.view(as_bytes), v_cache.view(as_bytes), slot_mapping,
                     kq.view(as_bytes), vq.view(as_bytes))  # fmt: skip


def paged_attention_scaled_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    shape: AttentionShape,
    scales: KvScales,
    softmax_scale: float,
) -> Tensor:
    """Reference attention over scaled pages: the pages this call reads (each row's first
    ``max(seqused_k)``) are gathered and widened to q's dtype, then the plain reference runs
    on them with a page table into that compact copy. Nothing else is widened."""
    k_max = int(meta.seqused_k.max()) if shape.batch else 0
    if k_max == 0 or shape.q_len == 0:
        return torch.zeros_like(q)
    flat = meta.page_table[:, :k_max].reshape(-1).long()
    k = dequantize_kv(k_cache.index_select(0, flat), scales.k, q.dtype)
    v = dequantize_kv(v_cache.index_select(0, flat), scales.v, q.dtype)
    compact = torch.arange(flat.numel(), device=q.device, dtype=torch.int32).view(-1, k_max)
    inner = dataclasses.replace(shape, n_pages=flat.numel(), max_pages=k_max)
    return paged_attention_torch(
        q, k, v, dataclasses.replace(meta, page_table=compact), inner, softmax_scale
    )
