"""An image size's crops as the stages of ``kestrel_kernels/triton_resample.py`` (numpy only).

``resample.py`` plans each resize as passes along one axis; here the passes become stages
(one pass, or two along the same axis fused: ``kestrel_kernels.triton_resample``), the two
resizes of a ``CropPlan`` become the kernel's two jobs, and everything the kernel reads is
laid out in one int32 array: each stage's index and weight tables, then one row of
``FIELDS`` per job per step. The array is uploaded once per image size and kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kestrel.crops.resample import AxisPass, CropPlan, ResizePlan
from kestrel_kernels.triton_resample import FIELDS

__all__ = ["KernelPlan", "kernel_plan"]

_ROW = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True, slots=True, eq=False)
class KernelPlan:
    """What ``triton_resample.resample_crops`` takes for one image size: ``array`` (the
    tables, then the stage rows from ``desc_at``), each step's (n_out, n_other) per job, the
    int16 scratch the stages between need, and whether a resize ends short of its size (its
    crops' missing edge is then filled with pixel value 0 first)."""

    array: np.ndarray
    desc_at: int
    steps: tuple[tuple[tuple[int, int] | None, tuple[int, int] | None], ...]
    scratch_size: int
    short: bool


def _stages(plan: ResizePlan, height: int) -> list[tuple[AxisPass | None, AxisPass]]:
    """The passes paired: a pass and the next along the same axis are one stage. A resize
    with no pass (the image is already its size) copies its rows: one tap of weight 1."""
    out, passes, i = [], plan.passes, 0
    if not passes:
        index = np.arange(height, dtype=np.int64)[:, None]
        weight = np.full((height, 1), 1 << 12, np.int32)
        passes = (AxisPass(0, height, index, weight, clip=True, key=("copy", height)),)
    while i < len(passes):
        if i + 1 < len(passes) and passes[i + 1].axis == passes[i].axis:
            out.append((passes[i], passes[i + 1]))
            i += 2
        else:
            out.append((None, passes[i]))
            i += 1
    return out


def _epilogue(p: AxisPass) -> tuple[int, int, int, int]:
    """(add, mul, shift, clip): libvips' rounding of a pass's integer sum."""
    if p.box:
        return p.box // 2, (1 << 24) // p.box, 24, int(p.clip)
    return 1 << 11, 1, 12, int(p.clip)


class _Layout:
    """The int32 array being laid out: tables appended, scratch regions handed out."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.scratch = 0

    def table(self, values: np.ndarray) -> int:
        at = self.size
        flat = np.ascontiguousarray(values, dtype=np.int64).ravel()
        if flat.size and (flat.min() < -(2**31) or flat.max() >= 2**31):
            raise ValueError("a resample table does not fit int32")
        self.parts.append(flat.astype(np.int32))
        self.size += flat.size
        return at

    def region(self, n: int) -> int:
        at = self.scratch
        self.scratch += n
        return at


def _job_rows(
    plan: ResizePlan, image: tuple[int, int], crops: tuple[int, int, int, int], lay: _Layout
) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """One resize's stage rows and each stage's (n_out, n_other); ``crops``: (first crop,
    rows, cols, window) its last stage writes."""
    rows, shapes = [], []
    h, w = image
    src: int | None = None  # the scratch offset of the last stage's output ([h, w, 3])
    stages = _stages(plan, h)
    for s, (pre, main) in enumerate(stages):
        row = np.zeros(len(FIELDS), np.int64)
        axis = main.axis
        s_axis, s_other = (3 * w, 3) if axis == 0 else (3, 3 * w)
        n_out, n_other = len(main.index), (w if axis == 0 else h)
        row[[_ROW[k] for k in ("from_image", "src_at", "s_axis", "s_other")]] = (
            int(src is None), src or 0, s_axis, s_other)  # fmt: skip
        row[_ROW["n_out"]], row[_ROW["n_other"]] = n_out, n_other
        row[_ROW["taps"]] = main.index.shape[1]
        row[_ROW["idx_at"]], row[_ROW["w_at"]] = lay.table(main.index), lay.table(main.weight)
        row[[_ROW[k] for k in ("add", "mul", "shift", "clip")]] = _epilogue(main)
        if pre is not None:
            row[_ROW["pre_taps"]] = pre.index.shape[1]
            row[_ROW["pre_idx_at"]] = lay.table(pre.index)
            row[_ROW["pre_w_at"]] = lay.table(pre.weight)
            row[[_ROW[k] for k in ("pre_add", "pre_mul", "pre_shift", "pre_clip")]] = (
                _epilogue(pre))  # fmt: skip
        h, w = (n_out, w) if axis == 0 else (h, n_out)
        row[_ROW["axis"]] = axis
        if s == len(stages) - 1:
            row[_ROW["final"]] = 1
            row[[_ROW[k] for k in ("n0", "rows", "cols", "window")]] = crops
        else:
            at = lay.region(h * w * 3)
            row[_ROW["dst_at"]] = at
            row[_ROW["d_axis"]], row[_ROW["d_other"]] = (3 * w, 3) if axis == 0 else (3, 3 * w)
            src = at
        rows.append(row)
        shapes.append((n_out, n_other))
    return rows, shapes


@lru_cache(maxsize=1024)
def kernel_plan(plan: CropPlan, height: int, width: int) -> KernelPlan:
    """``plan`` (a ``height`` x ``width`` image's crops) laid out for the kernel (kept per
    plan: ``resample.crop_plan`` keeps one per size)."""
    g, lay = plan.geometry, _Layout()
    jobs = [
        _job_rows(plan.whole, (height, width), (0, 1, 1, g.crop), lay),
        _job_rows(plan.local, (height, width), (1, g.rows, g.cols, g.window), lay),
    ]
    n_steps = max(len(rows) for rows, _ in jobs)
    if n_steps == 0:
        raise ValueError(f"a {height} x {width} image's crops need at least one pass")
    desc = np.zeros((n_steps, 2, len(FIELDS)), np.int64)
    steps = []
    for s in range(n_steps):
        for j, (rows, _) in enumerate(jobs):
            if s < len(rows):
                desc[s, j] = rows[s]
        steps.append(tuple(shapes[s] if s < len(shapes) else None for _, shapes in jobs))
    desc_at = lay.table(desc)
    short = any(r.natural[0] < r.size[0] or r.natural[1] < r.size[1]
                for r in (plan.whole, plan.local))  # fmt: skip
    return KernelPlan(np.concatenate(lay.parts), desc_at, tuple(steps), lay.scratch, short)
