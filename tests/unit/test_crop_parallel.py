"""One image's crops made in parts at once (bands of the upscaled copy, one worker each) equal
the crops made in one piece; the pinned staging the crops of a CUDA model go through is taken
once and reused."""

from __future__ import annotations

import gc
import itertools
import statistics
import time

import numpy as np
import pytest
import torch

from kestrel.images import PreparedImage, prepare_image
from kestrel.moondream import crops as crops_mod
from kestrel.moondream.config import MoondreamConfig
from kestrel.runtime import crop_staging
from kestrel.runtime.crop_pool import CropPool

VISION = MoondreamConfig().vision  # Moondream 2's geometry: 378-pixel crops, up to 12
SIZES = [(960, 1280), (378, 378), (1, 1), (1, 700), (2000, 500), (733, 1111), (379, 1000)]


def _image(h: int, w: int, seed: int = 0) -> PreparedImage:
    return prepare_image(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_parts_make_exactly_the_whole(n: int) -> None:
    table = crops_mod.lut_image(np.linspace(-1, 1, 256, dtype=np.float32))
    for i, (h, w) in enumerate(SIZES):
        pixels = _image(h, w, i).pixels
        g = crops_mod.crop_geometry(h, w, VISION)
        parts = crops_mod.crop_parts(g, n, h * w)
        assert 1 <= len(parts) <= n and sum(p.whole for p in parts) == 1
        edges = [(p.top, p.bottom) for p in parts if p.bottom > p.top]
        assert edges[0][0] == 0 and edges[-1][1] == g.resized[0]  # the rows, each once
        assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        for lut, dtype in ((None, np.uint8), (table, np.float32)):
            whole = np.empty((g.n_crops, 3, g.crop, g.crop), dtype)
            crops_mod.write_planes(crops_mod.vips_image(pixels), g, whole, lut)
            pieced = np.full_like(whole, 7)
            for part in parts:
                crops_mod.write_planes(crops_mod.vips_image(pixels), g, pieced, lut, part)
            assert np.array_equal(pieced, whole), (h, w, n, dtype)


def _timed(pool: CropPool, image: PreparedImage) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    crops = pool.pixels(image)
    took = time.perf_counter() - t  # the crops alone: not the test's copy of them
    return took, crops.pixels.clone()


@pytest.mark.parametrize("processes", [True, False], ids=["worker-process", "pool-thread"])
def test_one_image_in_parallel_equals_serial(processes: bool) -> None:
    """A 1280 x 960 image (a global crop and 3 x 3 local ones) made serially and in two parts
    at once: the same crops. Both wall times are printed, measured alternately image by image
    after both pools are warm (a pool measured first, cold, looks slower than it is); the
    target is parallel <= 0.6 x serial on an idle machine; the ratio is not asserted
    (``scripts/bench_crop_parts.py`` measures it through the harness)."""
    images = [_image(960, 1280, seed) for seed in range(5)]
    serial = CropPool(VISION, workers=1, parallel=1, normalize=False, processes=processes)
    parallel = CropPool(VISION, workers=2, parallel=2, normalize=False, processes=processes)
    times: dict[str, list[float]] = {"serial": [], "parallel": []}
    try:
        for pool in (serial, parallel):  # start the worker processes outside the timing
            for seed in (98, 99):
                pool.pixels(_image(960, 1280, seed))
        for _ in range(3):
            for image in images:
                t_serial, want = _timed(serial, image)
                t_parallel, got = _timed(parallel, image)
                assert want.shape == (10, 3, 378, 378) and torch.equal(want, got)
                times["serial"].append(t_serial)
                times["parallel"].append(t_parallel)
    finally:
        serial.close()
        parallel.close()
    t_serial, t_parallel = (statistics.median(times[k]) for k in ("serial", "parallel"))
    print(f"\n1280x960 crops ({'processes' if processes else 'threads'}): serial "
          f"{t_serial * 1e3:.1f} ms, 2 parts {t_parallel * 1e3:.1f} ms, "
          f"ratio {t_parallel / t_serial:.2f}")  # fmt: skip


def test_staging_is_taken_once_and_reused(monkeypatch) -> None:
    pinned_calls: list[int] = []

    def stand_in(nbytes: int) -> torch.Tensor:  # plain memory standing in for pinned
        pinned_calls.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", stand_in)
    pool = CropPool(VISION, normalize=False, pin_memory=True, prefetch=1, workers=1)
    staging = pool._cropper.staging
    assert staging is not None and staging.count == 1 + 1 + 2
    assert pinned_calls == [staging.count * 13 * 3 * 378 * 378]
    try:
        images = [_image(600, 800, seed) for seed in range(3)]
        want = [pool.pixels(im).pixels.clone() for im in images]  # each dropped: slot back
        held = [pool.pixels(im) for im in images + images[:1]]  # 4 slots, all held
        assert [h.staging is not None for h in held] == [True] * 4
        assert len({h.staging[1] for h in held if h.staging}) == 4
        extra = pool.pixels(images[1])  # none free: plain memory, same crops
        assert extra.staging is None and staging.misses == 1
        assert torch.equal(extra.pixels, want[1])
        for h, w in zip(held, want + want[:1], strict=True):
            assert torch.equal(h.pixels, w)
            assert torch.equal(
                h.encoder_input(torch.float32, "cpu"),
                crop_staging.normalize_pixels(w.permute(0, 2, 3, 1), torch.float32, "cpu"),
            )
        del held, h
        gc.collect()
        assert pool.pixels(images[2]).staging is not None  # slots came back
        assert len(pinned_calls) == 1  # never pinned again
    finally:
        pool.close()
    with pytest.raises(ValueError, match="uint8"):
        CropPool(VISION, normalize=True, pin_memory=True)


def test_staging_made_in_inference_mode_is_written_outside_it(monkeypatch) -> None:
    """The runtime is built under ``torch.inference_mode`` (the engine's start-up) while crop
    threads and direct callers write the staging memory outside it: the memory must be a
    normal tensor, or the first staged image raises (seen on an H200)."""
    plain = crop_staging.pinned.host_empty  # the pinned allocation, less the page-locking
    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", lambda n: plain(n, pin=False))
    with torch.inference_mode():
        staging = crop_staging.CropStaging(VISION, 2)
    assert not staging._memory.is_inference()
    planes = torch.randint(0, 256, (3, 3, 378, 378), dtype=torch.uint8)
    staged = staging.stage(planes, (1, 2))  # outside inference mode, as a crop thread runs
    assert staged.staging is not None and torch.equal(staged.pixels, planes)
    with torch.inference_mode():  # and inside it, as the scheduler thread runs
        again = staging.stage(planes.flip(0), (1, 2))
    assert again.staging is not None and torch.equal(again.pixels, planes.flip(0))
