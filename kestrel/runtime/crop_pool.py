"""CropPool: an image's crops made off the scheduler thread, started when a request is submitted.

The crops and their normalization (``moondream/crops.py``, ``vision.normalize_pixels``) cost
some milliseconds of host work per new image. Made on the scheduler thread they stall every
running sequence; made on a plain worker thread they stall on the GIL: every libvips, numpy or
torch call that lets the GIL go has to win it back from the process's busy Python threads,
about one switch interval (5 ms) each time. So the pool hands each image to a crop worker
process (``crop_worker.py``) through shared memory: its threads only copy the pixels in, send
one message and wait for the reply; the result is a tensor over that shared memory (copied
once into pinned memory for a CUDA model, whose upload then needs no host sync).

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

import atexit
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kestrel.images import PreparedImage
from kestrel.moondream.config import VisionConfig
from kestrel.moondream.crops import (
    CropError,
    CropGeometry,
    check_pixels,
    crop_geometry,
    lut_image,
    vips_image,
    write_planes,
)
from kestrel.moondream.vision import normalize_pixels, pixel_table
from kestrel.runtime.crop_worker import CROPS_SOURCE

__all__ = ["CropHold", "CropPixels", "CropPool", "processes_supported"]

log = logging.getLogger("kestrel.runtime")

WORKER_SCRIPT = CROPS_SOURCE.parents[1] / "runtime" / "crop_worker.py"
# Run the worker script by its path, without the current directory on sys.path.
_BOOT = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"
_MAX_FAILURES = 3  # worker processes that die in a row before a pool stops starting them


def processes_supported() -> bool:
    """Crop worker processes need Linux's memfd_create and descriptor passing."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


@dataclass(frozen=True, slots=True, eq=False)
class CropPixels:
    """An image's crops on the host, channel-major [N, 3, crop, crop]: normalized float32, or
    uint8 to be normalized on the device; ``tiling`` = (rows, cols)."""

    pixels: torch.Tensor
    tiling: tuple[int, int]

    def encoder_input(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The vision encoder's input: normalized, in ``dtype`` on ``device`` (uploaded without
        a host sync when the crops are in pinned memory)."""
        pixels = self.pixels.to(device=device, non_blocking=self.pixels.is_pinned())
        if pixels.dtype == torch.uint8:  # the same arithmetic, on the device
            return normalize_pixels(pixels.permute(0, 2, 3, 1), dtype, device)
        return pixels.to(dtype=dtype)


class _WorkerGone(RuntimeError):
    """The worker process is not there (did not start, exited, closed its socket)."""


class _Worker:
    """One crop worker process and our end of its socket; one request at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fd = theirs.fileno()
            cmd = [sys.executable, "-c", _BOOT, str(WORKER_SCRIPT), str(fd)]
            self.proc = subprocess.Popen(cmd, pass_fds=[fd], stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    def run(self, message: bytes, fd: int) -> None:
        try:
            socket.send_fds(self.sock, [message], [fd])
            reply = self.sock.recv(1 << 16)
        except OSError as exc:
            raise _WorkerGone(f"the crop worker process is gone: {exc}") from exc
        if not reply:
            raise _WorkerGone("the crop worker process exited")
        if reply != b"ok":
            raise CropError(reply.decode(errors="replace").removeprefix("error: "))

    def stop(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Workers:
    """The process's crop workers, shared by every pool: started on demand, kept while idle,
    stopped at exit."""

    def __init__(self) -> None:
        self._forget()
        atexit.register(self.stop_all)
        if hasattr(os, "register_at_fork"):  # a forked child must not talk to our workers
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        for worker in getattr(self, "_all", ()):
            worker.sock.close()  # this process's copy; the worker stays its parent's
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    def run(self, message: bytes, fd: int) -> None:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            try:
                worker = _Worker()
            except OSError as exc:
                raise _WorkerGone(f"cannot start a crop worker process: {exc}") from exc
            with self._lock:
                self._all.add(worker)
        try:
            worker.run(message, fd)
        except CropError:
            self._give_back(worker)  # a bad request; the worker is fine
            raise
        except BaseException:  # gone, or interrupted mid-request: never reuse it
            self._discard(worker)
            raise
        self._give_back(worker)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.stop()

    def stop_all(self) -> None:
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.stop()


_WORKERS = _Workers()


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class _Cropper:
    """Makes one image's crops, in a worker process or, failing that, here."""

    def __init__(self, config: VisionConfig, normalize: bool, processes: bool, pin: bool) -> None:
        self.config = config
        self.normalize, self.pin = normalize, pin
        self.processes = processes and processes_supported()
        self.failures = 0
        self.table = pixel_table() if normalize else None

    def crop(self, image: PreparedImage) -> CropPixels:
        pixels = check_pixels(image.pixels)
        g = crop_geometry(pixels.shape[0], pixels.shape[1], self.config)
        planes = self._in_worker(pixels, g) if self.processes else None
        if planes is None:
            planes = self._here(pixels, g)
        return CropPixels(planes.pin_memory() if self.pin else planes, (g.rows, g.cols))

    def _dtypes(self) -> tuple[np.dtype, torch.dtype]:
        if self.normalize:
            return np.dtype(np.float32), torch.float32
        return np.dtype(np.uint8), torch.uint8

    def _in_worker(self, pixels: np.ndarray, g: CropGeometry) -> torch.Tensor | None:
        """The crops made by a worker process; None if none could (then made here)."""
        try:
            planes = self._shipped(pixels, g)
        except (_WorkerGone, OSError) as exc:  # no worker, or no shared memory to give it
            self.failures += 1
            if self.failures >= _MAX_FAILURES:
                self.processes = False
            log.warning("crops made in-process: %s", exc)
            return None
        self.failures = 0
        return planes

    def _shipped(self, pixels: np.ndarray, g: CropGeometry) -> torch.Tensor:
        n_in, (np_dtype, dtype) = pixels.size, self._dtypes()
        count = g.n_crops * 3 * g.crop * g.crop
        out_at = _aligned(n_in)
        size = out_at + count * np_dtype.itemsize
        fd = os.memfd_create("kestrel-crops", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
            np.frombuffer(memory, np.uint8, count=n_in)[:] = pixels.reshape(-1)
            head = {"size": size, "height": pixels.shape[0], "width": pixels.shape[1],
                    "out": out_at, "geometry": _fields(g)}  # fmt: skip
            table = self.table.tobytes() if self.table is not None else b""
            _WORKERS.run(json.dumps(head).encode() + b"\n" + table, fd)
        finally:
            os.close(fd)
        planes = torch.frombuffer(memory, dtype=dtype, count=count, offset=out_at)
        return planes.view(g.n_crops, 3, g.crop, g.crop)

    def _here(self, pixels: np.ndarray, g: CropGeometry) -> torch.Tensor:
        np_dtype, _ = self._dtypes()
        out = np.empty((g.n_crops, 3, g.crop, g.crop), np_dtype)
        lut = lut_image(self.table) if self.table is not None else None
        write_planes(vips_image(pixels), g, out, lut)
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

    ``normalize``: float32 crops ready for the encoder (on a CPU model), else uint8 planes that
    ``CropPixels.encoder_input`` normalizes on the device (4x less to upload); ``pin_memory``:
    the crops in pinned memory (a CUDA model's: uploaded without a host sync). ``prefetch``
    bounds the images started but not yet taken (their memory); ``recent`` is how many lately
    encoded images ``hold(skip_recent=True)`` leaves alone (0: none). ``processes=False``
    makes the crops on the pool's threads.
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
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        workers = workers or max(1, min(4, (os.cpu_count() or 2) // 4))
        self._cropper = _Cropper(config, normalize, processes, pin_memory)
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
