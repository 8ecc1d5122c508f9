"""One validated attention call on a resolved backend: shared by the eager
``kestrel_kernels.paged_attention`` and the ``torch.compile`` op (``compile_op``), so the two
cannot disagree on which kernel runs.

The decode kernel switch (opt-in): ``set_decode_kernel("triton")`` or
``KESTREL_DECODE_KERNEL=triton`` (read at import) sends decode-shaped calls (one query
position per row, no bidirectional regions) to the Triton flash-decoding kernel
(``triton_decode``) on CUDA, both where ``fa`` would run and for FP8 pages (``kv_scales``), which
otherwise run the torch reference. On a CPU it applies only under ``TRITON_INTERPRET=1`` (the
tests); while ``torch.compile`` traces, today's path stays. The default is "fa": the kernel
has not been timed on a GPU yet.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kestrel_kernels import fa_backend, torch_backend
from kestrel_kernels.contract import (
    AttentionShape,
    BackendUnavailableError,
    KernelInputError,
    KvScales,
)
from kestrel_kernels.fused import triton_available
from kestrel_kernels.segments import SegmentPlan

__all__ = ["get_decode_kernel", "run_attention", "set_decode_kernel", "uses_triton_decode"]

_DECODE_CHOICES = ("fa", "triton")
_decode_kernel = os.environ.get("KESTREL_DECODE_KERNEL", "fa")
if _decode_kernel not in _DECODE_CHOICES:
    raise KernelInputError(
        f"KESTREL_DECODE_KERNEL={_decode_kernel!r}; choose one of {_DECODE_CHOICES}"
    )


def set_decode_kernel(name: str) -> None:
    """What decode-shaped calls run: "fa" (today's path, the default) or "triton"."""
    global _decode_kernel
    if name not in _DECODE_CHOICES:
        raise KernelInputError(f"unknown decode kernel {name!r}; choose one of {_DECODE_CHOICES}")
    if name == "triton" and not triton_available():
        raise BackendUnavailableError("decode kernel 'triton' needs the triton package")
    _decode_kernel = name


def get_decode_kernel() -> str:
    return _decode_kernel


def uses_triton_decode(
    q: Tensor, shape: AttentionShape, backend: str, bidir_regions: Tensor | None, scaled: bool
) -> bool:
    """Whether this call runs ``triton_decode`` (module doc): switched on, not tracing, a
    decode shape, backend "fa" or FP8 pages, on CUDA (or a CPU under the interpreter)."""
    if _decode_kernel != "triton" or torch.compiler.is_compiling():
        return False
    if shape.q_len != 1 or bidir_regions is not None or not (backend == "fa" or scaled):
        return False
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if not triton_available():
        raise BackendUnavailableError("decode kernel 'triton' needs the triton package")
    return True


def run_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    shape: AttentionShape,
    *,
    backend: str,
    seqused_q: Tensor | None,
    causal: bool,
    bidir_regions: Tensor | None,
    softmax_scale: float,
    segments: SegmentPlan | None,
    segment_pages: Tensor | None,
    kv_scales: KvScales | None,
) -> Tensor:
    """Inputs already validated (``shape``) and ``backend`` resolved ("torch" or "fa"): a
    decode shape with the decode switch on runs ``triton_decode``; else FP8 pages run the
    scaled torch reference on every device; ``fa`` runs the forward's segments (an empty ``q``
    needs no kernel); else the torch reference."""
    if uses_triton_decode(q, shape, backend, bidir_regions, kv_scales is not None):
        from kestrel_kernels.triton_decode import paged_decode

        out = paged_decode(
            q[:, 0], k_cache, v_cache, page_table, seqused_k, softmax_scale=softmax_scale,
            kv_scales=kv_scales, seqused_q=seqused_q,
        )  # fmt: skip
        return out.unsqueeze(1)
    kwargs = dict(
        seqused_q=seqused_q, causal=causal, bidir_regions=bidir_regions,
        softmax_scale=softmax_scale,
    )  # fmt: skip
    if kv_scales is not None:
        return torch_backend.paged_attention_scaled_torch(
            q, k_cache, v_cache, page_table, seqused_k, shape, scales=kv_scales, **kwargs
        )
    if backend == "fa":
        if q.numel() == 0:
            return q.new_zeros(q.shape)
        return fa_backend.paged_attention_fa(
            q, k_cache, v_cache, page_table, seqused_k, shape, **kwargs, segments=segments,
            segment_pages=segment_pages,
        )  # fmt: skip
    return torch_backend.paged_attention_torch(
        q, k_cache, v_cache, page_table, seqused_k, shape, **kwargs
    )
