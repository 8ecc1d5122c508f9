"""The crop worker process: makes an image's crops outside the serving process, so no thread
of that process waits on the GIL while they are made.

``CropPool`` (``crop_pool.py``) starts it as ``python -c BOOT crop_worker.py FD``: FD is one end
of a ``SOCK_SEQPACKET`` socket pair. It imports numpy, pyvips and ``kestrel/moondream/
crops.py`` (loaded by its path, so neither torch nor the rest of kestrel is imported) and
serves one request at a time:

- request: a shared-memory file descriptor (``memfd``) passed with the message, and the
  message: one JSON line (``size`` of the memory, the image's ``height`` and ``width``, whose
  H x W x 3 uint8 pixels start at offset 0, the ``geometry`` fields, the ``out`` offset, and
  optionally ``part`` = [whole, top, bottom]: only those crops, ``crops.CropPart``), then,
  when the crops are to be normalized, the 256-entry float32 pixel table;
- work: ``write_planes`` writes the crops [N, 3, crop, crop] (or the part's) at ``out``
  (float32 through the table, else uint8); several workers may write parts of one image's
  crops into the same memory at once;
- reply: ``ok``, or ``error: <message>``.

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
from pathlib import Path
from types import ModuleType

import numpy as np

__all__ = ["CROPS_SOURCE", "load_crops", "serve"]

CROPS_SOURCE = Path(__file__).resolve().parents[1] / "moondream" / "crops.py"
_MAX_MESSAGE = 1 << 16


def load_crops() -> ModuleType:
    """``kestrel/moondream/crops.py`` as a module of its own (nothing else of kestrel)."""
    spec = importlib.util.spec_from_file_location("kestrel_crop_worker_crops", CROPS_SOURCE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {CROPS_SOURCE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _handle(crops: ModuleType, message: bytes, fd: int) -> None:
    head, _, table = message.partition(b"\n")
    req = json.loads(head)
    memory = mmap.mmap(fd, req["size"])
    try:
        h, w = req["height"], req["width"]
        src = crops.pyvips.Image.new_from_memory(memoryview(memory)[: h * w * 3], w, h, 3, "uchar")
        g = crops.CropGeometry(**req["geometry"])
        lut = crops.lut_image(np.frombuffer(table, np.float32)) if table else None
        dtype = np.float32 if lut is not None else np.uint8
        count = g.n_crops * 3 * g.crop * g.crop
        out = np.frombuffer(memory, dtype, count=count, offset=req["out"])
        part = crops.CropPart(*req["part"]) if "part" in req else None
        crops.write_planes(src, g, out.reshape(g.n_crops, 3, g.crop, g.crop), lut, part)
        del src, out
    finally:
        with contextlib.suppress(BufferError):  # a view outlived the request: freed with it
            memory.close()


def serve(sock: socket.socket, crops: ModuleType) -> None:
    """Answer requests on ``sock`` until its other end closes."""
    crops.pyvips.cache_set_max(0)  # nothing may keep a request's memory alive
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        except OSError:
            return
        if not message:
            return
        try:
            if len(fds) != 1:
                raise ValueError(f"a request carries one memory descriptor, got {len(fds)}")
            _handle(crops, message, fds[0])
            reply = b"ok"
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
