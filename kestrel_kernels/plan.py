"""What an attention backend is, and the plan every layer of one forward shares.

``AttentionBackend`` is the protocol the backends of ``kestrel_kernels.backends`` implement: a
``name``, ``plan(meta, q_len, ...)`` (once per forward) and ``forward(q, k_cache, v_cache,
plan)`` (once per layer), ``captures_decode`` and the kernel ``dispatch`` calls. An
``AttentionPlan`` is what a backend makes of one forward's metadata (``contract.AttentionMeta``)
once: the backend itself, the query length, the metadata and, for FlashAttention, the segment
plan and the per-segment page table. A plan carries the metadata it was built from, so a layer
cannot pass other metadata beside it.

``BACKENDS`` maps a backend's name to its object; ``backends`` fills it on import (the
``torch.library`` op, ``compile_op``, is handed the name and turns it back into the object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from kestrel_kernels.contract import AttentionMeta, AttentionShape, KvScales
from kestrel_kernels.segments import SegmentPlan

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMeta", "AttentionPlan"]


class AttentionBackend(Protocol):
    """Plans one forward's attention and runs each layer's (``kestrel_kernels.backends``)."""

    name: str
    captures_decode: bool  # decode steps on it can be replayed from CUDA graphs

    def plan(
        self, meta: AttentionMeta, q_len: int, *, causal_rows: int | None = None,
        zero_padding: bool = True,
    ) -> AttentionPlan: ...  # fmt: skip

    def forward(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, *,
        kv_scales: KvScales | None = None, softmax_scale: float | None = None,
    ) -> Tensor: ...  # fmt: skip

    def kernel(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan,
        shape: AttentionShape, softmax_scale: float,
    ) -> Tensor: ...  # fmt: skip


BACKENDS: dict[str, AttentionBackend] = {}


@dataclass(frozen=True, slots=True, eq=False)
class AttentionPlan:
    """What every layer of one forward shares (made by ``AttentionBackend.plan``): the
    backend, the query length ``q_len``, the metadata ``meta`` and, for ``fa``, the segment
    plan and the per-segment page table (built once, not once per layer)."""

    backend: AttentionBackend
    q_len: int
    meta: AttentionMeta
    segments: SegmentPlan | None = None
    segment_pages: Tensor | None = None
