"""The crop worker process: makes an image's crops outside the serving process, so no thread
of that process waits on the GIL while they are made.

``CropPool`` (``crop_pool.py``) starts it as ``python -c BOOT crop_worker.py FD``: FD is one end
of a ``SOCK_SEQPACKET`` socket pair. It imports numpy, pyvips and ``kestrel/moondream/
crops.py`` (loaded by its path, so neither torch nor the rest of kestrel is imported) and
serves one request at a time:

- request: one JSON line (``size`` of the shared memory, the image's ``height`` and
  ``width``, whose H x W x 3 uint8 pixels start at offset 0, the ``geometry`` fields, the
  ``out`` offset, optionally ``part`` = [whole, top, bottom]: only those crops,
  ``crops.CropPart``, and ``threads``: the libvips threads to make them with), then, when the
  crops are to be normalized, the 256-entry float32 pixel table. The memory is a
  shared-memory file (``memfd``) passed with the message: for this request alone, or, with
  ``arena`` = [slot, generation], one of the pool's reused arenas, kept mapped here under that
  slot until a later generation of it replaces it (its descriptor comes only with the slot's
  first request to this worker; later ones reuse the mapping, so neither side maps or faults
  in fresh pages per image);
- work: ``write_crops`` writes the crops [N, crop, crop, 3] (or the part's) at ``out``
  (float32 through the table, else uint8); several workers may write parts of one image's
  crops into the same memory at once;
- reply: ``ok``, ``not mapped`` (an arena request without the descriptor for a generation this
  worker has not mapped: send it again with the descriptor), or ``error: <message>``.

It exits when the other end of the socket closes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import mmap
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

__all__ = ["CROPS_SOURCE", "NOT_MAPPED", "load_crops", "serve"]

CROPS_SOURCE = Path(__file__).resolve().parents[1] / "moondream" / "crops.py"
_MAX_MESSAGE = 1 << 16
NOT_MAPPED = b"not mapped"


class _NotMapped(LookupError):
    pass


def load_crops() -> ModuleType:
    """``kestrel/moondream/crops.py`` as a module of its own (nothing else of kestrel)."""
    spec = importlib.util.spec_from_file_location("kestrel_crop_worker_crops", CROPS_SOURCE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {CROPS_SOURCE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _memory(req: dict, fd: int | None, arenas: dict[int, tuple[int, mmap.mmap]]) -> mmap.mmap:
    """The request's shared memory: mapped from ``fd`` (and, for an arena, kept under its
    slot), or the mapping kept for its arena."""
    if "arena" not in req:
        if fd is None:
            raise ValueError("a request without an arena carries one memory descriptor")
        return mmap.mmap(fd, req["size"])
    slot, generation = req["arena"]
    if fd is not None:
        old = arenas.pop(slot, None)
        if old is not None:
            with contextlib.suppress(BufferError):
                old[1].close()
        arenas[slot] = (generation, mmap.mmap(fd, req["size"]))
    kept = arenas.get(slot)
    if kept is None or kept[0] != generation or len(kept[1]) < req["size"]:
        raise _NotMapped(f"arena {slot} generation {generation}")
    return kept[1]


def _handle(
    crops: ModuleType, message: bytes, fd: int | None, arenas: dict[int, tuple[int, mmap.mmap]]
) -> None:
    head, _, table = message.partition(b"\n")
    req = json.loads(head)
    memory = _memory(req, fd, arenas)
    try:
        h, w = req["height"], req["width"]
        src = crops.pyvips.Image.new_from_memory(memoryview(memory)[: h * w * 3], w, h, 3, "uchar")
        g = crops.CropGeometry(**req["geometry"])
        lut = crops.lut_image(np.frombuffer(table, np.float32)) if table else None
        dtype = np.float32 if lut is not None else np.uint8
        count = g.n_crops * 3 * g.crop * g.crop
        out = np.frombuffer(memory, dtype, count=count, offset=req["out"])
        part = crops.CropPart(*req["part"]) if "part" in req else None
        _use_threads(crops.pyvips, req.get("threads"))
        crops.write_crops(src, g, out.reshape(g.n_crops, g.crop, g.crop, 3), lut, part)
        del src, out
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


def serve(sock: socket.socket, crops: ModuleType) -> None:
    """Answer requests on ``sock`` until its other end closes."""
    crops.pyvips.cache_set_max(0)  # nothing may keep a request's memory alive
    arenas: dict[int, tuple[int, mmap.mmap]] = {}
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
            _handle(crops, message, fds[0] if fds else None, arenas)
            reply = b"ok"
        except _NotMapped:
            reply = NOT_MAPPED
        except Exception as exc:  # reported to the caller, who raises it there
            reply = f"error: {type(exc).__name__}: {exc}".encode()
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(reply)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[-1]))
    serve(sock, load_crops())


if __name__ == "__main__":
    main(sys.argv)
