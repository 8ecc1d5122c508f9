"""Image crops beside a busy Python thread: the GIL stall, before and after the crop pool.

    python scripts/bench_crops.py [--size 960x1280] [--repeats 15] [--rounds 5] [--json]

One 1280 x 960 JPEG (generated; decoded and hashed as the Engine does) is cropped and
normalized for the vision encoder (9 crops, float32) by three variants, each timed from the
thread that waits for the result, the way the scheduler waits for it:

- ``before``: the code as it was (kept below): ``overlap_crops`` (two libvips resizes, then one
  array copy per local crop) and ``normalize_pixels`` (six torch ops), on a worker thread;
- ``pool``: ``CropPool.pixels`` as the runtime calls it: the crops are made in a worker process
  (``kestrel/crops/worker.py``) and the pool's thread only ships the pixels and waits;
- ``pool, threads``: the same pipeline made on the pool's thread itself (``processes=False``).

Each figure is the median over ``--repeats`` crops: ``quiet`` with nothing else running,
``busy`` while another Python thread of this process spins pure-Python code (every call that
lets the GIL go must win it back from that thread, about one 5 ms switch interval each).
``prefetched`` (the pool variants) is what the scheduler thread waits when the crops were
started earlier, as the Engine starts them at submission: ``hold``, 0.5 s, then ``pixels``.
Variants run interleaved through the harness (``harness.py``); median (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import io
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import harness
import numpy as np
import pyvips
import torch
from PIL import Image

from kestrel.crops.overlap import OverlapCrops, crop_geometry, select_tiling, vips_image
from kestrel.crops.pool import CropPool
from kestrel.images import PreparedImage, prepare_image
from kestrel.moondream.config import MoondreamConfig, VisionConfig

# ---------------------------------------------------------------- the crops as they were


def _legacy_resize(image: pyvips.Image, height: int, width: int) -> np.ndarray:
    resized = image.resize(width / image.width, vscale=height / image.height)
    return np.asarray(resized.numpy(), dtype=np.uint8).reshape(resized.height, resized.width, -1)


def _legacy_paste(dst: np.ndarray, src: np.ndarray) -> None:
    dst[: src.shape[0], : src.shape[1]] = src[: dst.shape[0], : dst.shape[1]]


def legacy_overlap_crops(
    image: np.ndarray, config: VisionConfig, *, max_crops: int | None = None
) -> OverlapCrops:
    """``overlap_crops`` before the crop pool (commit e2104be), verbatim but for names."""
    vips = vips_image(image)
    crop = config.crop_size
    margin_px = config.overlap_margin * config.enc_patch_size
    window = (config.grid_side - 2 * config.overlap_margin) * config.enc_patch_size
    rows, cols = select_tiling(
        vips.height - 2 * margin_px,
        vips.width - 2 * margin_px,
        window,
        config.max_crops if max_crops is None else max_crops,
    )
    crops = np.zeros((1 + rows * cols, crop, crop, 3), dtype=np.uint8)
    _legacy_paste(crops[0], _legacy_resize(vips, crop, crop))
    resized = _legacy_resize(vips, rows * window + 2 * margin_px, cols * window + 2 * margin_px)
    for i in range(rows):
        for j in range(cols):
            y0, x0 = i * window, j * window
            _legacy_paste(crops[1 + i * cols + j], resized[y0 : y0 + crop, x0 : x0 + crop])
    crops.flags.writeable = False
    return OverlapCrops(crops=crops, tiling=(rows, cols))


def legacy_normalize(crops_u8: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``normalize_pixels`` on the host, as it was."""
    x = torch.from_numpy(crops_u8.copy()).permute(0, 3, 1, 2)
    return x.to(torch.bfloat16).div(255.0).sub(0.5).div(0.5).to(dtype).contiguous()


# ---------------------------------------------------------------- the measurement


def jpeg_image(height: int, width: int, seed: int = 0) -> PreparedImage:
    """A photo-like picture (smooth colour fields, edges and noise), JPEG-encoded, decoded."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([np.sin(x / 97 + c) * np.cos(y / 61 - c) for c in (0.0, 1.3, 2.6)], -1)
    pixels = (base * 90 + 128 + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return prepare_image(buf.getvalue())


class Spinner:
    """Another Python thread of this process running pure-Python code while active."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            for _ in range(1000):
                n += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def variant(crop: Callable[[], object], repeats: int) -> Callable[[], dict]:
    """One crop's time, quiet and beside the spinning thread."""

    def run() -> dict[str, float]:
        crop()  # warm (a worker process starts on the first call)
        out = {"quiet_ms": median_ms(crop, repeats)}
        with Spinner():
            out["busy_ms"] = median_ms(crop, repeats)
        return out

    return run


def prefetched_wait_ms(pool: CropPool, image: PreparedImage) -> float:
    """What ``pixels`` waits for crops started 0.5 s earlier (``hold``, as the Engine does)."""
    with pool.hold([image]):
        time.sleep(0.5)
        t0 = time.perf_counter()
        pool.pixels(image)
        return 1e3 * (time.perf_counter() - t0)


def pool_variant(pool: CropPool, image: PreparedImage, repeats: int) -> Callable[[], dict]:
    def run() -> dict[str, float]:
        out = variant(lambda: pool.pixels(image), repeats)()
        with Spinner():
            waits = [prefetched_wait_ms(pool, image) for _ in range(max(3, repeats // 3))]
        return {**out, "prefetched_busy_ms": statistics.median(waits)}

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="960x1280", help="image height x width")
    p.add_argument("--repeats", type=int, default=15, help="crops per figure (median)")
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))
    config = MoondreamConfig().vision  # Moondream 2's crop geometry
    image = jpeg_image(height, width)
    before = ThreadPoolExecutor(1, thread_name_prefix="before")

    def legacy() -> torch.Tensor:
        crops = legacy_overlap_crops(image.pixels, config)
        return legacy_normalize(crops.crops, torch.float32)

    pool = CropPool(config, recent=0)
    threads = CropPool(config, recent=0, processes=False)
    expected = legacy()
    for name, got in (("pool", pool.pixels(image)), ("pool, threads", threads.pixels(image))):
        if not torch.equal(got.encoder_input(torch.float32, "cpu"), expected):
            raise SystemExit(f"{name}: the crops differ from the code as it was")
    bench = harness.start(args, "Image crops beside a busy Python thread (bench_crops.py)")
    n_crops = crop_geometry(height, width, config).n_crops
    bench.emit(
        f"{width} x {height} JPEG, {n_crops} crops float32; "
        f"{args.repeats} crops per figure; crop workers in processes: {pool.uses_processes}"
    )
    runs = bench.run({
        "before": variant(lambda: before.submit(legacy).result(), args.repeats),
        "pool": pool_variant(pool, image, args.repeats),
        "pool, threads": pool_variant(threads, image, args.repeats),
    })  # fmt: skip
    metrics = {"busy_ms": "busy ms", "quiet_ms": "quiet ms"}
    bench.table(runs, metrics, baseline="before", fmt=".1f")
    bench.table({k: v for k, v in runs.items() if k != "before"},
                {"prefetched_busy_ms": "prefetched, busy: wait ms"}, fmt=".2f")  # fmt: skip
    before.shutdown()
    pool.close()
    threads.close()
    bench.finish()


if __name__ == "__main__":
    main()
