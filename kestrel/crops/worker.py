"""The crop worker process: makes an image's crops outside the serving process, so no thread
of that process waits on the GIL while they are made.

``CropPool`` (``pool.py``) starts it (``procs.py``) as ``python -c BOOT ROOT FD``: ROOT is the
folder that holds ``kestrel/``, FD one end of a ``SOCK_SEQPACKET`` socket pair. ``BOOT`` makes
``kestrel`` and ``kestrel.crops`` bare packages (their folders, their ``__init__`` not run:
``import kestrel`` loads torch and the engine, ~1.6 s and ~1,300 modules a worker never uses),
then imports this module the ordinary way. It imports numpy, pyvips and ``overlap.py`` (the
crops, numpy and pyvips only), nothing else of kestrel and no torch
(``tests/unit/test_crop_worker_imports.py``), and serves one request at a time:

- request: one JSON line (``size`` of the shared memory, the image's ``height`` and
  ``width``, whose H x W x 3 uint8 pixels start at offset 0, the ``geometry`` fields, the
  ``out`` offset, optionally ``part`` = [whole, top, bottom]: only those crops,
  ``overlap.CropPart``, ``threads``: the libvips threads to make them with, and ``cpus``: the
  cores to make them on, a part's share of them; without it, every core), then, when the
  crops are to be normalized, the 256-entry float32 pixel table. The memory is a
  shared-memory file (``memfd``) passed with the message: for this request alone, or, with
  ``arena`` = [slot, generation], one of the pool's reused arenas, kept mapped here under that
  slot until a later generation of it replaces it (its descriptor comes only with the slot's
  first request to this worker; later ones reuse the mapping, so neither side maps or faults
  in fresh pages per image);
- work: ``overlap.write_part`` writes the crops [N, crop, crop, 3] (or the part's) at ``out``
  (float32 through the table, else uint8); several workers may write parts of one image's
  crops into the same memory at once. The libvips pipelines an arena request renders are
  kept (``_Kept``) and rendered again for the next image of that size in that arena;
- reply: ``ok``, ``not mapped`` (an arena request without the descriptor for a generation this
  worker has not mapped: send it again with the descriptor), or ``error: <message>``.

It exits when the other end of the socket closes.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from kestrel.crops import overlap
from kestrel.crops.overlap import PartRenders

__all__ = [
    "BARE_PACKAGES",
    "BOOT",
    "IMPORT",
    "NOT_MAPPED",
    "ROOT",
    "batch_policy",
    "command",
    "serve",
]

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds kestrel/
BARE_PACKAGES = ("kestrel", "kestrel.crops")
# What the worker's interpreter runs (``-c``; argv: ROOT, FD): no current directory on
# sys.path, the packages above this module made bare (found by their folders, their
# ``__init__`` not run), then this module imported and its ``main`` run. ``IMPORT`` is the
# part before ``main``: the imports a worker makes, which the tests check for torch.
IMPORT = (
    "import sys, types\n"
    "sys.path.pop(0)\n"
    f"for name in {BARE_PACKAGES!r}:\n"
    "    package = types.ModuleType(name)\n"
    "    package.__path__ = [sys.argv[1] + '/' + name.replace('.', '/')]\n"
    "    sys.modules[name] = package\n"
    "from kestrel.crops import worker\n"
)
BOOT = IMPORT + "worker.main(sys.argv)\n"
_MAX_MESSAGE = 1 << 16
NOT_MAPPED = b"not mapped"


def command(fd: int) -> list[str]:
    """The command line of a worker process serving the socket ``fd``."""
    return [sys.executable, "-c", BOOT, str(ROOT), str(fd)]


class _NotMapped(LookupError):
    pass


class _Kept:
    """The libvips pipelines (``overlap.PartRenders``) this worker built for its arenas, by
    what they make: an arena's slot and generation, the image's size, the geometry, the part
    and the pixel table. Serving an image of a size it served before in the same arena, the
    worker renders the kept pipeline again over the new pixels instead of building one (a
    1280 x 960 image's two resizes: ~0.35 ms of set-up each, ~4.4 ms of rendering in all).
    The ``LIMIT`` latest are kept; a slot's go when its memory is mapped again."""

    LIMIT = 8

    def __init__(self) -> None:
        self._renders: OrderedDict[tuple, PartRenders] = OrderedDict()

    def take(self, key: tuple) -> PartRenders | None:
        """The pipelines kept under ``key``, taken out (kept again once they rendered)."""
        return self._renders.pop(key, None)

    def keep(self, key: tuple, renders: PartRenders) -> None:
        self._renders[key] = renders
        while len(self._renders) > self.LIMIT:
            self._renders.popitem(last=False)

    def drop_slot(self, slot: int) -> None:
        for key in [k for k in self._renders if k[0] == slot]:
            del self._renders[key]


class _Cores:
    """The cores this worker's threads run on: a part's share of the host's cores when the
    request names one (``cpus``), else every core the worker started with. Left to the
    kernel's scheduler, two parts of one image sometimes shared a core after a two-thread
    render (a 1280 x 960 image on 2 cores, the crop test's order: 0.76-0.79x serial, against
    0.59-0.63x pinned). Every thread is pinned, libvips renders on its own. A tuning knob: it
    never fails a request."""

    def __init__(self) -> None:
        self.every = frozenset(os.sched_getaffinity(0))
        self.now = self.every

    def use(self, cpus: list[int] | None) -> None:
        want = (frozenset(cpus) & self.every if cpus else None) or self.every
        if want == self.now:
            return
        self.now = want
        _each_thread(lambda tid: os.sched_setaffinity(tid, want))


def _each_thread(apply: Callable[[int], None]) -> None:
    """``apply(tid)`` for every thread of this process (libvips renders on threads of its
    own); a thread that ends meanwhile, or no /proc, is left as it is."""
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                apply(int(tid))


@dataclass(slots=True, eq=False)
class _State:
    """What a worker keeps between requests: its arenas' mappings by slot (with their
    generation), its kept pipelines, and its cores (None: not pinned, as when ``serve`` runs
    on a thread of a process that is not a worker)."""

    arenas: dict[int, tuple[int, mmap.mmap]] = field(default_factory=dict)
    kept: _Kept = field(default_factory=_Kept)
    cores: _Cores | None = None


def _memory(req: dict, fd: int | None, state: _State) -> mmap.mmap:
    """The request's shared memory: mapped from ``fd`` (and, for an arena, kept under its
    slot: the pipelines kept over its earlier mapping go first), or the mapping kept for its
    arena."""
    if "arena" not in req:
        if fd is None:
            raise ValueError("a request without an arena carries one memory descriptor")
        return mmap.mmap(fd, req["size"])
    slot, generation = req["arena"]
    if fd is not None:
        state.kept.drop_slot(slot)
        old = state.arenas.pop(slot, None)
        if old is not None:
            with contextlib.suppress(BufferError):
                old[1].close()
        state.arenas[slot] = (generation, mmap.mmap(fd, req["size"]))
    mapped = state.arenas.get(slot)
    if mapped is None or mapped[0] != generation or len(mapped[1]) < req["size"]:
        raise _NotMapped(f"arena {slot} generation {generation}")
    return mapped[1]


def _handle(crops: ModuleType, message: bytes, fd: int | None, state: _State) -> None:
    head, _, table = message.partition(b"\n")
    req = json.loads(head)
    memory = _memory(req, fd, state)
    kept = state.kept
    try:
        h, w = req["height"], req["width"]
        g = crops.CropGeometry(**req["geometry"])
        part = crops.CropPart(*req["part"]) if "part" in req else None
        key = None
        if "arena" in req:  # the pipelines over this arena's pixels: kept, or built now
            key = (*req["arena"], h, w, *req["geometry"].values(), *req.get("part", ()), table)
        renders = kept.take(key) if key is not None else None
        if renders is not None:
            renders.source.invalidate()  # new pixels behind the same memory
        else:
            src = crops.pyvips.Image.new_from_memory(
                memoryview(memory)[: h * w * 3], w, h, 3, "uchar"
            )
            lut = crops.lut_image(np.frombuffer(table, np.float32)) if table else None
            renders = crops.part_renders(src, g, lut, part)
            del src
        dtype = np.float32 if renders.floats else np.uint8
        count = g.n_crops * 3 * g.crop * g.crop
        out = np.frombuffer(memory, dtype, count=count, offset=req["out"])
        _use_threads(crops.pyvips, req.get("threads"))
        if state.cores is not None:
            state.cores.use(req.get("cpus"))
        crops.write_part(renders, g, out.reshape(g.n_crops, g.crop, g.crop, 3))
        if key is not None:  # rendered: kept for the next image this size (never on error)
            kept.keep(key, renders)
        del renders, out
    finally:
        if "arena" not in req:
            with contextlib.suppress(BufferError):  # a view outlived the request: freed later
                memory.close()


def _use_threads(pyvips: ModuleType, threads: int | None) -> None:
    """libvips' threads for this request where the installed pyvips can set them. A tuning
    knob: it never fails a request (without a way to set them libvips keeps its default, one
    thread per core)."""
    calls = _concurrency_calls(pyvips)
    if threads and calls is not None and threads != calls[0]():
        calls[1](threads)


def _concurrency_calls(
    pyvips: ModuleType,
) -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of libvips' thread count: pyvips' own calls (3.0 and later), else libvips'
    functions through pyvips' binding (pyvips 2.x names no call for them, but a compiled
    binding built with their declarations, as pyvips-binary's is, has them), else None."""
    found = [getattr(pyvips, n, None) for n in ("concurrency_get", "concurrency_set")]
    if None in found:
        lib = getattr(pyvips, "vips_lib", None)
        found = [getattr(lib, f"vips_{n}", None) for n in ("concurrency_get", "concurrency_set")]
    return None if None in found else (found[0], found[1])


def serve(sock: socket.socket, crops: ModuleType, pin: bool = False) -> None:
    """Answer requests on ``sock`` until its other end closes, making the crops with ``crops``
    (``overlap``; a test may pass a stand-in); ``pin``: run each request on the cores it names
    (a worker process's own threads; ``_Cores``)."""
    crops.pyvips.cache_set_max(0)  # nothing may keep a request's memory alive
    state = _State(cores=_Cores() if pin and hasattr(os, "sched_setaffinity") else None)
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        except OSError:
            return
        if not message:
            return
        try:
            if len(fds) > 1:
                raise ValueError(f"a request carries one memory descriptor, got {len(fds)}")
            _handle(crops, message, fds[0] if fds else None, state)
            reply = b"ok"
        except _NotMapped:
            reply = NOT_MAPPED
        except Exception as exc:  # reported to the caller, who raises it there
            reply = f"error: {type(exc).__name__}: {exc}".encode()
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(reply)


def batch_policy() -> None:
    """Put this process's threads under Linux's ``SCHED_BATCH`` (those there now, numpy's
    among them, and, before libvips starts its own, every later one: they inherit it). A
    worker woken by a request then no longer preempts the thread that sent it, so the serving
    thread sends an image's every part and waits before any part starts on its core. Under the
    normal policy a part's worker, waking on the sender's core, could preempt it before it sent
    the next part: in the crop test's loop the second part's start lagged the first's by
    0.83-0.85 ms at the 90th percentile, 0.24-0.25 ms under this policy (a 1280 x 960 image's
    two parts: 3.63-3.71 ms, then 3.17-3.22 ms). It also keeps crop work from preempting the
    scheduler thread; a worker still gets its fair share of the cores. A tuning knob: where
    the policy is not there (not Linux) the worker runs as it is."""
    if hasattr(os, "SCHED_BATCH"):
        _each_thread(lambda tid: os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0)))


def main(argv: list[str]) -> None:
    """A worker process's life (``BOOT``): serve the socket whose descriptor ends ``argv``."""
    batch_policy()
    sock = socket.socket(fileno=int(argv[-1]))
    serve(sock, overlap, pin=True)
