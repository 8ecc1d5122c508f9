"""Host-to-device uploads that never stall the host.

``torch.tensor(data, device="cuda")`` copies from pageable host memory: the host waits until
the copy is done, which means until everything queued on the stream before it is done -- a
full stall of the pipeline for a few bytes of metadata. ``upload`` builds the tensor on the
host, pins it (PyTorch's caching host allocator keeps the pinned block alive until the copy
has run) and copies it with ``non_blocking=True``, so the host goes on queueing work. On a CPU
it is the plain tensor.

``Readback`` is the other direction: a device tensor copied into pinned host memory without
blocking, with an event behind it, read later. Reading waits for that event only, not for the
stream: work queued after the copy (the next decode step) keeps the device busy meanwhile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels.counting import active_counter, count_upload

__all__ = ["Readback", "upload"]


def upload(data: object, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``data`` (numbers, nested lists, a host tensor) as a ``dtype`` tensor on ``device``."""
    host = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    host = host.to(dtype)
    device = torch.device(device)
    count_upload(blocking=False)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Readback:
    """A device tensor on its way to the host: started now, read with :meth:`tolist`.

    On CUDA the copy goes to pinned memory with ``non_blocking=True`` and an event is recorded
    after it; ``tolist`` waits on that event. On a CPU the tensor is already on the host.
    Under a ``LaunchCounter`` the read is a sync unless work was launched after the copy
    (``LaunchCounter.readback``).
    """

    __slots__ = ("_event", "_host", "_mark", "_values")

    def __init__(self, tensor: Tensor) -> None:
        self._values: list | None = None
        self._event = None
        if tensor.is_cuda:
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
            counter = active_counter()
            if counter is not None:
                counter.readback(self._mark)
                with counter.paused():
                    self._values = self._host.tolist()
            else:
                self._values = self._host.tolist()
        return self._values
