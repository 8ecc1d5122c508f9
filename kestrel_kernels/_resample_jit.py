"""The jitted kernel of ``triton_resample.py`` (its module doc says what it does).

Imported on first use, so ``triton`` is imported only when crops are cut by it; Triton reads
``TRITON_INTERPRET`` when it decorates, i.e. when this module is first imported (the CPU tests
and ``scripts/count_kernels.py`` set it before). The helpers are module-level jitted
functions: the kernel finds them among this module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["READS", "resample_kernel"]

# What ``resample_kernel`` reads at ``d + i`` (a stage row), in order: ``triton_resample``
# checks it is its FIELDS before it launches the kernel.
READS = (
    "from_image", "src_at", "s_axis", "s_other", "n_out", "n_other", "taps", "idx_at", "w_at",
    "add", "mul", "shift", "clip", "pre_taps", "pre_idx_at", "pre_w_at", "pre_add", "pre_mul",
    "pre_shift", "pre_clip", "final", "dst_at", "d_axis", "d_other", "axis", "n0", "rows",
    "cols", "window",
)  # fmt: skip


@triton.jit
def load_src(image, scratch, from_image, offs, ok):
    if from_image != 0:
        x = tl.load(image + offs, mask=ok, other=0).to(tl.int32)
    else:
        x = tl.load(scratch + offs, mask=ok, other=0).to(tl.int32)
    return x


@triton.jit
def epilogue(acc, add, mul, shift, clip):
    v = ((acc.to(tl.int64) + add) * mul) >> shift
    v = tl.where(clip != 0, tl.minimum(tl.maximum(v, 0), 255), v)
    return v.to(tl.int32)


@triton.jit
def tap_sum(image, scratch, from_image, base, s_axis, m_off, m_ok, tables, idx_at, w_at,
            taps, pos, pos_ok, BO: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    # sum_k w[pos, k] * src[idx[pos, k]]: positions pos [BO], values m_off [BM] across
    acc = tl.zeros((BO, BM), dtype=tl.int32)
    for k in range(0, taps):
        at = pos * taps + k
        src = tl.load(tables + idx_at + at, mask=pos_ok, other=0).to(tl.int64)
        w = tl.load(tables + w_at + at, mask=pos_ok, other=0)
        offs = base + src[:, None] * s_axis + m_off[None, :]
        x = load_src(image, scratch, from_image, offs, pos_ok[:, None] & m_ok[None, :])
        acc += w[:, None] * x
    return acc


@triton.jit
def store_crops(v, i, j, c, ok, out, lut, n0, rows, cols, window,
                CROP: tl.constexpr, OUT_U8: tl.constexpr):  # fmt: skip
    # pixel (i, j, c) of the resized copy into every crop (r, q) whose window holds it
    if OUT_U8:
        val = v.to(tl.uint8)
    else:
        val = tl.load(lut + v, mask=ok, other=0.0).to(out.dtype.element_ty)
    r_hi = tl.minimum(i // window, rows - 1)
    q_hi = tl.minimum(j // window, cols - 1)
    for dr in tl.static_range(2):
        r = r_hi - dr
        y = i - r * window
        r_ok = (r >= 0) & (y >= 0) & (y < CROP)
        for dq in tl.static_range(2):
            q = q_hi - dq
            x = j - q * window
            here = ok & r_ok & (q >= 0) & (x >= 0) & (x < CROP)
            n = (n0 + r * cols + q).to(tl.int64)
            if OUT_U8:
                offs = ((n * CROP + y) * CROP + x) * 3 + c
            else:
                offs = ((n * 3 + c) * CROP + y) * CROP + x
            tl.store(out + offs, val, mask=here)


@triton.jit(do_not_specialize=["step_at", "programs_0"])  # one build per output form
def resample_kernel(desc, tables, image, scratch, out, lut, step_at, programs_0,
                    CROP: tl.constexpr, OUT_U8: tl.constexpr, NF: tl.constexpr,
                    BO: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    job = (pid >= programs_0).to(tl.int32)
    d = desc + step_at + job * NF
    local = pid - job * programs_0
    n_out = tl.load(d + 4)
    m_all = tl.load(d + 5) * 3
    m_blocks = tl.cdiv(m_all, BM)
    o = (local // m_blocks) * BO + tl.arange(0, BO)
    m = (local % m_blocks) * BM + tl.arange(0, BM)
    o_ok = o < n_out
    m_ok = m < m_all
    a = m // 3
    c = m % 3
    from_image = tl.load(d + 0)
    base = tl.load(d + 1).to(tl.int64)
    s_axis = tl.load(d + 2).to(tl.int64)
    m_off = a.to(tl.int64) * tl.load(d + 3) + c
    taps = tl.load(d + 6)
    pre_taps = tl.load(d + 13)
    if pre_taps == 0:
        acc = tap_sum(image, scratch, from_image, base, s_axis, m_off, m_ok, tables,
                      tl.load(d + 7), tl.load(d + 8), taps, o, o_ok, BO, BM)  # fmt: skip
    else:
        acc = tl.zeros((BO, BM), dtype=tl.int32)
        for k in range(0, taps):
            at = o * taps + k
            mid = tl.load(tables + tl.load(d + 7) + at, mask=o_ok, other=0)
            w = tl.load(tables + tl.load(d + 8) + at, mask=o_ok, other=0)
            pre_idx, pre_w = tl.load(d + 14), tl.load(d + 15)
            inner = tap_sum(image, scratch, from_image, base, s_axis, m_off, m_ok, tables,
                            pre_idx, pre_w, pre_taps, mid, o_ok, BO, BM)  # fmt: skip
            v = epilogue(inner, tl.load(d + 16), tl.load(d + 17), tl.load(d + 18),
                         tl.load(d + 19))  # fmt: skip
            acc += w[:, None] * v
    v = epilogue(acc, tl.load(d + 9), tl.load(d + 10), tl.load(d + 11), tl.load(d + 12))
    ok = o_ok[:, None] & m_ok[None, :]
    if tl.load(d + 20) == 0:
        offs = (tl.load(d + 21) + o[:, None].to(tl.int64) * tl.load(d + 22)
                + (a * tl.load(d + 23) + c)[None, :])  # fmt: skip
        tl.store(scratch + offs, v.to(tl.int16), mask=ok)
    else:
        along = tl.load(d + 24) == 0  # axis 0: o is the row, a the column
        i = tl.where(along, o[:, None], a[None, :])
        j = tl.where(along, a[None, :], o[:, None])
        store_crops(v, i, j, c[None, :], ok, out, lut, tl.load(d + 25), tl.load(d + 26),
                    tl.load(d + 27), tl.load(d + 28), CROP, OUT_U8)  # fmt: skip
