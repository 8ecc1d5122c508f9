"""Pinned host memory taken once, at start-up, and reused: never pinned per request.

Pinning host memory (``cudaHostAlloc``) is a driver call that CUDA refuses while any stream of
the process captures a graph in the default, global capture mode: a crop thread pinning its
planes while the scheduler thread captured a decode graph invalidated the capture and failed
the request in that step. So the runtime takes the pinned memory it needs once, before it
serves (``reserve``), and cycles through it:

- ``pinned_empty`` is the one place host memory is pinned (tests stand in for it and count).
- ``HostRing``: ``count`` slots of ``slot_bytes`` pinned bytes, handed out round-robin. Each
  slot remembers the copy that last used it (a CUDA event) and, for a device-to-host copy,
  the reader that has not read it yet; taking the slot again first waits for that copy and
  lets that reader read (``Settles.settle``), so a slot is never overwritten under a copy in
  flight or an unread value. With dozens of slots that wait is, in practice, long over.

``reserve(device)`` makes the process's ring for a CUDA device (uploads and read-backs of
``transfer.py`` take their slots from it); ``ring(device)`` is that ring or None.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["HostRing", "Settles", "host_empty", "pinned_empty", "reserve", "ring"]

SLOT_BYTES = 512 << 10  # a 64-row prefill of 760 positions uploads ~200 KiB of metadata
SLOT_COUNT = 64
_ALIGN = 64


def pinned_empty(nbytes: int) -> Tensor:
    """``nbytes`` of page-locked host memory (uint8)."""
    return host_empty(nbytes, pin=True)


def host_empty(nbytes: int, *, pin: bool) -> Tensor:
    """``nbytes`` of host memory (uint8), page-locked with ``pin``. Always a normal tensor,
    even when the runtime is built under ``torch.inference_mode``: crop threads and request
    threads write into it outside inference mode, where an in-place write to an inference
    tensor raises (seen on an H200)."""
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Settles(Protocol):
    """A reader of a slot's bytes that must read them before the slot is reused."""

    def settle(self) -> None: ...


class HostRing:
    """``count`` slots of ``slot_bytes`` host bytes, reused round-robin (module doc).

    ``pin=False`` makes plain host memory and no events (a CPU stand-in with the same slot
    discipline, for tests)."""

    def __init__(self, count: int, slot_bytes: int, *, pin: bool = True) -> None:
        if count < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots of bytes, got {count} x {slot_bytes}")
        self.count = count
        self.slot_bytes = (slot_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.pin = pin
        total = self.count * self.slot_bytes
        self._memory = pinned_empty(total) if pin else host_empty(total, pin=False)
        self._events: list = [torch.cuda.Event() for _ in range(count)] if pin else []
        self._recorded = [False] * count
        self._readers: list[Settles | None] = [None] * count
        self._next = 0
        self._lock = threading.Lock()
        self.takes = 0
        self.waits = 0  # takes that found the slot's earlier copy or reader unfinished

    def take(self, nbytes: int, reader: Settles | None = None) -> tuple[int, Tensor] | None:
        """A free slot: (its index, ``nbytes`` of it as uint8); None if ``nbytes`` exceeds a
        slot. ``reader``: who reads the slot after a device-to-host copy (module doc)."""
        if nbytes > self.slot_bytes:
            return None
        with self._lock:
            i = self._next
            self._next = (i + 1) % self.count
            earlier, self._readers[i] = self._readers[i], reader
            self.takes += 1
        if earlier is not None:
            self.waits += 1
            earlier.settle()
        if self._recorded[i]:
            event = self._events[i]
            if not event.query():
                self.waits += 1
                event.synchronize()
            self._recorded[i] = False
        start = i * self.slot_bytes
        return i, self._memory[start : start + nbytes]

    def copied(self, slot: int) -> None:
        """The copy from (or into) ``slot`` is queued on the current stream: mark its end."""
        if self.pin:
            self._events[slot].record()
            self._recorded[slot] = True

    def wait(self, slot: int) -> None:
        """Wait for the copy last queued on ``slot`` (a read-back about to be read)."""
        if self._recorded[slot]:
            self._events[slot].synchronize()

    def released(self, slot: int, reader: Settles) -> None:
        """``reader`` has read ``slot``: it need not be asked again."""
        with self._lock:
            if self._readers[slot] is reader:
                self._readers[slot] = None

    def staged(self, host: Tensor, reader: Settles | None = None) -> tuple[int, Tensor] | None:
        """``host`` copied into a slot: (slot, the pinned tensor of its shape and dtype)."""
        nbytes = host.numel() * host.element_size()
        taken = self.take(nbytes, reader)
        if taken is None:
            return None
        slot, raw = taken
        view = raw.view(host.dtype).view(host.shape)
        view.copy_(host)
        return slot, view

    def empty_like(self, tensor: Tensor, reader: Settles) -> tuple[int, Tensor] | None:
        """A slot viewed as a tensor of ``tensor``'s shape and dtype (a read-back's target)."""
        taken = self.take(tensor.numel() * tensor.element_size(), reader)
        if taken is None:
            return None
        slot, raw = taken
        return slot, raw.view(tensor.dtype).view(tensor.shape)


_RINGS: dict[int, HostRing] = {}
_RINGS_LOCK = threading.Lock()


def reserve(
    device: torch.device | str, count: int = SLOT_COUNT, slot_bytes: int = SLOT_BYTES
) -> HostRing | None:
    """The process's ring for a CUDA ``device``, made now if it does not exist (start-up);
    None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _RINGS_LOCK:
        if index not in _RINGS:
            _RINGS[index] = HostRing(count, slot_bytes)
        return _RINGS[index]


def ring(device: torch.device) -> HostRing | None:
    """The ring ``reserve`` made for ``device``, or None (nothing reserved: pin per call)."""
    if device.type != "cuda" or not _RINGS:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _RINGS.get(index)
