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

Then large images, decoded in full (as before ``images/shrink.py``) against shrunk on load to
what Moondream's crops use (``Engine.prepare_image`` now): a 12 MP JPEG (4000 x 3000) and a
49 MP PNG (7000 x 7000), photo-like. Besides ms per image, each variant's peak memory: the
growth of a fresh process's peak RSS over one call (``VmHWM``; ``ru_maxrss`` would carry the
parent's), the decode's buffers included (Pillow's and libvips' allocations are not seen by
``tracemalloc``). Linux only. ``--large-side
S`` scales both down (the test's smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import harness
import numpy as np
from chart_workload import chart_png
from PIL import Image

from kestrel import images
from kestrel.engine.intake import CropFit
from kestrel.images import prepare_image
from kestrel.images.known import KnownImages
from kestrel.moondream.config import VisionConfig

FIT = CropFit(VisionConfig())  # Moondream's crop geometry: 378-pixel crops, up to 12


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


def _pil_only() -> contextlib.AbstractContextManager[object]:
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


def large_inputs(side: int) -> dict[str, bytes]:
    """A 12 MP JPEG and a 49 MP PNG (at ``side`` 7000; scaled alike below it)."""
    rng = np.random.default_rng(1)
    out = {}
    kinds = (("12 MP JPEG", (3 * side // 7, 4 * side // 7), "JPEG", {"quality": 90}),
             ("49 MP PNG", (side, side), "PNG", {"compress_level": 6}))  # fmt: skip
    for name, (h, w), fmt, opts in kinds:
        coarse = rng.integers(0, 256, (h // 40 + 1, w // 40 + 1, 3), np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC))
        buf = io.BytesIO()
        Image.fromarray(smooth).save(buf, fmt, **opts)
        out[name] = buf.getvalue()
    return out


_PEAK = """
import re, sys
from pathlib import Path
sys.path.insert(0, {scripts!r})
from bench_images import FIT
from kestrel.images import prepare_image

def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

data = Path({path!r}).read_bytes()
before = hwm()
image = prepare_image(data, fit=FIT if {shrink} else None)
print((hwm() - before) / 1024)
"""


def peak_mb(data: bytes, shrink: bool) -> float:
    """The peak RSS growth of a fresh process over one ``prepare_image`` of ``data``, MB."""
    with tempfile.NamedTemporaryFile(suffix=".img") as f:
        f.write(data)
        f.flush()
        code = _PEAK.format(scripts=str(Path(__file__).parent), path=f.name, shrink=shrink)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"peak measurement failed:\n{out.stderr}")
    return float(out.stdout.split()[-1])


def large(bench: harness.Bench, args: argparse.Namespace) -> None:
    for name, data in large_inputs(args.large_side).items():
        full, shrunk = prepare_image(data), prepare_image(data, fit=FIT)
        bench.emit(f"\n{name}: {full.width} x {full.height} -> {shrunk.width} x "
                   f"{shrunk.height} on load, {len(data):,} bytes; peak RSS growth per "
                   f"image: full {peak_mb(data, False):.0f} MB, shrunk "
                   f"{peak_mb(data, True):.0f} MB")  # fmt: skip
        runs = bench.run({
            f"{name}: full decode": variant(data, args.large_repeats, False),
            f"{name}: shrink on load": variant(data, args.large_repeats, False,
                                               lambda d: prepare_image(d, fit=FIT)),
        })  # fmt: skip
        bench.table(runs, {"ms": "ms per image"}, baseline=f"{name}: full decode")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30, help="calls per figure (median)")
    p.add_argument("--large-repeats", type=int, default=5, help="calls per large figure")
    p.add_argument("--large-side", type=int, default=7000, help="the large PNG's side")
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
    large(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
