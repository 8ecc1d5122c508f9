"""One validated attention call on a resolved backend: shared by the eager
``kestrel_kernels.paged_attention`` and the ``torch.compile`` op (``compile_op``), so the two
cannot disagree on which kernel runs.

The decode kernel switch: ``set_decode_kernel`` or ``KESTREL_DECODE_KERNEL`` (read at import)
decides which decode-shaped calls (one query position per row, no bidirectional regions) run
the Triton flash-decoding kernel (``triton_decode``) instead of ``fa``, or, for FP8 pages
(``kv_scales``), instead of the torch reference:

- "auto" (the default): on CUDA, the batch sizes ``set_decode_table`` gives to "triton" --
  a CUDA runtime measures both kernels at start-up and sets it (``decode_tune.py``) -- and
  FP8 pages once the start-up check found the kernel agreeing with the scaled reference
  (``fp8=True``; the reference reads lengths on the host, so it cannot be captured);
- "triton": every decode-shaped call on CUDA, and on a CPU under ``TRITON_INTERPRET=1`` (the
  tests);
- "fa": never.

While ``torch.compile`` traces, today's path stays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor

from kestrel_kernels import torch_backend
from kestrel_kernels.contract import (
    AttentionShape,
    BackendUnavailableError,
    KernelInputError,
    KvScales,
    env_choice,
)
from kestrel_kernels.fused import triton_available
from kestrel_kernels.plan import AttentionPlan
from kestrel_kernels.triton_decode import DecodeConfig

__all__ = [
    "decode_configs",
    "decode_kernel_forced",
    "decode_table",
    "fp8_checked",
    "get_decode_kernel",
    "run_attention",
    "set_decode_kernel",
    "set_decode_table",
    "triton_serves_fp8",
    "uses_triton_decode",
]

_DECODE_CHOICES = ("auto", "fa", "triton")
_decode_kernel = env_choice("KESTREL_DECODE_KERNEL", _DECODE_CHOICES, "auto")
_decode_table: dict[int, str] = {}  # batch size -> "fa" | "triton", for "auto"
_decode_configs: dict[int, DecodeConfig] = {}  # batch size -> the Triton launch measured best
_fp8_checked = False  # under "auto": the kernel agreed with the scaled reference at start-up


def set_decode_kernel(name: str) -> None:
    """What decode-shaped calls run: "auto" (the default), "fa" or "triton" (module doc)."""
    global _decode_kernel
    if name not in _DECODE_CHOICES:
        raise KernelInputError(f"unknown decode kernel {name!r}; choose one of {_DECODE_CHOICES}")
    if name == "triton" and not triton_available():
        raise BackendUnavailableError("decode kernel 'triton' needs the triton package")
    _decode_kernel = name


def get_decode_kernel() -> str:
    return _decode_kernel


def set_decode_table(
    table: Mapping[int, str],
    *,
    fp8: bool = False,
    configs: Mapping[int, DecodeConfig] | None = None,
) -> None:
    """Under "auto": the kernel of each decode batch size (sizes not in it run "fa"), and
    whether the Triton kernel serves FP8 pages (``fp8``). ``configs``: the Triton kernel's
    launch configuration by batch size, whatever the mode (sizes not in it: the default)."""
    global _fp8_checked
    bad = {k: v for k, v in table.items() if v not in ("fa", "triton")}
    if bad:
        raise KernelInputError(f"decode table entries must be 'fa' or 'triton', got {bad}")
    wrong = {k: v for k, v in (configs or {}).items() if not isinstance(v, DecodeConfig)}
    if wrong:
        raise KernelInputError(f"decode configs must be DecodeConfig values, got {wrong}")
    _decode_table.clear()
    _decode_table.update(table)
    _decode_configs.clear()
    _decode_configs.update(configs or {})
    _fp8_checked = bool(fp8)


def decode_configs() -> dict[int, DecodeConfig]:
    return dict(_decode_configs)


def decode_table() -> dict[int, str]:
    return dict(_decode_table)


def fp8_checked() -> bool:
    return _fp8_checked


@contextmanager
def decode_kernel_forced(name: str) -> Iterator[None]:
    """Decode calls run ``name`` inside the block (the start-up measurement's baseline)."""
    global _decode_kernel
    before = _decode_kernel
    set_decode_kernel(name)
    try:
        yield
    finally:
        _decode_kernel = before


def triton_serves_fp8(device: torch.device) -> bool:
    """Whether decode over FP8 pages on ``device`` runs the Triton kernel (sync-free, so it can
    be graph-captured) rather than the torch reference."""
    if _decode_kernel == "triton":
        return True
    return _decode_kernel == "auto" and device.type == "cuda" and _fp8_checked


def _wanted(q: Tensor, scaled: bool) -> bool:
    if _decode_kernel == "triton":
        return q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if _decode_kernel != "auto" or q.device.type != "cuda":
        return False
    if scaled:
        return _fp8_checked
    return _decode_table.get(int(q.shape[0])) == "triton"


def uses_triton_decode(q: Tensor, shape: AttentionShape, plan: AttentionPlan, scaled: bool) -> bool:
    """Whether this call runs ``triton_decode`` (module doc): chosen, not tracing, a decode
    shape, the ``fa`` backend or FP8 pages, on CUDA (or a CPU under the interpreter)."""
    if _decode_kernel == "fa" or torch.compiler.is_compiling():
        return False
    if shape.q_len != 1 or plan.meta.bidir_regions is not None:
        return False
    if not (plan.backend.name == "fa" or scaled) or not _wanted(q, scaled):
        return False
    if not triton_available():
        if _decode_kernel == "auto":
            return False
        raise BackendUnavailableError("decode kernel 'triton' needs the triton package")
    return True


def run_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    shape: AttentionShape,
    softmax_scale: float,
    kv_scales: KvScales | None,
) -> Tensor:
    """Inputs already validated (``shape``): a decode shape with the decode switch on runs
    ``triton_decode``; else FP8 pages run the scaled torch reference on every device; else the
    plan's backend runs its own kernel (``AttentionBackend.kernel``)."""
    meta = plan.meta
    if uses_triton_decode(q, shape, plan, kv_scales is not None):
        from kestrel_kernels.triton_decode import paged_decode

        config = _decode_configs.get(q.shape[0])
        out = paged_decode(q[:, 0], k_cache, v_cache, meta, softmax_scale=softmax_scale,
                           kv_scales=kv_scales, config=config)  # fmt: skip
        return out.unsqueeze(1)
    if kv_scales is not None:
        return torch_backend.paged_attention_scaled_torch(
            q, k_cache, v_cache, meta, shape, kv_scales, softmax_scale
        )
    return plan.backend.kernel(q, k_cache, v_cache, plan, shape, softmax_scale)
