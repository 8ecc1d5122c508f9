"""One Triton launch per resize step: Moondream's crops made from the image in 2-3 kernels.

A libvips resize is a chain of passes along one axis each (a box shrink, lanczos3 reduce,
bicubic affine): output pixel ``o`` of a pass is the integer ``((sum_k w[o, k] *
src[idx[o, k]] + add) * mul) >> shift``, clipped to 0..255 where libvips clips. The tables
(``idx``, ``w``: which source pixels, which integer weights) are computed on the host
(``kestrel/crops/resample.py``); this kernel runs them in integers, as libvips does, so
its bytes are libvips' whatever the GPU.

A *stage* is one pass, or two passes along the same axis fused (the first one's value at
each tap recomputed where the second reads it: a box average before a reduce, a reduce before
the bicubic blend at scale 1): a stage reads the image or the previous stage's output and
writes the next one, so an image's two resizes (the global crop and the copy the local crops
are cut from) take one stage per axis. Both resizes run in the same launches (``job`` 0 and
1 split the grid), and each one's last stage writes the crops straight into the encoder's
input, [N, 3, crop, crop] normalized through the 256-entry pixel table (or uint8 [N, crop,
crop, 3]): every pixel into each overlapping crop that holds it.

A stage's description is a row of ``FIELDS`` int32 values in a small device table (built per
image size by ``kestrel/crops/stages.py``, uploaded with the weight tables).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kestrel_kernels.counting import opaque

__all__ = ["FIELDS", "blocks", "resample_crops"]

# One stage of one job, as the kernel reads it (int32 each; field i at row + i: ``_jit``
# checks the kernel's own list of its reads against it).
FIELDS = (
    "from_image",  # 1: reads the uint8 image; 0: the int16 scratch at src_at
    "src_at", "s_axis", "s_other",  # source offset (scratch) and strides; channels stride 1
    "n_out", "n_other",  # output pixels along the axis, and across it (times 3 channels)
    "taps", "idx_at", "w_at", "add", "mul", "shift", "clip",  # the pass (tables' offsets)
    "pre_taps", "pre_idx_at", "pre_w_at", "pre_add", "pre_mul", "pre_shift", "pre_clip",
    "final", "dst_at", "d_axis", "d_other",  # 0: to the scratch at dst_at (strides), 1: crops
    "axis", "n0", "rows", "cols", "window",  # the crops: first index, tiling, their stride
)  # fmt: skip


def blocks(interpret: bool, jobs: tuple = ()) -> tuple[int, int]:
    """(output pixels along the axis, values across it) per program: small tiles on a GPU
    (8 x 128 builds for sm_90 in 168 registers, no spills; 16 x 128 needs all 255); under the
    interpreter, whose cost is per program and per tile element, tiles as large as the
    step's stages (``jobs``: their (n_out, n_other)), up to 128 x 2048."""
    if not interpret:
        return (8, 128)
    shapes = [job for job in jobs if job is not None] or [(1, 1)]
    bo = min(128, _pow2(max(n for n, _ in shapes)))
    return bo, min(2048, _pow2(max(3 * m for _, m in shapes)))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def programs(n_out: int, n_other: int, tiles: tuple[int, int]) -> int:
    """The programs one stage of ``n_out`` pixels along its axis, ``n_other`` across, takes
    in ``tiles`` (``blocks``)."""
    bo, bm = tiles
    return -(-n_out // bo) * -(-(n_other * 3) // bm)


@functools.cache
def _jit():
    """The jitted kernel, imported on first use (``_resample_jit``), after checking that it
    reads a stage row's fields where ``FIELDS`` puts them (once)."""
    from kestrel_kernels import _resample_jit

    if _resample_jit.READS != FIELDS:
        raise RuntimeError("triton_resample.FIELDS and the kernel's reads of a stage row differ")
    return _resample_jit.resample_kernel


def resample_crops(
    image: Tensor,
    tables: Tensor,
    desc_at: int,
    steps: tuple[tuple[tuple[int, int] | None, tuple[int, int] | None], ...],
    scratch_size: int,
    out: Tensor,
    lut: Tensor | None,
) -> None:
    """Run every step of an image's two resizes: ``image`` uint8 [H, W, 3]; ``tables`` the
    int32 weight tables with the stage rows from ``desc_at`` on ([steps, 2, FIELDS]);
    ``steps[s]`` each job's (n_out, n_other) at step ``s`` (None: that job is done);
    ``out`` the crops: [N, 3, crop, crop] written through ``lut`` (float32 [256]), or with
    ``lut`` None uint8 [N, crop, crop, 3]. One launch per step."""
    from kestrel_kernels.triton_fused import interpreting

    kernel, interpret = _jit(), interpreting()
    crop = out.shape[-1] if lut is not None else out.shape[-2]
    # a first stage's output: 0..255, or a little past either end before the bicubic blend's
    # clip (its Catmull-Rom lobes): int16 holds it
    scratch = torch.empty(max(1, scratch_size), dtype=torch.int16, device=image.device)
    table = lut if lut is not None else scratch  # unused for uint8 crops
    for s, jobs in enumerate(steps):
        bo, bm = blocks(interpret, jobs)
        counts = [programs(*job, (bo, bm)) if job is not None else 0 for job in jobs]
        with opaque("triton_resample"):
            kernel[(sum(counts),)](
                tables, tables, image, scratch, out, table, desc_at + s * 2 * len(FIELDS),
                counts[0], CROP=crop, OUT_U8=lut is None, NF=len(FIELDS), BO=bo, BM=bm,
            )  # fmt: skip


def sm90_build(workdir: str, out_u8: bool = False) -> dict[str, object]:
    """Compile the kernel for an H100 (sm_90) on any machine, as the encoder's bfloat16 input
    (or uint8 crops) of Moondream's 378-pixel crops with the GPU's tiles; its registers and
    spills (``triton_fused.compile_sm90``). Needs a process without ``TRITON_INTERPRET``."""
    from kestrel_kernels.triton_fused import compile_sm90, interpreting

    if interpreting():
        raise RuntimeError("sm90_build needs a process without TRITON_INTERPRET=1")
    resample_kernel = _jit()
    bo, bm = blocks(False)
    signature = {"desc": "*i32", "tables": "*i32", "image": "*u8", "scratch": "*i16",
                 "out": "*u8" if out_u8 else "*bf16", "lut": "*fp32", "step_at": "i32",
                 "programs_0": "i32", "CROP": "constexpr", "OUT_U8": "constexpr",
                 "NF": "constexpr", "BO": "constexpr", "BM": "constexpr"}  # fmt: skip
    constexprs = {"CROP": 378, "OUT_U8": out_u8, "NF": len(FIELDS), "BO": bo, "BM": bm}
    return compile_sm90(resample_kernel, signature, constexprs, "resample", workdir)
