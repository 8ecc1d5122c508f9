"""Decoding and hashing an encoded image on the caller's thread: PIL alone against libvips.

    python scripts/bench_images.py [--repeats 30] [--rounds 5] [--json]

Every request that brings an image decodes and hashes it on the caller's thread before it is
queued (``prepare_image``); at batch 1 that time adds to every answer. Three inputs: a chart
PNG like the GPU bench's (``chart_workload.chart_png``: 640-900 x 480-640), the same chart as a
JPEG, and a 1280 x 960 photo-like JPEG. Two variants, run interleaved through the harness:

- ``PIL``: every decode through PIL, as before ``kestrel/images/vips.py``;
- ``prepare_image``: as it is now (libvips decodes the kinds it decodes to PIL's pixels);
- ``sent again``: the same bytes through an Engine's ``KnownImages`` that prepared them before
  (a chart's next question, a conversation's next turn): their digest, no decode.

Each figure is the median over ``--repeats`` calls, milliseconds, SHA-256 included. Both
variants are checked to give the same pixels first.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from collections.abc import Callable
from unittest import mock

import harness
import numpy as np
from chart_workload import chart_png
from PIL import Image

from kestrel import images
from kestrel.images import prepare_image
from kestrel.images.known import KnownImages


def _jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def inputs() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    chart = chart_png(rng)
    with Image.open(io.BytesIO(chart)) as image:
        chart_pixels = np.asarray(image.convert("RGB"))
    noise = rng.integers(0, 256, (960, 1280, 3), np.uint8)
    photo = (np.cumsum(noise, axis=1) // 8 % 256).astype(np.uint8)  # smooth-ish gradients
    return {"chart PNG": chart, "chart JPEG": _jpeg(chart_pixels), "1280x960 JPEG": _jpeg(photo)}


def _pil_only() -> mock._patch:
    return mock.patch.object(images, "decode_pixels", lambda image, source: None)


def variant(
    data: bytes, repeats: int, pil: bool, prepare: Callable[[bytes], object] = prepare_image
) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        times = []
        with _pil_only() if pil else contextlib.nullcontext():
            prepare(data)  # warm
            for _ in range(repeats):
                t = time.perf_counter()
                prepare(data)
                times.append(time.perf_counter() - t)
        return {"ms": statistics.median(times) * 1e3}

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30, help="calls per figure (median)")
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    files = inputs()
    for name, data in files.items():
        with _pil_only():
            want = prepare_image(data)
        if prepare_image(data).digest != want.digest:
            raise SystemExit(f"{name}: libvips and PIL decode different pixels")
        known = KnownImages()
        if [known.prepare(data).digest for _ in range(2)] != [want.digest] * 2:
            raise SystemExit(f"{name}: the image sent again has another digest")
    bench = harness.start(args, "Image decode + hash on the caller's thread (bench_images.py)")
    for name, data in files.items():
        with Image.open(io.BytesIO(data)) as image:
            bench.emit(f"\n{name}: {image.width} x {image.height}, {len(data):,} bytes")
        runs = bench.run({
            f"{name}: PIL": variant(data, args.repeats, pil=True),
            f"{name}: prepare_image": variant(data, args.repeats, pil=False),
            f"{name}: sent again": variant(data, args.repeats, False, KnownImages().prepare),
        })  # fmt: skip
        bench.table(runs, {"ms": "ms per image"}, baseline=f"{name}: PIL")
    bench.finish()


if __name__ == "__main__":
    main()
