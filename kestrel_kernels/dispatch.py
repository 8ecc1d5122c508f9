"""One validated attention call on a backend object: shared by the eager
``kestrel_kernels.paged_attention`` and the ``torch.compile`` op (``compile_op``), so the two
cannot disagree on which kernel runs, and the route decode-shaped calls take.

A decode-shaped call (one query position per row, no bidirectional regions) runs the Triton
flash-decoding kernel (``triton_decode``) where the process-wide mode and the backend's route
say so (``decode_route``): a 16-bit one only on a backend that ``swaps_decode``
(FlashAttention), one over FP8 pages (``kv_scales``) on any backend. Otherwise FP8 pages run
the scaled torch reference, and the rest the backend's own kernel. While ``torch.compile``
traces, the Triton kernel is never taken.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels import torch_backend
from kestrel_kernels.contract import AttentionShape, BackendUnavailableError, KvScales
from kestrel_kernels.decode_route import get_decode_kernel
from kestrel_kernels.fused import triton_available
from kestrel_kernels.plan import AttentionPlan

__all__ = ["run_attention", "uses_triton_decode"]


def uses_triton_decode(q: Tensor, shape: AttentionShape, plan: AttentionPlan, scaled: bool) -> bool:
    """Whether this call runs ``triton_decode`` (module doc): a decode shape, not tracing, a
    backend that ``swaps_decode`` or FP8 pages, and the mode and the backend's route say so."""
    mode = get_decode_kernel()
    if mode == "fa" or torch.compiler.is_compiling():
        return False
    if shape.q_len != 1 or plan.meta.bidir_regions is not None:
        return False
    backend = plan.backend
    if not (backend.swaps_decode or scaled) or not backend.decode_route.wanted(q, scaled):
        return False
    if not triton_available():
        if mode == "auto":
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
    """Inputs already validated (``shape``): a decode shape the route takes runs
    ``triton_decode``; else FP8 pages run the scaled torch reference on every device; else the
    plan's backend runs its own kernel (``AttentionBackend.kernel``)."""
    meta = plan.meta
    if uses_triton_decode(q, shape, plan, kv_scales is not None):
        from kestrel_kernels.triton_decode import paged_decode

        config = plan.backend.decode_route.configs.get(q.shape[0])
        out = paged_decode(q[:, 0], k_cache, v_cache, meta, softmax_scale=softmax_scale,
                           kv_scales=kv_scales, config=config)  # fmt: skip
        return out.unsqueeze(1)
    if kv_scales is not None:
        return torch_backend.paged_attention_scaled_torch(
            q, k_cache, v_cache, meta, shape, kv_scales, softmax_scale
        )
    return plan.backend.kernel(q, k_cache, v_cache, plan, shape, softmax_scale)
