"""Host-to-device uploads that never stall the host.

``torch.tensor(data, device="cuda")`` copies from pageable host memory: the host waits until
the copy is done, which means until everything queued on the stream before it is done -- a
full stall of the pipeline for a few bytes of metadata. ``upload`` builds the tensor on the
host, pins it (PyTorch's caching host allocator keeps the pinned block alive until the copy
has run) and copies it with ``non_blocking=True``, so the host goes on queueing work. On a CPU
it is the plain tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels.counting import count_upload

__all__ = ["upload"]


def upload(data: object, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``data`` (numbers, nested lists, a host tensor) as a ``dtype`` tensor on ``device``."""
    host = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    host = host.to(dtype)
    device = torch.device(device)
    count_upload(blocking=False)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
