"""Triton kernels of ``kestrel_kernels.fused``: RoPE + paged K/V write, residual add + LayerNorm.

Each replaces a run of small torch ops with one launch. The kernels are compiled lazily (the
first call), so ``triton`` is imported only when a fused op asks for it; the ``interpret`` knob
(``TRITON_INTERPRET=1``) is read at that moment, which is how the CPU tests run them. On a GPU
the arithmetic is the torch path's in float32 (no ``tl.dot``, no libdevice), so results agree
with it to rounding: exactly under the interpreter, within an ulp or two of the storage dtype
on a GPU (FMA contraction).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kestrel_kernels.counting import opaque
from kestrel_kernels.kv_write import HeadLayout, KvWrite

__all__ = [
    "add_layer_norm_triton",
    "compile_sm90",
    "interpreting",
    "kernels",
    "rope_write_kv_triton",
    "sm90_build",
]


def interpreting() -> bool:
    """Whether Triton runs kernels under its interpreter (``TRITON_INTERPRET=1``)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _build(interpret: bool):
    """The jitted kernels (one set per interpreter mode)."""
    return _build_rope_kv(interpret), _build_add_ln(interpret)


@functools.cache
def _build_rope_kv(interpret: bool):
    """The jitted rope + KV write kernel (one per interpreter mode)."""
    del interpret  # part of the cache key: triton.jit reads the knob when it decorates
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kv_kernel(
        qkv, cos, sin, tau_q, tau_v, slots, q_out, k_cache, v_cache, N,
        stride_tok, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
        TOKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TAU: tl.constexpr,
    ):  # fmt: skip
        # TOKS tokens per program, every q and kv head of each at once: [TOKS, heads, dims]
        n = tl.program_id(0) * TOKS + tl.arange(0, TOKS)[:, None, None]
        j = tl.arange(0, BLOCK_J)[None, :, None]  # head: q heads first, then kv heads
        d = tl.arange(0, BLOCK_D)[None, None, :]
        ok = (n < N) & (j < H + HKV) & (d < D)
        is_q = j < H
        row = qkv + n * stride_tok
        ty = q_out.dtype.element_ty
        xf = tl.load(row + j * D + d, mask=ok, other=0.0).to(tl.float32)
        partner = tl.where(d < R, d + R, d - R)
        rot = d < 2 * R
        pf = tl.load(row + j * D + partner, mask=ok & rot, other=0.0).to(tl.float32)
        if HAS_TAU:  # q * tau in the storage dtype, as the torch form rounds it
            t = tl.load(tau_q + n * H + j + d * 0, mask=ok & is_q, other=1.0).to(tl.float32)
            xf = tl.where(is_q, (xf * t).to(ty).to(tl.float32), xf)
            pf = tl.where(is_q, (pf * t).to(ty).to(tl.float32), pf)
        half = tl.where(d < R, d, d - R)
        c = tl.load(cos + n * R + half + j * 0, mask=rot & ok, other=1.0)
        s = tl.load(sin + n * R + half + j * 0, mask=rot & ok, other=0.0)
        out = tl.where(d < R, xf * c - pf * s, tl.where(rot, pf * s + xf * c, xf))
        tl.store(q_out + (n * H + j) * D + d, out.to(ty), mask=ok & is_q)
        g = j - H
        slot = tl.load(slots + n + j * 0 + d * 0, mask=ok, other=-1)  # the token's page
        keep = ok & (j >= H) & (slot >= 0)
        dst = slot * (HKV * D) + g * D + d
        tl.store(k_cache + dst, out.to(k_cache.dtype.element_ty), mask=keep)
        v = tl.load(row + (H + HKV + g) * D + d, mask=keep, other=0.0).to(tl.float32)
        if HAS_TAU:
            v = v * tl.load(tau_v + n * HKV + g + d * 0, mask=keep, other=1.0).to(tl.float32)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=keep)

    return rope_kv_kernel


@functools.cache
def _build_add_ln(interpret: bool):
    """The jitted residual add + LayerNorm kernel (one per interpreter mode)."""
    del interpret  # part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def add_ln_kernel(
        x, a, m, w, b, x_out, h_out, N, C: tl.constexpr, eps, BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr, N_DELTAS: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # ROWS rows per program
        c = tl.arange(0, BLOCK_C)[None, :]
        ok = (r < N) & (c < C)
        at = r * C + c
        ty = x_out.dtype.element_ty
        sf = tl.load(x + at, mask=ok, other=0.0).to(tl.float32)
        if N_DELTAS >= 1:  # each add rounded to the storage dtype, as the torch form does
            sf = (sf + tl.load(a + at, mask=ok, other=0.0).to(tl.float32)).to(ty)
            sf = sf.to(tl.float32)
        if N_DELTAS >= 2:
            sf = (sf + tl.load(m + at, mask=ok, other=0.0).to(tl.float32)).to(ty)
            sf = sf.to(tl.float32)
        if N_DELTAS >= 1:
            tl.store(x_out + at, sf.to(ty), mask=ok)
        mean = tl.sum(sf, axis=1)[:, None] / C
        diff = tl.where(ok, sf - mean, 0.0)
        var = tl.sum(diff * diff, axis=1)[:, None] / C
        inv = 1.0 / tl.sqrt(var + eps)
        wv = tl.load(w + c, mask=c < C, other=0.0).to(tl.float32)
        bv = tl.load(b + c, mask=c < C, other=0.0).to(tl.float32)
        tl.store(h_out + at, (diff * inv * wv + bv).to(h_out.dtype.element_ty), mask=ok)

    return add_ln_kernel


def kernels():
    """(rope_kv_kernel, add_ln_kernel), compiled for the current interpreter mode."""
    return _build(interpreting())


def _per_program(interpreted: int) -> int:
    """Rows (tokens) per program: one on a GPU; the interpreter runs programs one after
    another in Python, so there each program takes many."""
    return interpreted if interpreting() else 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rope_write_kv_triton(
    qkv_NX: Tensor, cos_NR: Tensor, sin_NR: Tensor, kv: KvWrite, heads: HeadLayout,
    tau_q_NH: Tensor | None, tau_v_NG: Tensor | None,
) -> Tensor:  # fmt: skip
    """One launch (a program per token): rotate q and k, write k and v to their pages
    (``kv``: 16-bit pages; slot < 0: no write); the rotated queries come back ``[N, H, D]``."""
    n_heads, n_kv_heads, head_dim = heads.n_heads, heads.n_kv_heads, heads.head_dim
    k_cache, v_cache, slots_N = kv.k_cache, kv.v_cache, kv.slots
    n = qkv_NX.shape[0]
    q_out = torch.empty(n, n_heads, head_dim, dtype=qkv_NX.dtype, device=qkv_NX.device)
    if n == 0:
        return q_out
    rope_kv_kernel, _ = kernels()
    has_tau = tau_q_NH is not None
    dummy = cos_NR
    toks = _per_program(64)
    with opaque("triton_rope_write_kv"):
        rope_kv_kernel[(-(-n // toks),)](
            qkv_NX, cos_NR.contiguous(), sin_NR.contiguous(),
            tau_q_NH.contiguous() if has_tau else dummy,
            tau_v_NG.contiguous() if has_tau else dummy,
            slots_N, q_out, k_cache, v_cache, n, qkv_NX.stride(0),
            H=n_heads, HKV=n_kv_heads, D=head_dim, R=cos_NR.shape[-1], TOKS=toks,
            BLOCK_J=_next_pow2(n_heads + n_kv_heads), BLOCK_D=_next_pow2(head_dim),
            HAS_TAU=has_tau,
        )  # fmt: skip
    return q_out


def add_layer_norm_triton(
    x_NC: Tensor, deltas: tuple[Tensor, ...], weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """One launch: ``x + sum(deltas)`` (in the storage dtype, added in order) and its
    LayerNorm."""
    n, c = x_NC.shape
    h = torch.empty_like(x_NC)
    x_out = torch.empty_like(x_NC) if deltas else x_NC
    if n == 0:
        return x_out, h
    _, add_ln_kernel = kernels()
    a = deltas[0].contiguous() if deltas else x_NC
    m = deltas[1].contiguous() if len(deltas) > 1 else x_NC
    rows = _per_program(64)
    with opaque("triton_add_layer_norm"):
        add_ln_kernel[(-(-n // rows),)](
            x_NC, a, m, weight, bias, x_out, h, n, C=c, eps=eps, BLOCK_C=_next_pow2(c),
            ROWS=rows, N_DELTAS=len(deltas),
        )  # fmt: skip
    return x_out, h


# Signatures of a production-sized build (Moondream 2: 32 heads of 64, rotary 32; width 2048).
_SM90_BUILDS = {
    "rope_kv": (
        {"qkv": "*bf16", "cos": "*fp32", "sin": "*fp32", "tau_q": "*bf16", "tau_v": "*bf16",
         "slots": "*i64", "q_out": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "N": "i32",
         "stride_tok": "i32", "H": "constexpr", "HKV": "constexpr", "D": "constexpr",
         "R": "constexpr", "TOKS": "constexpr", "BLOCK_J": "constexpr", "BLOCK_D": "constexpr",
         "HAS_TAU": "constexpr"},
        {"H": 32, "HKV": 32, "D": 64, "R": 16, "TOKS": 1, "BLOCK_J": 64, "BLOCK_D": 64,
         "HAS_TAU": False},
    ),
    "add_ln": (
        {"x": "*bf16", "a": "*bf16", "m": "*bf16", "w": "*bf16", "b": "*bf16",
         "x_out": "*bf16", "h_out": "*bf16", "N": "i32", "C": "constexpr", "eps": "fp32",
         "BLOCK_C": "constexpr", "ROWS": "constexpr", "N_DELTAS": "constexpr"},
        {"C": 2048, "BLOCK_C": 2048, "ROWS": 1, "N_DELTAS": 2},
    ),
}  # fmt: skip


def sm90_build(name: str, workdir: str) -> dict[str, object]:
    """Compile kernel ``name`` for an H100 (sm_90) on any machine and report its registers
    and spills from the PTX assembler Triton ships. Needs a process without
    ``TRITON_INTERPRET`` (the interpreter replaces the compiler)."""
    if interpreting():
        raise RuntimeError("sm90_build needs a process without TRITON_INTERPRET=1")
    fn = dict(zip(("rope_kv", "add_ln"), _build(False), strict=True))[name]
    signature, constexprs = _SM90_BUILDS[name]
    return compile_sm90(fn, signature, constexprs, name, workdir)


def compile_sm90(
    fn, signature: dict, constexprs: dict, name: str, workdir: str, num_warps: int = 4
) -> dict[str, object]:
    """Build the jitted ``fn`` for sm_90 with ``signature`` / ``constexprs`` and run ``ptxas
    -v`` on its PTX: whether it targets sm_90, the cubin's size, registers and spill bytes."""
    import re
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=target, options={"num_warps": num_warps},
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    src = Path(workdir) / f"{name}.ptx"
    src.write_text(ptx)
    ptxas = get_ptxas(target.arch).path
    out = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(src.with_suffix(".cubin"))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {
        "target": ".target sm_90" in ptx,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "registers": int(regs.group(1)) if regs else -1,
        "spill_bytes": sum(spills),
        "report": report,
    }
