"""The crops cut by the Triton resample kernel (``kestrel_kernels/triton_resample.py``, laid
out by ``kestrel/crops/stages.py``), under the interpreter: libvips' bytes for every
kind of pass (shrunk, box-shrunk first, enlarged, one axis each way, no pass at all), the
encoder's input equal to the torch path's and written where it is asked to be, one launch per
step, and an sm_90 build without spills.

Small crops (a 56-pixel crop, 14-pixel patches) keep the interpreter quick; one image has
Moondream's geometry. Skipped without the ``triton`` package.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kestrel.crops import device as device_crops
from kestrel.crops.overlap import overlap_crops
from kestrel.crops.resample import crop_plan
from kestrel.crops.stages import _stages, kernel_plan
from kestrel.moondream.config import MoondreamConfig, VisionConfig
from kestrel_kernels import fused
from kestrel_kernels.counting import LaunchCounter
from kestrel_kernels.triton_resample import FIELDS
from tests.sm90 import assert_built, sm90_builds

SMALL = VisionConfig(enc_dim=32, enc_n_heads=2, crop_size=56, overlap_margin=1, max_crops=12)
# (height, width): the passes each size's two resizes take with SMALL
SIZES = {
    (56, 56): "the global crop: no pass (the image is its size)",
    (1, 1): "both axes enlarged (bicubic)",
    (90, 130): "both shrunk (lanczos3)",
    (230, 300): "both box-shrunk first, then reduced",
    (200, 20): "rows shrunk, columns enlarged: 3 steps",
    (9, 500): "box, reduce and the bicubic blend along one axis",
}


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = fused.get_fused_backend()
    fused.set_fused_backend("triton")
    yield
    fused.set_fused_backend(before)


def _pixels(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES.values()))
def test_the_kernel_cuts_libvips_bytes(kernel, size) -> None:
    pixels = _pixels(*size)
    made = device_crops.make_crops(torch.from_numpy(pixels), crop_plan(*size, SMALL))
    want = overlap_crops(pixels, SMALL).crops
    assert made.shape == want.shape
    assert np.array_equal(made.numpy(), want), int((made.numpy() != want).sum())


def test_moondream_sized_crops_are_libvips_bytes(kernel) -> None:
    config = MoondreamConfig().vision
    pixels = _pixels(300, 420, seed=1)
    made = device_crops.make_crops(torch.from_numpy(pixels), crop_plan(300, 420, config))
    assert np.array_equal(made.numpy(), overlap_crops(pixels, config).crops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_encoder_input_is_the_torch_paths_and_goes_where_asked(kernel, dtype) -> None:
    for size in ((90, 130), (20, 200)):
        image, plan = torch.from_numpy(_pixels(*size, seed=2)), crop_plan(*size, SMALL)
        buffer = torch.full((plan.geometry.n_crops, 3, 56, 56), 7.0, dtype=dtype)
        got = device_crops.encoder_crops(image, plan, dtype, out=buffer)
        fused.set_fused_backend("torch")
        want = device_crops.encoder_crops(image, plan, dtype)
        fused.set_fused_backend("triton")
        assert got is buffer and got.dtype == dtype
        assert torch.equal(got, want), size
    with pytest.raises(ValueError, match="contiguous"):
        device_crops.encoder_crops(image, plan, dtype, out=buffer[:1])


def test_one_launch_per_step(kernel) -> None:
    """A new size: its tables and stage rows in one upload, then one launch per step; a seen
    size: the launches alone. Two steps where both axes shrink or both grow (a box shrink is
    fused into the reduce after it, a reduce into the blend after it), three where the rows
    shrink and the columns grow (reduce down, blend across, blend down)."""
    cases = (((90, 130), 2), ((230, 300), 2), ((1, 1), 2), ((20, 200), 2), ((200, 20), 3))
    for size, steps in cases:
        plan = crop_plan(*size, SMALL)
        assert len(kernel_plan(plan, *size).steps) == steps, size
        image = torch.from_numpy(_pixels(*size))
        device_crops._MATRICES.clear()
        device_crops.encoder_crops(image, plan, torch.bfloat16)  # the pixel table uploaded
        device_crops._MATRICES.pop(("stages", *size, plan.geometry, "cpu"))
        for uploads in (1, 0):  # a new size, then a seen one
            with LaunchCounter() as c:
                device_crops.encoder_crops(image, plan, torch.bfloat16)
            assert c.launches == c.by_op["triton_resample"] == steps, (size, uploads)
            assert (c.uploads_nonblocking, c.uploads_blocking, c.syncs) == (uploads, 0, 0)


def test_passes_along_one_axis_fuse_in_pairs() -> None:
    plan = crop_plan(9, 500, SMALL).whole  # box, reduce, bicubic across; bicubic down
    axes = [(p.axis, p.box > 0) for p in plan.passes]
    assert axes == [(1, True), (1, False), (1, False), (0, False)]
    stages = _stages(plan, 9)
    assert [(pre is not None, main.axis) for pre, main in stages] == [
        (True, 1), (False, 1), (False, 0)
    ]  # fmt: skip
    copy = _stages(crop_plan(56, 56, SMALL).whole, 56)  # no pass: rows copied, weight 1
    assert len(copy) == 1 and copy[0][1].weight.tolist() == [[4096]] * 56


@pytest.mark.parametrize("out_u8", [False, True], ids=["encoder-input", "uint8-crops"])
def test_the_kernel_builds_for_sm90(out_u8, tmp_path) -> None:
    code = (
        "import json, sys; from kestrel_kernels.triton_resample import sm90_build; "
        f"r = sm90_build(sys.argv[1], {out_u8}); print(json.dumps(r))"
    )
    (got,) = sm90_builds(code, tmp_path)
    assert_built(got, max_registers=192)


def test_what_waits_in_the_scratch_fits_int16() -> None:
    """A stage that hands its output to the next one (int16 scratch) writes values whose
    bound (the largest sum of |weights| over 255 levels, rounded as the kernel rounds, for a
    fused stage the first pass clipped to 0..255 first) fits int16, for every image size in a
    sweep of both geometries."""
    at = {name: i for i, name in enumerate(FIELDS)}
    for config, sides in ((SMALL, range(1, 400, 23)), (MoondreamConfig().vision,
                                                       range(1, 2200, 157))):  # fmt: skip
        for h in sides:
            for w in sides:
                kp = kernel_plan(crop_plan(h, w, config), h, w)
                rows = kp.array[kp.desc_at :].reshape(-1, len(FIELDS))
                for row in rows[rows[:, at["final"]] == 0]:
                    if row[at["n_out"]] == 0:
                        continue  # a job with no stage at this step
                    n, taps = int(row[at["n_out"]]), int(row[at["taps"]])
                    w_at = int(row[at["w_at"]])
                    weights = np.abs(kp.array[w_at : w_at + n * taps].reshape(n, taps))
                    top = 255 * int(weights.sum(axis=1).max()) + int(row[at["add"]])
                    bound = (top * int(row[at["mul"]])) >> int(row[at["shift"]])
                    assert bound < 2**15, ((h, w), bound)
