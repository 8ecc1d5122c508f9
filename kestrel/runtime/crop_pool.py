"""CropPool: an image's crops made off the scheduler thread, started when a request is submitted.

The crops and their normalization (``moondream/crops.py``, ``vision.normalize_pixels``) cost
some milliseconds of host work per new image. Made on the scheduler thread they stall every
running sequence; made on a plain worker thread they stall on the GIL: every libvips, numpy or
torch call that lets the GIL go has to win it back from the process's busy Python threads,
about one switch interval (5 ms) each time. So the pool hands each image to a crop worker
process (``crop_worker.py``, started by ``crop_procs.py``) through shared memory: its threads
only copy the pixels in, send one message and wait for the reply; the result is a tensor over
that shared memory, or, for a CUDA model, copied once into pinned staging taken at start-up
(whose upload then needs no host sync: ``crop_staging.py``) out of one of the process's
reused shared-memory arenas (``crop_arenas.py``: no fresh pages to allocate per image). The
crops are channels last, as libvips makes them (the device reorders them for free). A lone
image's crops spread over the host's cores: split into parts (bands of the resized copy) sent
together to as many worker processes, each part made on its share of libvips threads.

- ``hold(images)``: the Engine calls it on the caller's thread when it submits a request; the
  crops start at once (up to ``prefetch`` images not yet taken; more wait their turn, first
  come first served) and are shared by every request holding the same image. ``skip_recent``:
  an image the runtime encoded lately is most likely a prefix-cache hit and needs no crops.
- ``pixels(image)``: the runtime, on the scheduler thread, takes the crops of an image its
  prefill encodes: it only waits for them (starting them now if nobody did).

Without ``os.memfd_create`` (not Linux), or if the worker process cannot run, the pool's
threads make the crops themselves: the same results, off the scheduler thread, GIL stalls and
all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kestrel.images import PreparedImage
from kestrel.moondream.config import VisionConfig
from kestrel.moondream.crops import (
    CropGeometry,
    CropPart,
    check_pixels,
    crop_geometry,
    crop_parts,
    lut_image,
    vips_image,
    write_crops,
)
from kestrel.moondream.vision import pixel_table
from kestrel.runtime.crop_arenas import ARENAS, one_off
from kestrel.runtime.crop_procs import WORKERS, CropWorkerError, WorkerGone, processes_supported
from kestrel.runtime.crop_staging import CropPixels, CropStaging

__all__ = ["CropHold", "CropPixels", "CropPool", "processes_supported", "start_workers"]

log = logging.getLogger("kestrel.runtime")
_MAX_FAILURES = 3  # worker processes that die in a row before a pool stops starting them
_WORKERS = WORKERS  # the process's crop workers (tests stop them)


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _sizes(workers: int | None, parallel: int | None) -> tuple[int, int]:
    """A pool's threads and parts per image: as given, else by the cores (``CropPool``)."""
    workers = workers or max(2, min(4, _cores() // 4))
    return workers, parallel or max(1, min(workers, _cores() // 4))


def start_workers(
    workers: int | None = None, parallel: int | None = None
) -> threading.Thread | None:
    """Start, on a thread of its own (returned; None without worker processes), the worker
    processes a pool of these sizes keeps busy (``workers`` x ``parallel``), so no request
    waits for one to start (~80 ms of imports each: a first image's crops took ~100 ms
    instead of ~20 here). The Engine calls it before it loads a model for CUDA, whose start-up
    (weights, measured kernels, captured graphs) takes seconds. Not for a CPU model: there the
    imports would compete for the cores with the loading itself (kestrel-tiny's start took
    ~220 ms instead of ~30 on 2 cores), and the workers start with the first image instead."""
    if not processes_supported():
        return None
    count = math.prod(_sizes(workers, parallel))
    thread = threading.Thread(target=WORKERS.ensure, args=(count,), daemon=True,
                              name="kestrel-crops-start")  # fmt: skip
    thread.start()
    return thread


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class _Cropper:
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
    ) -> None:
        self.config = config
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

    def crop(self, image: PreparedImage) -> CropPixels:
        pixels = check_pixels(image.pixels)
        g = crop_geometry(pixels.shape[0], pixels.shape[1], self.config)
        parts = crop_parts(g, self.parallel, pixels.shape[:2])
        made = self._in_worker(pixels, g, parts) if self.processes else None
        if made is not None:
            return made
        crops_hwc = self._here(pixels, g, parts)
        if self.staging is not None:
            return self.staging.stage(crops_hwc, (g.rows, g.cols))
        return CropPixels(crops_hwc, (g.rows, g.cols))

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
        (``crop_arenas.py``) they are copied out of (into pinned staging where there is some),
        or, when no arena is free, in a file of this image's own, which they stay in. A fresh
        file's pages cost more than the copy, float32 crops' too: a 1280 x 960 image's took
        17 ms through a file of their own, 8 ms through an arena and a copy (2 cores)."""
        n_in, (np_dtype, dtype) = pixels.size, self._dtypes()
        count = g.n_crops * 3 * g.crop * g.crop
        out_at = _aligned(n_in)
        size = out_at + count * np_dtype.itemsize
        arena = ARENAS.take(size)
        shared = arena if arena is not None else one_off(size)
        try:
            np.frombuffer(shared.memory, np.uint8, count=n_in)[:] = pixels.reshape(-1)
            head = {"size": shared.size, "height": pixels.shape[0], "width": pixels.shape[1],
                    "out": out_at, "geometry": _fields(g), "threads": self.threads}  # fmt: skip
            if arena is not None:
                head["arena"] = list(arena.key)
            table = self.table.tobytes() if self.table is not None else b""
            key = None if arena is None else arena.key

            def job(part: CropPart) -> tuple[bytes, int, tuple[int, int] | None]:
                spec = {**head, "part": [part.whole, part.top, part.bottom]}
                return json.dumps(spec).encode() + b"\n" + table, shared.fd, key

            WORKERS.run_all([job(part) for part in parts])  # all at once, none on a thread
            crops_hwc = torch.frombuffer(shared.memory, dtype=dtype, count=count, offset=out_at)
            return self._kept(crops_hwc.view(g.n_crops, g.crop, g.crop, 3), g, arena is not None)
        finally:
            if arena is not None:
                ARENAS.give(arena)
            else:
                os.close(shared.fd)  # the mapping lives on in the crops' tensor

    def _kept(self, crops_hwc: torch.Tensor, g: CropGeometry, borrowed: bool) -> CropPixels:
        """``crops_hwc`` as the crops handed out: staged, or as they are, or (``borrowed``: in
        memory that is reused) copied when no staging slot is free."""
        tiling = (g.rows, g.cols)
        crops = self.staging.stage(crops_hwc, tiling) if self.staging is not None else None
        if crops is not None and (crops.staging is not None or not borrowed):
            return crops
        return CropPixels(crops_hwc.clone() if borrowed else crops_hwc, tiling)

    def _here(self, pixels: np.ndarray, g: CropGeometry, parts: list[CropPart]) -> torch.Tensor:
        np_dtype, _ = self._dtypes()
        out = np.empty((g.n_crops, g.crop, g.crop, 3), np_dtype)
        lut = lut_image(self.table) if self.table is not None else None
        image = vips_image(pixels)  # libvips images are immutable: the parts share it
        self._each(lambda part: write_crops(image, g, out, lut, part), parts)
        return torch.from_numpy(out)


def _fields(g: CropGeometry) -> dict[str, int]:
    return {"crop": g.crop, "margin": g.margin, "window": g.window, "rows": g.rows,
            "cols": g.cols}  # fmt: skip


@dataclass(slots=True, eq=False)
class _Entry:
    image: PreparedImage
    holds: int = 0
    future: Future | None = None  # None: waiting for a prefetch slot


class CropHold:
    """The images one caller keeps prefetched; ``release()`` (idempotent) when done."""

    def __init__(self, pool: CropPool, entries: list[_Entry]) -> None:
        self._pool, self._entries = pool, entries

    def release(self, *_: object) -> None:
        entries, self._entries = self._entries, []
        if entries:
            self._pool._release(entries)

    def __enter__(self) -> CropHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CropPool:
    """Crops for one model's vision config, made by ``workers`` threads (module doc).

    ``normalize``: float32 crops ready for the encoder (on a CPU model), else uint8 crops that
    ``CropPixels.encoder_input`` normalizes on the device (4x less to upload); ``pin_memory``:
    uint8 crops staged in pinned memory taken now, once (``crop_staging.py``; a CUDA model's:
    uploaded without a host sync). ``parallel``: the parts one image's crops are split into and
    made at once by as many worker processes; ``threads``: the libvips threads each part is
    made with (worker processes only; the in-process fallback keeps the process's setting).
    Either way a lone image's crops spread over the cores: by default one part per 4 cores (at
    most ``workers``), each on the cores over ``parallel`` threads (measured on 2 cores, one
    render on both beats two one-thread parts, ``scripts/bench_crop_parts.py``; a GPU host's
    many cores are measured by ``scripts/gpu_check.sh``). ``prefetch`` bounds the images
    started but not yet taken (their memory); ``recent`` is how many lately encoded images
    ``hold(skip_recent=True)`` leaves alone (0: none). Worker processes start on demand, or
    ahead with ``start_workers``. ``processes=False`` makes the crops on the pool's threads.
    """

    def __init__(
        self,
        config: VisionConfig,
        *,
        normalize: bool = True,
        pin_memory: bool = False,
        workers: int | None = None,
        prefetch: int = 16,
        recent: int = 0,
        processes: bool = True,
        parallel: int | None = None,
        threads: int | None = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if pin_memory and normalize:
            raise ValueError("pinned crop staging holds uint8 crops: pass normalize=False")
        workers, parallel = _sizes(workers, parallel)
        threads = threads or max(1, _cores() // parallel)
        staging = CropStaging(config, prefetch + workers + 2) if pin_memory else None
        self._cropper = _Cropper(config, normalize, processes, parallel, staging, threads)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kestrel-crops")
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}  # by image digest, in arrival order
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self.prefetch, self.recent = prefetch, recent

    @property
    def uses_processes(self) -> bool:
        return self._cropper.processes

    def hold(self, images: Iterable[PreparedImage], *, skip_recent: bool = False) -> CropHold:
        """Start (or share) the crops of ``images``; they stay until taken or released."""
        held = []
        with self._lock:
            for image in images:
                if skip_recent and image.digest in self._recent:
                    self._recent.move_to_end(image.digest)
                    continue
                entry = self._entries.setdefault(image.digest, _Entry(image))
                entry.holds += 1
                held.append(entry)
            self._start_waiting()
        return CropHold(self, held)

    def pixels(self, image: PreparedImage) -> CropPixels:
        """The crops of ``image``, taken: a held image's (waiting for them), else made now."""
        with self._lock:
            entry = self._entries.pop(image.digest, None) or _Entry(image)
            future = entry.future or self._submit(image)
            if self.recent:
                self._recent[image.digest] = None
                self._recent.move_to_end(image.digest)
                while len(self._recent) > self.recent:
                    self._recent.popitem(last=False)
            self._start_waiting()
        if future is not None:
            try:
                return future.result()
            except CancelledError:  # the pool closed before they started
                pass
        return self._cropper.crop(image)  # closed: made on the calling thread

    def close(self) -> None:
        """Stop the pool's threads (crops not yet started are dropped); ``pixels`` still works,
        on the calling thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._cropper.close()
        with self._lock:
            self._entries.clear()

    def _release(self, entries: list[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.holds -= 1
                digest = entry.image.digest
                if entry.holds <= 0 and self._entries.get(digest) is entry:
                    del self._entries[digest]
                    if entry.future is not None:
                        entry.future.cancel()  # a no-op once it runs
            self._start_waiting()

    def _start_waiting(self) -> None:
        started = sum(e.future is not None for e in self._entries.values())
        for entry in self._entries.values():
            if started >= self.prefetch:
                return
            if entry.future is None:
                entry.future = self._submit(entry.image)
                if entry.future is None:
                    return
                started += 1

    def _submit(self, image: PreparedImage) -> Future | None:
        """The crops of ``image`` started on the pool; None once it is closed."""
        try:
            return self._executor.submit(self._cropper.crop, image)
        except RuntimeError:
            return None
