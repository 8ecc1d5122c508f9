"""Flash-decoding in Triton: attention of one query position per row over paged K/V.

    out_BHD = paged_decode(q_BHD, k_cache, v_cache, AttentionMeta(page_table, seqused_k),
                           softmax_scale=, kv_scales=None)

The decode step of the attention contract (``kestrel_kernels.contract``): ``Lq = 1``, so the
query of row ``b`` sits at position ``seqused_k[b] - 1`` and sees every key of its row (the
causal limit and any bidirectional region change nothing). Rows with no key, or with
``seqused_q[b] == 0``, come back as zeros.

Two launches (one when a single split covers the page table):

1. ``split``: grid ``(splits, head blocks, B)``. A program takes ``heads`` query heads of one
   row and one chunk of that row's positions; it reads each position's K and V for those heads
   (for Moondream's 32 x 64 heads a block of 8 heads is 1 KiB of contiguous bf16 per page; the
   next block's page ids are loaded with the current block's K/V), keeps an online softmax
   in float32 (base 2: scores carry ``log2(e)``), and writes its partial maximum, sum and
   unnormalised output.
2. ``combine``: grid ``(B, heads)``: merges the splits of one row and head.

The grid, the split count and the work buffers depend only on ``B``, the page table's width
and the head counts (``plan_decode``), never on the lengths' values, and nothing is read back
to the host: a CUDA graph captures the call and replays it with new lengths and page tables.
Splits past a row's length run no loop iteration and write an empty partial. The split count
is a run-time argument, so batch sizes share one compiled kernel per dtype (one more for the
single-split form).

FP8 pages (the contract's scaled case): each value read is ``stored * scale`` rounded to q's
dtype, as ``contract.dequantize_kv`` computes it; the scales are loaded on the device.

Grouped heads: query head ``h`` reads KV head ``h // (H // Hkv)``; a block's heads then read
a KV head's row once per query head of its group (L1 serves the repeats).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel_kernels.contract import AttentionMeta, KernelInputError, KvScales
from kestrel_kernels.counting import opaque
from kestrel_kernels.triton_fused import interpreting

__all__ = ["DecodeConfig", "DecodePlan", "kernels", "paged_decode", "plan_decode", "sm90_build"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch knobs. ``heads``: query heads per program (a power of two); ``block_n``:
    positions per loop iteration; ``target_programs``: the split programs aimed for;
    ``min_chunk``: fewest positions a split covers; ``splits``: a fixed split count (None:
    from the target); ``num_warps``: warps per split program. First guesses, to be tuned on a
    GPU (``scripts/bench_attention.py --only gpu --sweep``)."""

    heads: int = 8
    block_n: int = 4
    target_programs: int = 2048
    min_chunk: int = 32
    splits: int | None = None
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One call's static launch: ``splits`` chunks of ``chunk`` positions per row, ``heads``
    query heads per program in ``head_blocks`` blocks, ``block_n`` positions per iteration."""

    splits: int
    chunk: int
    heads: int
    head_blocks: int
    block_n: int
    num_warps: int

    @property
    def programs(self) -> int:
        return self.splits * self.head_blocks


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=256)
def plan_decode(batch: int, max_pages: int, q_heads: int, config: DecodeConfig) -> DecodePlan:
    """The launch for ``batch`` rows, a page table ``max_pages`` wide and ``q_heads`` heads:
    a function of those numbers and ``config`` alone (what makes the call capturable)."""
    if config.heads < 1 or config.heads & (config.heads - 1):
        raise KernelInputError(f"DecodeConfig.heads must be a power of two, got {config.heads}")
    if config.block_n < 1 or config.block_n & (config.block_n - 1):
        raise KernelInputError(f"DecodeConfig.block_n must be a power of two, got {config.block_n}")
    heads = min(config.heads, _next_pow2(q_heads))
    head_blocks = -(-q_heads // heads)
    width = max(max_pages, 1)
    if config.splits is not None:
        splits = max(1, min(config.splits, width))
    else:
        per_row = -(-config.target_programs // max(batch * head_blocks, 1))
        splits = max(1, min(per_row, -(-width // max(config.min_chunk, 1))))
    chunk = -(-width // splits)
    chunk = -(-chunk // config.block_n) * config.block_n  # whole iterations per split
    splits = -(-width // chunk)
    return DecodePlan(splits, chunk, heads, head_blocks, config.block_n, config.num_warps)


@functools.cache
def _build_split(interpret: bool):
    """The jitted split kernel (one per interpreter mode)."""
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q, k_cache, v_cache, page_table, seqused_k, seqused_q, k_scale, v_scale,
        part_m, part_l, part_acc, out, qk_scale, stride_qb, stride_qh, stride_page,
        stride_kvh, stride_pt, chunk, H, G, splits,
        D: tl.constexpr, BLOCK_D: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, SCALED: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr,
    ):  # fmt: skip
        s, hb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        h = hb * HEADS + tl.arange(0, HEADS)  # query heads of this program
        d = tl.arange(0, BLOCK_D)
        h_ok, d_ok = h < H, d < D
        k_len = tl.load(seqused_k + b)
        if HAS_SEQUSED_Q:
            k_len = tl.where(tl.load(seqused_q + b) > 0, k_len, 0)
        qv = tl.load(q + b * stride_qb + h[:, None] * stride_qh + d[None, :],
                     mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        qf = qv.to(tl.float32) * qk_scale  # [HEADS, BLOCK_D], base-2 softmax
        kv_off = (h // G)[None, :, None] * stride_kvh + d[None, None, :]  # [1, HEADS, BLOCK_D]
        hd_ok = (h_ok[:, None] & d_ok[None, :])[None, :, :]
        m = tl.full([HEADS], -1.0e30, tl.float32)  # finite: an empty split stays NaN-free
        l_sum = tl.zeros([HEADS], tl.float32)
        acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
        ks = 1.0
        vs = 1.0
        if SCALED:
            ks = tl.load(k_scale)
            vs = tl.load(v_scale)
        start = s * chunk
        stop = tl.minimum(start + chunk, k_len)
        rows = page_table + b * stride_pt + tl.arange(0, BLOCK_N)
        page = tl.load(rows + start, mask=start + tl.arange(0, BLOCK_N) < stop, other=0)
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < stop
            # [BLOCK_N, HEADS, BLOCK_D] offsets of this block's K/V; the next block's page
            # ids are loaded beside them, so the two loads do not wait on each other
            at = page.to(tl.int64)[:, None, None] * stride_page + kv_off
            ok = n_ok[:, None, None] & hd_ok
            kt = tl.load(k_cache + at, mask=ok, other=0.0)
            vt = tl.load(v_cache + at, mask=ok, other=0.0)
            page = tl.load(rows + n0 + BLOCK_N, mask=n + BLOCK_N < stop, other=0)
            if SCALED:  # stored * scale, rounded to q's dtype (contract.dequantize_kv)
                kt = (kt.to(tl.float32) * ks).to(qv.dtype)
                vt = (vt.to(tl.float32) * vs).to(qv.dtype)
            sc = tl.sum(kt.to(tl.float32) * qf[None, :, :], axis=2)  # [BLOCK_N, HEADS]
            sc = tl.where(n_ok[:, None], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new[None, :])
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt.to(tl.float32), axis=0)
            m = m_new
        hd = h[:, None] * D + d[None, :]
        if DIRECT:  # the only split: normalise and write the output
            o = tl.where(l_sum[:, None] > 0, acc / tl.maximum(l_sum, 1e-30)[:, None], 0.0)
            tl.store(out + b * H * D + hd, o.to(out.dtype.element_ty),
                     mask=h_ok[:, None] & d_ok[None, :])  # fmt: skip
        else:
            row = (b * H + h) * splits + s  # partials laid out [B, H, splits(, D)]
            tl.store(part_m + row, m, mask=h_ok)
            tl.store(part_l + row, l_sum, mask=h_ok)
            tl.store(part_acc + row[:, None] * D + d[None, :], acc,
                     mask=h_ok[:, None] & d_ok[None, :])  # fmt: skip

    return split_kernel


@functools.cache
def _build_combine(interpret: bool):
    """The jitted combine kernel (one per interpreter mode)."""
    del interpret  # part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(
        part_m, part_l, part_acc, out, H, splits,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        b, h = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        base = (b * H + h) * splits
        m_run = tl.full([1], -1.0e30, tl.float32)
        l_run = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < splits
            ms = tl.load(part_m + base + s, mask=s_ok, other=-1.0e30)
            ls = tl.load(part_l + base + s, mask=s_ok, other=0.0)
            at = (base + s)[:, None] * D + d[None, :]
            accs = tl.load(part_acc + at, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            m_new = tl.maximum(m_run, tl.max(ms, axis=0))
            w = tl.exp2(ms - m_new)  # [BLOCK_S]
            alpha = tl.exp2(m_run - m_new)
            l_run = l_run * alpha + tl.sum(ls * w, axis=0)
            acc = acc * alpha + tl.sum(accs * w[:, None], axis=0)
            m_run = m_new
        o = tl.where(l_run > 0, acc / tl.maximum(l_run, 1e-30), 0.0)
        tl.store(out + (b * H + h) * D + d, o.to(out.dtype.element_ty), mask=d_ok)

    return combine_kernel


def _build(interpret: bool):
    return _build_split(interpret), _build_combine(interpret)


def kernels():
    """(split_kernel, combine_kernel), compiled for the current interpreter mode."""
    return _build(interpreting())


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    *,
    softmax_scale: float,
    kv_scales: KvScales | None = None,
    config: DecodeConfig | None = None,
) -> Tensor:
    """Attention of ``q`` ``[B, H, D]`` (one position per row) over the paged K/V
    ``[n_pages, Hkv, D]`` through ``meta.page_table`` int32 ``[B, P]`` with ``meta.seqused_k``
    int32 ``[B]`` keys per row (rows whose ``meta.seqused_q`` is 0: zeros; the causal limit and
    regions change nothing for one query); returns ``[B, H, D]`` in q's dtype. Inputs are as the
    contract's validation leaves them (not re-checked here); ``kv_scales``: FP8 pages and their
    scales."""
    page_table, seqused_k, seqused_q = meta.page_table, meta.seqused_k, meta.seqused_q
    batch, heads, dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0 or heads == 0:
        return out
    plan = plan_decode(batch, page_table.shape[1], heads, config or DecodeConfig())
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    page_table = page_table.contiguous()
    split_kernel, combine_kernel = kernels()
    if plan.splits > 1:
        part_m = torch.empty(batch, heads, plan.splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused: the one split writes ``out``
    scales = (kv_scales.k, kv_scales.v) if kv_scales is not None else (seqused_k, seqused_k)
    block_d = _next_pow2(dim)
    with opaque("triton_decode_split"):
        split_kernel[(plan.splits, plan.head_blocks, batch)](
            q, k_cache, v_cache, page_table, seqused_k,
            seqused_q if seqused_q is not None else seqused_k, *scales,
            part_m, part_l, part_acc, out, float(softmax_scale) * _LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            page_table.stride(0), plan.chunk, heads, heads // k_cache.shape[1], plan.splits,
            D=dim, BLOCK_D=block_d, HEADS=plan.heads, BLOCK_N=plan.block_n,
            DIRECT=plan.splits == 1, SCALED=kv_scales is not None,
            HAS_SEQUSED_Q=seqused_q is not None, num_warps=plan.num_warps,
        )  # fmt: skip
    if plan.splits > 1:
        with opaque("triton_decode_combine"):
            combine_kernel[(batch, heads)](
                part_m, part_l, part_acc, out, heads, plan.splits, D=dim, BLOCK_D=block_d,
                BLOCK_S=16, num_warps=1,
            )  # fmt: skip
    return out


# Signatures of production-sized builds (Moondream 2: 32 heads of 64, bf16, the default config).
_DEFAULT = DecodeConfig()
_SPLIT_SIG = {
    "q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "page_table": "*i32",
    "seqused_k": "*i32", "seqused_q": "*i32", "k_scale": "*fp32", "v_scale": "*fp32",
    "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "out": "*bf16",
    "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32", "stride_page": "i32",
    "stride_kvh": "i32", "stride_pt": "i32", "chunk": "i32", "H": "i32", "G": "i32",
    "splits": "i32",
    "D": "constexpr", "BLOCK_D": "constexpr", "HEADS": "constexpr", "BLOCK_N": "constexpr",
    "DIRECT": "constexpr", "SCALED": "constexpr", "HAS_SEQUSED_Q": "constexpr",
}  # fmt: skip
_SPLIT_CONST = {"D": 64, "BLOCK_D": 64, "HEADS": _DEFAULT.heads,
                "BLOCK_N": _DEFAULT.block_n, "DIRECT": False, "HAS_SEQUSED_Q": False}  # fmt: skip
_SM90_BUILDS = {
    "split": (0, _SPLIT_SIG, {**_SPLIT_CONST, "SCALED": False}, _DEFAULT.num_warps),
    "split_fp8": (
        0,
        {**_SPLIT_SIG, "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"},
        {**_SPLIT_CONST, "SCALED": True},
        _DEFAULT.num_warps,
    ),
    "combine": (
        1,
        {"part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "out": "*bf16", "H": "i32",
         "splits": "i32", "D": "constexpr", "BLOCK_D": "constexpr", "BLOCK_S": "constexpr"},
        {"D": 64, "BLOCK_D": 64, "BLOCK_S": 16},
        1,
    ),
}  # fmt: skip


def sm90_build(name: str, workdir: str, config: DecodeConfig | None = None) -> dict[str, object]:
    """Build kernel ``name`` ("split", "split_fp8", "combine") for an H100 (sm_90) on any
    machine: ``triton_fused.compile_sm90``'s report (registers, spills). ``config``: a split
    kernel's launch configuration (default: ``DecodeConfig()``). Needs a process without
    ``TRITON_INTERPRET``."""
    from kestrel_kernels.triton_fused import compile_sm90

    if interpreting():
        raise RuntimeError("sm90_build needs a process without TRITON_INTERPRET=1")
    which, signature, constexprs, num_warps = _SM90_BUILDS[name]
    if config is not None and which == 0:
        constexprs = {**constexprs, "HEADS": config.heads, "BLOCK_N": config.block_n}
        num_warps = config.num_warps
    return compile_sm90(_build(False)[which], signature, constexprs, name, workdir, num_warps)
