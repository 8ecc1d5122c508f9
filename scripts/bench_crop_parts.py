"""One image's crops made in 1, 2, 4 ... parts at once: the wall time of a lone request's crops.

    python scripts/bench_crop_parts.py [--parts 1,2,4] [--size 960x1280] [--repeats 15] [--json]

At batch 1 nothing else runs beside a request's crops, so ``CropPool`` splits one image into
``parallel`` parts (``crops.crop_parts``: the global crop and bands of the resized copy,
balanced by work), each made by a worker process at once with the cores over ``parallel``
libvips threads. The variants: ``serial`` (one worker, one libvips thread), ``1 part, libvips
threads`` (one worker, libvips threading the image across every core: the other way to use
the cores) and ``n parts`` (``n`` workers at once, the pool's default threads), each timed
through ``CropPool.pixels`` as the runtime calls it, with the pinned staging a CUDA model uses
when CUDA is there. uint8 crops (a CUDA model's). Variants run interleaved through the harness;
each figure is the median over ``--repeats`` images, and the table gives each against serial.
The crops of every variant are checked equal first. ``scripts/gpu_check.sh`` runs it on the
GPU machine's cores.

``--device cuda`` (or ``cpu``) times each variant up to the encoder's input on that device
(``CropPixels.encoder_input``: the upload and normalization, synchronized) and adds ``on the
device``: the image itself staged and cropped there (``crops/device.py``, a CUDA runtime's
default), the same bytes: by the Triton resample kernel where the fused ops are Triton's, and
then also ``on the device, matrix products`` (the torch path: the fused ops set to "torch"
while it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import harness
import numpy as np
import torch

from kestrel.crops.overlap import crop_geometry
from kestrel.crops.pool import CropPool
from kestrel.images import PreparedImage, prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel_kernels import fused


def images(height: int, width: int, count: int) -> list[PreparedImage]:
    rng = np.random.default_rng(0)
    return [prepare_image(rng.integers(0, 256, (height, width, 3), np.uint8)) for _ in range(count)]


def made(pool: CropPool, image: PreparedImage, device: str | None) -> torch.Tensor:
    """``image``'s crops from ``pool``: on the host, or the encoder's input on ``device``."""
    crops = pool.pixels(image)
    if device is None:
        return crops.pixels
    out = crops.encoder_input(torch.bfloat16, device)
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return out


@contextlib.contextmanager
def fused_as(backend: str | None) -> Iterator[None]:
    """The fused ops' backend meanwhile (None: as it is): on a device it picks the way the
    crops are cut there, the Triton kernel ("auto" on CUDA) or the matrix products ("torch")."""
    before = fused.get_fused_backend()
    if backend is not None:
        fused.set_fused_backend(backend)
    try:
        yield
    finally:
        fused.set_fused_backend(before)


def variant(
    pool: CropPool, shots: list[PreparedImage], device: str | None, backend: str | None = None
) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        times = []
        with fused_as(backend):
            for image in shots:
                t = time.perf_counter()
                crops = made(pool, image, device)
                times.append(time.perf_counter() - t)
                del crops  # its staging slot back
        return {"ms": statistics.median(times) * 1e3}

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="2,4", help="parts per image to compare with serial")
    p.add_argument("--size", default="960x1280", help="image height x width")
    p.add_argument("--repeats", type=int, default=15, help="images per figure (median)")
    p.add_argument("--device", default=None, help="time up to the encoder's input there")
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [n for n in (int(v) for v in args.parts.split(",")) if n <= max(1, cores or 1)]
    config = MoondreamConfig().vision
    pin = torch.cuda.is_available()
    if args.device == "cuda" and not pin:
        print("no CUDA here: the host variants alone, up to the host's crops")
        args.device = None

    def pool(n: int, threads: int | None = None) -> CropPool:
        return CropPool(config, normalize=False, pin_memory=pin, workers=n, parallel=n,
                        threads=threads)  # fmt: skip

    pools = {"serial": pool(1, threads=1)}
    if (cores or 1) > 1:
        pools["1 part, libvips threads"] = pool(1)
    pools |= {f"{n} parts": pool(n) for n in parts if n > 1}
    backends: dict[str, str] = {}
    if args.device is not None:
        pools["on the device"] = CropPool(config, normalize=False, pin_memory=pin, on_device=True)
        if fused.fused_backend(torch.device(args.device)) == "triton":  # the kernel; and:
            pools["on the device, matrix products"] = pools["on the device"]
            backends["on the device, matrix products"] = "torch"
    shots = images(height, width, args.repeats)
    want = None
    for name, pooled in pools.items():  # start the workers; every variant makes the same crops
        with fused_as(backends.get(name)):
            got = [made(pooled, image, args.device).clone() for image in shots[:2]]
        want = want or got
        if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
            raise SystemExit(f"{name}: the crops differ from serial")
    bench = harness.start(args, "One image's crops in parts (bench_crop_parts.py)")
    g = crop_geometry(height, width, config)
    bench.emit(f"{width} x {height}: {g.n_crops} crops uint8, {cores} cores, staging: {pin}; "
               f"worker processes: {next(iter(pools.values())).uses_processes}")  # fmt: skip
    runs = bench.run({name: variant(pooled, shots, args.device, backends.get(name))
                      for name, pooled in pools.items()})  # fmt: skip
    bench.table(runs, {"ms": "ms per image"}, baseline="serial", fmt=".2f")
    for pooled in set(pools.values()):
        pooled.close()
    bench.finish()


if __name__ == "__main__":
    main()
