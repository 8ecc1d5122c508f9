"""Cropper: one image's crops, made by worker processes, on part threads, or on the device.

What ``CropPool`` (``pool.py``) runs for each image: the crops of ``overlap.py`` in parts
(``overlap.crop_parts``), sent together to as many worker processes (``procs.py``) through
shared memory (``arenas.py``), else made on part threads here; staged in pinned memory
for a CUDA model (``staging.py``). Where the encoder's device makes the crops itself
(``on_device``; ``crops_on_device`` decides at start-up) the image is staged instead and
``device.encoder_crops`` cuts it on the device: the same bytes, no host work but a copy.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np
import torch

from kestrel.crops.arenas import ARENAS, Arena, one_off
from kestrel.crops.device import device_disagrees
from kestrel.crops.overlap import (
    CropGeometry,
    CropPart,
    check_pixels,
    crop_geometry,
    crop_parts,
    lut_image,
    vips_image,
    write_crops,
)
from kestrel.crops.procs import WORKERS, CropWorkerError, WorkerGone, processes_supported
from kestrel.crops.resample import crop_plan
from kestrel.crops.staging import CropPixels, CropStaging
from kestrel.images import PreparedImage
from kestrel.moondream.config import VisionConfig
from kestrel.moondream.vision import pixel_table

__all__ = ["Cropper", "crops_on_device"]

log = logging.getLogger("kestrel.runtime")
_MAX_FAILURES = 3  # worker processes that fail in a row before a cropper stops using them


def crops_on_device(
    config: VisionConfig, device: torch.device, pins: bool, wanted: bool | None
) -> bool:
    """Whether the encoder's device makes the crops: asked for (``wanted``), or by default
    where the host stages pinned memory (CUDA), and its bytes equal this process's libvips on
    the probe images (``device.device_disagrees``; if not, it says why in the log)."""
    if not (pins if wanted is None else wanted):
        return False
    why = device_disagrees(config, device)
    if why is not None:
        log.warning("crops are made on the host: %s", why)
    else:
        log.info("crops are made on %s (libvips' bytes on every probe image)", device)
    return why is None


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class Cropper:
    """Makes one image's crops in ``parallel`` parts at once (``crops.crop_parts``), each in a
    worker process (all sent before any reply is awaited) or, failing that, on a part thread
    here; stages them when ``staging`` is set."""

    def __init__(
        self,
        config: VisionConfig,
        normalize: bool,
        processes: bool,
        parallel: int,
        staging: CropStaging | None,
        threads: int,
        on_device: bool = False,
    ) -> None:
        self.config = config
        self.on_device = on_device
        self.normalize, self.staging, self.parallel = normalize, staging, parallel
        self.threads = threads
        self.processes = processes and processes_supported()
        self.failures = 0
        self.table = pixel_table() if normalize else None
        self._parts = (
            ThreadPoolExecutor(parallel - 1, thread_name_prefix="kestrel-crops-part")
            if parallel > 1
            else None
        )

    def crop(self, image: PreparedImage, lone: bool = True) -> CropPixels:
        """``image``'s crops: on the device when it makes them and ``lone`` (no other image's
        crops in the making), else here (worker processes, part threads)."""
        pixels = check_pixels(image.pixels)
        if self.on_device and lone:
            staged = self._for_device(pixels, image.plan_size)
            if staged is not None:
                return staged
        # planned for the picture as sent: a reduced decode (images/shrink.py) keeps its grid
        g = crop_geometry(*image.plan_size, self.config)
        parts = crop_parts(g, self.parallel, pixels.shape[:2])
        made = self._in_worker(pixels, g, parts) if self.processes else None
        if made is not None:
            return made
        crops_hwc = self._here(pixels, g, parts)
        if self.staging is not None:
            return self.staging.stage(crops_hwc, (g.rows, g.cols))
        return CropPixels(crops_hwc, (g.rows, g.cols))

    def _for_device(self, pixels: np.ndarray, size: tuple[int, int]) -> CropPixels | None:
        """The image itself, staged for crops on the device (``device.py``); None
        for an image larger than a staging slot (~1.86 million pixels; its crops are smaller)."""
        plan = crop_plan(pixels.shape[0], pixels.shape[1], self.config, size)
        if self.staging is None:  # a device that takes plain memory (a CPU: tests)
            return CropPixels(torch.from_numpy(pixels.copy()), plan.tiling, plan=plan)
        if not self.staging.fits(pixels):
            return None
        return self.staging.stage(pixels, plan.tiling, plan)

    def close(self) -> None:
        if self._parts is not None:
            self._parts.shutdown(wait=False, cancel_futures=True)

    def _each(self, fn: Callable[[CropPart], None], parts: list[CropPart]) -> None:
        """``fn(part)`` for every part at once: the first on this thread, the others on the
        part threads (here, once those are closed); waits for all, raises the first error."""
        futures: list[Future | None] = []
        for part in parts[1:]:
            try:
                futures.append(self._parts.submit(fn, part) if self._parts else None)
            except RuntimeError:  # closed
                futures.append(None)
        errors: list[BaseException] = []
        for part, future in zip(parts, [None, *futures], strict=True):
            try:
                if future is None or future.cancelled():
                    fn(part)
                else:
                    try:
                        future.result()
                    except CancelledError:
                        fn(part)
            except BaseException as exc:  # every part ends before the memory is let go
                errors.append(exc)
        if errors:
            raise errors[0]

    def _dtypes(self) -> tuple[np.dtype, torch.dtype]:
        if self.normalize:
            return np.dtype(np.float32), torch.float32
        return np.dtype(np.uint8), torch.uint8

    def _in_worker(
        self, pixels: np.ndarray, g: CropGeometry, parts: list[CropPart]
    ) -> CropPixels | None:
        """The crops made by worker processes; None if they could not (then made here)."""
        try:
            crops_hwc = self._shipped(pixels, g, parts)
        except (WorkerGone, CropWorkerError, OSError) as exc:  # no worker, a worker failed
            self.failures += 1  # (its libvips, its pyvips), or no shared memory to give it
            if self.failures >= _MAX_FAILURES:
                self.processes = False
            log.warning("crops made in-process: %s", exc)
            return None
        self.failures = 0
        return crops_hwc

    def _shipped(self, pixels: np.ndarray, g: CropGeometry, parts: list[CropPart]) -> CropPixels:
        """The worker processes make the crops in shared memory: in a reused arena
        (``arenas.py``), copied into pinned staging where there is some, else lent with
        the crops (``_handed_out``), or, when no arena is free, in a file of this image's own,
        which they stay in. A fresh file's pages cost more than a copy, float32 crops' too: a
        1280 x 960 image's took 17 ms through a file of their own, 8 ms through an arena and a
        copy (2 cores)."""
        n_in, np_dtype = pixels.size, self._dtypes()[0]
        count = g.n_crops * 3 * g.crop * g.crop
        out_at = _aligned(n_in)
        size = out_at + count * np_dtype.itemsize
        arena = ARENAS.take(size)
        shared = arena if arena is not None else one_off(size)
        lent = False
        try:
            np.frombuffer(shared.memory, np.uint8, count=n_in)[:] = pixels.reshape(-1)
            head = {"size": shared.size, "height": pixels.shape[0], "width": pixels.shape[1],
                    "out": out_at, "geometry": _fields(g), "threads": self.threads}  # fmt: skip
            if arena is not None:
                head["arena"] = list(arena.key)
            table = self.table.tobytes() if self.table is not None else b""
            key = None if arena is None else arena.key

            shares = core_shares(len(parts))

            def job(i: int, part: CropPart) -> tuple[bytes, int, tuple[int, int] | None]:
                spec = {**head, "part": [part.whole, part.top, part.bottom]}
                if shares is not None:
                    spec["cpus"] = shares[i]
                return json.dumps(spec).encode() + b"\n" + table, shared.fd, key

            WORKERS.run_all([job(*p) for p in enumerate(parts)])  # at once, none on a thread
            crops, lent = self._handed_out(shared, arena is not None, g, out_at)
            return crops
        finally:
            if arena is None:
                os.close(shared.fd)  # the mapping lives on in the crops' tensor
            elif not lent:
                ARENAS.give(arena)

    def _handed_out(
        self, shared: Arena, borrowed: bool, g: CropGeometry, out_at: int
    ) -> tuple[CropPixels, bool]:
        """The crops the workers wrote at ``out_at`` in ``shared``, as handed out, and whether
        the arena went with them: copied into pinned staging where a slot is free, else left
        where they are. A ``borrowed`` arena is then lent with them: given back when the last
        tensor over its memory is gone (the memoryview that memory is read through lives as
        long as any tensor or view of it), not copied out (a CPU model's float32 crops of a
        1280 x 960 image are 17 MB)."""
        np_dtype, dtype = self._dtypes()
        nbytes = g.n_crops * 3 * g.crop * g.crop * np_dtype.itemsize
        memory = memoryview(shared.memory)[out_at : out_at + nbytes]
        crops_hwc = torch.frombuffer(memory, dtype=dtype).view(g.n_crops, g.crop, g.crop, 3)
        tiling = (g.rows, g.cols)
        if self.staging is not None:
            crops = self.staging.stage(crops_hwc, tiling)
            if crops.staging is not None:
                return crops, False
        if borrowed:
            weakref.finalize(memory, ARENAS.give, shared)
        return CropPixels(crops_hwc, tiling), borrowed

    def _here(self, pixels: np.ndarray, g: CropGeometry, parts: list[CropPart]) -> torch.Tensor:
        np_dtype, _ = self._dtypes()
        out = np.empty((g.n_crops, g.crop, g.crop, 3), np_dtype)
        lut = lut_image(self.table) if self.table is not None else None
        image = vips_image(pixels)  # libvips images are immutable: the parts share it
        self._each(lambda part: write_crops(image, g, out, lut, part), parts)
        return torch.from_numpy(out)


def core_shares(n: int) -> list[list[int]] | None:
    """The cores this process may run on, dealt out to ``n`` parts of one image in contiguous
    shares (each part's worker runs on its own share: ``worker._Cores``); None for one
    part, or more parts than cores (then the kernel places them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if n < 2 or len(cores) < n:
        return None
    return [cores[i * len(cores) // n : (i + 1) * len(cores) // n] for i in range(n)]


def _fields(g: CropGeometry) -> dict[str, int]:
    return {"crop": g.crop, "margin": g.margin, "window": g.window, "rows": g.rows,
            "cols": g.cols}  # fmt: skip
