"""Triton kernels of ``kestrel_kernels.moe``: the expert gather, the GeGLU, the combine, tau.

One launch each where the torch forms take several. Arithmetic in float32, rounded once to the
storage dtype; where a row is quantised for the FP8 grouped GEMM its scale is the torch form's
(absmax / 448, 1 for an all-zero row). Triton's interpreter converts float32 to float8_e4m3
wrongly (it rounds some values to the wrong binade), so under ``TRITON_INTERPRET=1`` a
quantising kernel stores the scaled, clamped float32 values and the cast to FP8 is torch's; on
a GPU the kernel stores the FP8 bytes itself. Kernels are built lazily, per interpreter mode.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kestrel_kernels.triton_fused import interpreting

__all__ = [
    "combine_triton",
    "gather_triton",
    "geglu_triton",
    "kernels",
    "sm90_build",
    "tau_triton",
]

FP8_DTYPE = torch.float8_e4m3fn


@functools.cache
def _build_gather(interpret: bool):
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def gather_kernel(
        x, order, inv, out, scale_out, M, C: tl.constexpr, K: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_C: tl.constexpr, QUANT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # sorted rows
        c = tl.arange(0, BLOCK_C)[None, :]
        live = i < M
        ok = live & (c < C)
        pair = tl.load(order + i, mask=live, other=0)
        tl.store(inv + pair, i.to(tl.int64), mask=live)  # pair -> its sorted row
        v = tl.load(x + (pair // K) * C + c, mask=ok, other=0.0).to(tl.float32)
        if QUANT:  # per-row absmax / 448 (1 for an all-zero row), values scaled and clamped
            amax = tl.max(tl.where(ok, tl.abs(v), 0.0), axis=1)[:, None]
            scale = tl.where(amax > 0, amax / 448.0, 1.0)
            v = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
            tl.store(scale_out + i, scale, mask=live)
        tl.store(out + i * C + c, v.to(out.dtype.element_ty), mask=ok)

    return gather_kernel


@functools.cache
def _build_geglu(interpret: bool):
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def geglu_kernel(
        hg, out, scale_out, M, INNER: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
        QUANT: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK_I)[None, :]
        ok = (r < M) & (c < INNER)
        h = tl.load(hg + r * (2 * INNER) + c, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(hg + r * (2 * INNER) + INNER + c, mask=ok, other=0.0).to(tl.float32)
        v = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476)) * (g + 1.0)
        if QUANT:  # as the gather
            amax = tl.max(tl.where(ok, tl.abs(v), 0.0), axis=1)[:, None]
            scale = tl.where(amax > 0, amax / 448.0, 1.0)
            v = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
            tl.store(scale_out + r, scale, mask=r < M)
        tl.store(out + r * INNER + c, v.to(out.dtype.element_ty), mask=ok)

    return geglu_kernel


@functools.cache
def _build_combine(interpret: bool):
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(
        y, inv, w, out, N, C: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # a column tile
        live = n < N
        ok = live & (c < C)
        ty = out.dtype.element_ty
        acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):  # slot order, as the torch form sums
            row = tl.load(inv + n * K + j, mask=live, other=0)
            wj = tl.load(w + n * K + j, mask=live, other=0.0).to(ty).to(tl.float32)
            acc += wj * tl.load(y + row * C + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + n * C + c, acc.to(ty), mask=ok)

    return combine_kernel


@functools.cache
def _build_tau(interpret: bool):
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def tau_kernel(
        lin, pos, alpha, tq, tv, N, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        h = tl.arange(0, BLOCK_H)[None, :]
        ok = (n < N) & (h < H)
        ty = tq.dtype.element_ty
        s = tl.load(pos + n, mask=n < N, other=0).to(tl.float32)
        a = tl.load(alpha + h, mask=h < H, other=0.0).to(tl.float32)
        tau_pos = 0.5 + tl.sigmoid(a * tl.log(s + 1.0))
        q = tl.load(lin + n * (2 * H) + h, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(lin + n * (2 * H) + H + h, mask=ok, other=0.0).to(tl.float32)
        # tanh(x) = 2 sigmoid(2x) - 1: core ops only (no libdevice)
        tl.store(tq + n * H + h, (2.0 * tl.sigmoid(2.0 * q) - 1.0 + tau_pos).to(ty), mask=ok)
        tl.store(tv + n * H + h, (2.0 * tl.sigmoid(2.0 * v) - 1.0 + tau_pos).to(ty), mask=ok)

    return tau_kernel


def _build(interpret: bool):
    """(gather, geglu, combine, tau) jitted for one interpreter mode."""
    return tuple(b(interpret) for b in (_build_gather, _build_geglu, _build_combine, _build_tau))


def kernels():
    """(gather, geglu, combine, tau), compiled for the current interpreter mode."""
    return _build(interpreting())


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(width: int) -> int:
    """Rows per program: many under the interpreter (programs run one after another in
    Python); on a GPU enough to give a program ~4k elements."""
    if interpreting():
        return 64
    return max(1, min(16, 4096 // _next_pow2(width)))


def _quantised_out(shape: tuple[int, int], like: Tensor, quantize: bool):
    """The kernel's output buffer and the scales: float32 under the interpreter when
    quantising (torch casts to FP8 after), FP8 on a GPU."""
    if not quantize:
        return torch.empty(shape, dtype=like.dtype, device=like.device), None
    dtype = torch.float32 if interpreting() else FP8_DTYPE
    scale = torch.empty(shape[0], dtype=torch.float32, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device), scale


def _fp8(out: Tensor) -> Tensor:
    return out.to(FP8_DTYPE) if out.dtype == torch.float32 and interpreting() else out


def gather_triton(x_NC: Tensor, order: Tensor, k: int, quantize: bool):
    """(rows [M, C], scales [M] or None, inv [M]): see ``moe.gather_rows``."""
    gather = kernels()[0]
    M, C = order.shape[0], x_NC.shape[1]
    out, scale = _quantised_out((M, C), x_NC, quantize)
    inv = torch.empty_like(order)
    rows = _rows(C)
    gather[(triton_cdiv(M, rows),)](
        x_NC, order, inv, out, scale if scale is not None else out, M, C, k, rows,
        _next_pow2(C), quantize,
    )  # fmt: skip
    return (_fp8(out) if quantize else out), scale, inv


def geglu_triton(hg_MI: Tensor, quantize: bool):
    """(act [M, I], scales [M] or None): see ``moe.geglu``."""
    geglu = kernels()[1]
    M, inner = hg_MI.shape[0], hg_MI.shape[1] // 2
    out, scale = _quantised_out((M, inner), hg_MI, quantize)
    rows = _rows(inner)
    geglu[(triton_cdiv(M, rows),)](
        hg_MI, out, scale if scale is not None else out, M, inner, rows, _next_pow2(inner),
        quantize,
    )  # fmt: skip
    return (_fp8(out) if quantize else out), scale


def combine_triton(y_MC: Tensor, inv: Tensor, weights_Nk: Tensor) -> Tensor:
    """out [N, C]: see ``moe.combine``."""
    combine = kernels()[2]
    N, k = weights_Nk.shape
    C = y_MC.shape[1]
    out = torch.empty(N, C, dtype=y_MC.dtype, device=y_MC.device)
    # one token and a column tile of 512 per GPU program: its k rows stay in registers
    block = _next_pow2(C) if interpreting() else min(512, _next_pow2(C))
    rows = 64 if interpreting() else 1
    grid = (triton_cdiv(N, rows), triton_cdiv(C, block))
    combine[grid](y_MC, inv, weights_Nk.contiguous(), out, N, C, k, rows, block)
    return out


def tau_triton(lin_BT2H: Tensor, positions_BT: Tensor, alpha_H: Tensor) -> tuple[Tensor, Tensor]:
    """(tau_q, tau_v) [B, T, H]: see ``moe.tau_scales``."""
    tau = kernels()[3]
    B, T, H2 = lin_BT2H.shape
    H, N = H2 // 2, B * T
    tq = torch.empty(B, T, H, dtype=lin_BT2H.dtype, device=lin_BT2H.device)
    tv = torch.empty_like(tq)
    rows = _rows(H)
    pos = positions_BT.reshape(N)
    tau[(triton_cdiv(N, rows),)](lin_BT2H, pos, alpha_H, tq, tv, N, H, rows, _next_pow2(H))
    return tq, tv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Signatures of a production-sized build (Moondream 3: width 2048, experts of 1024, top 8, 32
# heads), with the row counts ``_rows`` gives on a GPU; the FP8 forms where they exist.
_SM90_BUILDS = {
    "gather": (
        {"x": "*bf16", "order": "*i64", "inv": "*i64", "out": "*fp8e4nv", "scale_out": "*fp32",
         "M": "i32", "C": "constexpr", "K": "constexpr", "ROWS": "constexpr",
         "BLOCK_C": "constexpr", "QUANT": "constexpr"},
        {"C": 2048, "K": 8, "ROWS": 2, "BLOCK_C": 2048, "QUANT": True},
    ),
    "geglu": (
        {"hg": "*bf16", "out": "*fp8e4nv", "scale_out": "*fp32", "M": "i32", "INNER": "constexpr",
         "ROWS": "constexpr", "BLOCK_I": "constexpr", "QUANT": "constexpr"},
        {"INNER": 1024, "ROWS": 4, "BLOCK_I": 1024, "QUANT": True},
    ),
    "combine": (
        {"y": "*bf16", "inv": "*i64", "w": "*fp32", "out": "*bf16", "N": "i32",
         "C": "constexpr", "K": "constexpr", "ROWS": "constexpr", "BLOCK_C": "constexpr"},
        {"C": 2048, "K": 8, "ROWS": 1, "BLOCK_C": 512},
    ),
    "tau": (
        {"lin": "*bf16", "pos": "*i64", "alpha": "*bf16", "tq": "*bf16", "tv": "*bf16",
         "N": "i32", "H": "constexpr", "ROWS": "constexpr", "BLOCK_H": "constexpr"},
        {"H": 32, "ROWS": 16, "BLOCK_H": 32},
    ),
}  # fmt: skip


def sm90_build(name: str, workdir: str) -> dict[str, object]:
    """Compile kernel ``name`` for an H100 (sm_90) on any machine (``triton_fused.compile_sm90``:
    registers and spills); needs a process without ``TRITON_INTERPRET``."""
    from kestrel_kernels.triton_fused import compile_sm90

    if interpreting():
        raise RuntimeError("sm90_build needs a process without TRITON_INTERPRET=1")
    fn = dict(zip(("gather", "geglu", "combine", "tau"), _build(False), strict=True))[name]
    signature, constexprs = _SM90_BUILDS[name]
    return compile_sm90(fn, signature, constexprs, name, workdir)
