"""CropPool: an image's crops made off the scheduler thread, started when a request is submitted.

The crops and their normalization (``overlap.py``, ``vision.normalize_pixels``) cost
some milliseconds of host work per new image. Made on the scheduler thread they stall every
running sequence; made on a plain worker thread they stall on the GIL: every libvips, numpy or
torch call that lets the GIL go has to win it back from the process's busy Python threads,
about one switch interval (5 ms) each time. So the pool hands each image to a crop worker
process (``worker.py``, started by ``procs.py``) through shared memory: its threads
only copy the pixels in, send one message and wait for the reply; the result is a tensor over
that shared memory, or, for a CUDA model, copied once into pinned staging taken at start-up
(whose upload then needs no host sync: ``staging.py``) out of one of the process's
reused shared-memory arenas (``arenas.py``: no fresh pages to allocate per image). The
crops are channels last, as libvips makes them (the device reorders them for free). A lone
image's crops spread over the host's cores: split into parts (bands of the resized copy) sent
together to as many worker processes, each part made on its share of libvips threads. Where
the model's GPU makes crops (``on_device``, a CUDA runtime's default; the making is in
``maker.py``) a lone image is only staged here and cut there, libvips' bytes exactly
(``device.py``); images that arrive while others' crops are in the making
still go to the workers, which then run beside the GPU's work.

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

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kestrel.crops.maker import Cropper, crops_on_device
from kestrel.crops.procs import WORKERS, processes_supported
from kestrel.crops.staging import CropPixels, CropStaging
from kestrel.images import PreparedImage
from kestrel.moondream.config import VisionConfig

__all__ = ["CropHold", "CropPixels", "CropPool", "processes_supported", "start_workers"]

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
    uint8 crops staged in pinned memory taken now, once (``staging.py``; a CUDA model's:
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
        on_device: bool = False,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if (pin_memory or on_device) and normalize:
            raise ValueError("staged or device crops are uint8: pass normalize=False")
        workers, parallel = _sizes(workers, parallel)
        threads = threads or max(1, _cores() // parallel)
        staging = CropStaging(config, prefetch + workers + 2) if pin_memory else None
        self._cropper = Cropper(config, normalize, processes, parallel, staging, threads, on_device)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kestrel-crops")
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}  # by image digest, in arrival order
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self.prefetch, self.recent = prefetch, recent

    @classmethod
    def for_runtime(
        cls, config: VisionConfig, device: torch.device, pins: bool, recent: int,
        device_crops: bool | None,
    ) -> CropPool:  # fmt: skip
        """A runtime's pool: where the host pins (CUDA) uint8 crops in pinned staging, or by
        default the image itself there, cropped on the device (``crops_on_device``); else
        float32 crops ready for the encoder (or, asked for, the image cropped by torch)."""
        on_device = crops_on_device(config, device, pins, device_crops)
        return cls(config, normalize=not (pins or on_device), pin_memory=pins, recent=recent,
                   on_device=on_device)  # fmt: skip

    @property
    def uses_processes(self) -> bool:
        return self._cropper.processes

    @property
    def on_device(self) -> bool:
        return self._cropper.on_device

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
        """The crops of ``image`` started on the pool; None once it is closed. With crops on
        the device, an image is handed there only when no other image's crops are still being
        made: under a backlog the host's workers make them beside the GPU's work instead."""
        lone = not any(e.future is not None and not e.future.done() for e in self._entries.values())
        try:
            return self._executor.submit(self._cropper.crop, image, lone)
        except RuntimeError:
            return None
