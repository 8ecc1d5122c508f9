"""Which decode-shaped attention calls run the Triton flash-decoding kernel: the process-wide
mode and a backend's measured route.

A decode-shaped call (one query position per row, no bidirectional regions) may run the
Triton flash-decoding kernel (``triton_decode``) instead of FlashAttention, or, over FP8 pages,
instead of the torch reference (``dispatch`` decides, per call). Two things say which:

- the mode, one per process (``set_decode_kernel`` or ``KESTREL_DECODE_KERNEL``, read at
  import): "auto" (the default: what the backend's route says), "triton" (every decode-shaped
  call on CUDA, and on a CPU under ``TRITON_INTERPRET=1``, the tests) or "fa" (never);
- the route, one per backend object (``AttentionBackend.decode_route``): under "auto", the
  batch sizes measured faster on the Triton kernel, whether it serves FP8 pages (it agreed with
  the scaled reference at start-up), and its launch configuration per batch size. A plain
  backend's route is empty (``NO_ROUTE``); a CUDA runtime measures both kernels at start-up
  (``decode_tune.route_of``) and serves on a ``backends.TritonDecode`` holding what it found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kestrel_kernels.contract import BackendUnavailableError, EnvSwitch, KernelInputError
from kestrel_kernels.fused import triton_available
from kestrel_kernels.triton_decode import DecodeConfig

__all__ = [
    "NO_ROUTE",
    "DecodeRoute",
    "decode_kernel_forced",
    "get_decode_kernel",
    "set_decode_kernel",
]

_MODE = EnvSwitch("KESTREL_DECODE_KERNEL", ("auto", "fa", "triton"), "auto", "decode kernel")


def set_decode_kernel(name: str) -> None:
    """What decode-shaped calls run: "auto" (the default), "fa" or "triton" (module doc)."""
    if name == "triton" and not triton_available():
        raise BackendUnavailableError("decode kernel 'triton' needs the triton package")
    _MODE.set(name)


def get_decode_kernel() -> str:
    return _MODE.value


@contextmanager
def decode_kernel_forced(name: str) -> Iterator[None]:
    """Decode calls run ``name`` inside the block (the start-up measurement's baseline)."""
    before = _MODE.value
    set_decode_kernel(name)
    try:
        yield
    finally:
        _MODE.value = before


@dataclass(frozen=True, slots=True)
class DecodeRoute:
    """Which decode-shaped calls of one backend run the Triton kernel under "auto": the batch
    sizes in ``table`` marked "triton" (the others: the backend's own kernel), FP8 pages when
    ``fp8`` (the kernel agreed with the scaled reference), and the kernel's launch
    configuration by batch size (``configs``, whatever the mode; sizes not in it: the
    default). A measured route is made once at start-up (``decode_tune.route_of``)."""

    table: Mapping[int, str] = field(default_factory=dict)
    fp8: bool = False
    configs: Mapping[int, DecodeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.table.items() if v not in ("fa", "triton")}
        if bad:
            raise KernelInputError(f"decode table entries must be 'fa' or 'triton', got {bad}")
        wrong = {k: v for k, v in self.configs.items() if not isinstance(v, DecodeConfig)}
        if wrong:
            raise KernelInputError(f"decode configs must be DecodeConfig values, got {wrong}")
        object.__setattr__(self, "table", dict(self.table))  # a copy the caller cannot change
        object.__setattr__(self, "configs", dict(self.configs))

    def serves_fp8(self, device: torch.device) -> bool:
        """Whether decode over FP8 pages on ``device`` runs the Triton kernel (sync-free, so
        it can be graph-captured) rather than the torch reference."""
        mode = _MODE.value
        return mode == "triton" or (mode == "auto" and device.type == "cuda" and self.fp8)

    def wanted(self, q: Tensor, scaled: bool) -> bool:
        """Whether the mode and the route send this decode-shaped call to the kernel."""
        mode = _MODE.value
        if mode == "triton":
            return q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        if mode != "auto" or q.device.type != "cuda":
            return False
        if scaled:
            return self.fp8
        return self.table.get(int(q.shape[0])) == "triton"


NO_ROUTE = DecodeRoute()  # a plain backend's: only the forced mode sends calls to the kernel
