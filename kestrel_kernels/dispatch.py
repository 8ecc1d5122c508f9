"""One validated attention call on a resolved backend: shared by the eager
``kestrel_kernels.paged_attention`` and the ``torch.compile`` op (``compile_op``), so the two
cannot disagree on which kernel runs.
"""

from __future__ import annotations

from torch import Tensor

from kestrel_kernels import fa_backend, torch_backend
from kestrel_kernels.contract import AttentionShape, KvScales
from kestrel_kernels.segments import SegmentPlan

__all__ = ["run_attention"]


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
    """Inputs already validated (``shape``) and ``backend`` resolved ("torch" or "fa"): FP8
    pages run the scaled torch reference on every device; ``fa`` runs the forward's segments
    (an empty ``q`` needs no kernel); else the torch reference."""
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
