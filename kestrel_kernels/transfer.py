"""Host-to-device uploads that never stall the host.

``torch.tensor(data, device="cuda")`` copies from pageable host memory: the host waits until
the copy is done, which means until everything queued on the stream before it is done -- a
full stall of the pipeline for a few bytes of metadata. ``upload`` builds the tensor on the
host, stages it in pinned memory and copies it with ``non_blocking=True``, so the host goes on
queueing work. The pinned memory is a slot of the ring the runtime reserved at start-up
(``pinned.py``); without one (kernels used on their own) the tensor is pinned per call, and
PyTorch's caching host allocator keeps the block alive until the copy has run. On a CPU it is
the plain tensor.

``Readback`` is the other direction: a device tensor copied into pinned host memory without
blocking, with an event behind it, read later. Reading waits for that event only, not for the
stream: work queued after the copy (the next decode step) keeps the device busy meanwhile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels import pinned
from kestrel_kernels.counting import active_counter, count_upload

__all__ = ["Readback", "upload", "upload_into"]


def upload(data: object, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``data`` (numbers, nested lists, a host tensor) as a ``dtype`` tensor on ``device``."""
    host = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    device = torch.device(device)
    count_upload(blocking=False)
    if device.type != "cuda":
        return host.to(device)
    ring = pinned.ring(device)
    staged = ring.staged(host.contiguous()) if ring is not None else None
    if staged is None:
        return host.pin_memory().to(device, non_blocking=True)
    slot, view = staged
    out = view.to(device, non_blocking=True)
    ring.copied(slot)
    return out


def upload_into(static: Tensor, host: Tensor) -> None:
    """``host`` into a fixed device buffer (a CUDA graph's input) without blocking: on CUDA
    through a slot of the pinned ring reserved at start-up (pinned per call only where none
    was reserved). Counted as one non-blocking upload."""
    count_upload(blocking=False)
    ring = pinned.ring(static.device) if static.is_cuda else None
    staged = ring.staged(host) if ring is not None else None
    if ring is None or staged is None:
        if static.is_cuda:
            host = host.pin_memory()
        static.copy_(host, non_blocking=True)
        return
    slot, view = staged
    static.copy_(view, non_blocking=True)
    ring.copied(slot)


class Readback:
    """A device tensor on its way to the host: started now, read with :meth:`tolist`.

    On CUDA the copy goes to pinned memory with ``non_blocking=True`` and an event is recorded
    after it; ``tolist`` waits on that event. On a CPU the tensor is already on the host.
    Under a ``LaunchCounter`` the read is a sync unless work was launched after the copy
    (``LaunchCounter.readback``).
    """

    __slots__ = ("_event", "_host", "_mark", "_ring", "_slot", "_values")

    def __init__(self, tensor: Tensor) -> None:
        self._values: list | None = None
        self._event = None
        self._ring: pinned.HostRing | None = None
        self._slot = -1
        if tensor.is_cuda:
            ring = pinned.ring(tensor.device)
            taken = ring.empty_like(tensor, self) if ring is not None else None
            if taken is not None and ring is not None:
                self._ring, (self._slot, self._host) = ring, taken
                self._host.copy_(tensor, non_blocking=True)
                ring.copied(self._slot)
            else:
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host.copy_(tensor, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        else:
            self._host = tensor.clone()  # one launch, like the copy it stands for
        counter = active_counter()
        self._mark = counter.launches if counter is not None else 0

    def tolist(self) -> list:
        """The values (waiting for the copy if it has not finished); read once, then kept."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            elif self._ring is not None:
                self._ring.wait(self._slot)
            counter = active_counter()
            if counter is not None:
                counter.readback(self._mark)
                with counter.paused():
                    self._values = self._host.tolist()
            else:
                self._values = self._host.tolist()
            if self._ring is not None:  # the slot is free again
                self._ring.released(self._slot, self)
                self._ring = None
        return self._values

    def settle(self) -> None:
        """Read now: the ring wants this read-back's slot back."""
        self.tolist()
