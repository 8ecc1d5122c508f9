"""What an attention backend is, and the plan every layer of one forward shares.

``AttentionBackend`` is the protocol the backends of ``kestrel_kernels.backends`` implement: a
``name``, ``plan(meta, q_len, ...)`` (once per forward) and ``forward(q, k_cache, v_cache,
plan)`` (once per layer), the kernel ``dispatch`` calls and its decode route
(``decode_route``). What a backend that CUDA graphs replay adds, the fixed buffers a graph
reads, is ``graph_inputs.GraphedBackend``. An
``AttentionPlan`` is what a backend makes of one forward's metadata (``contract.AttentionMeta``)
once: the backend itself, the query length, the metadata and, for FlashAttention, the segment
plan and the per-segment page table. A plan carries the metadata it was built from, so a layer
cannot pass other metadata beside it.

``BACKENDS`` maps a backend's name to its object; ``backends`` fills it on import. The
``torch.library`` op (``compile_op``) is handed a backend's ``key`` and turns it back into the
object (``backend_of``): a registered backend's key is its name; any other object (a measured
``TritonDecode``, a stand-in) is registered under a key of its own when it is made, for as long
as it lives (``register``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from kestrel_kernels.contract import AttentionMeta, AttentionShape, KvScales
from kestrel_kernels.segments import SegmentPlan

if TYPE_CHECKING:
    from kestrel_kernels.decode_route import DecodeRoute

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMeta", "AttentionPlan", "backend_of",
           "register"]  # fmt: skip


class AttentionBackend(Protocol):
    """Plans one forward's attention and runs each layer's (``kestrel_kernels.backends``)."""

    name: str
    key: str  # what the torch.library op is handed: the name, or ``register``'s key
    captures_decode: bool  # decode steps on it can be replayed from CUDA graphs
    swaps_decode: bool  # its 16-bit decode calls may run the Triton decode kernel (dispatch)
    decode_route: DecodeRoute  # which decode calls do (decode_route)

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
_LIVE: weakref.WeakValueDictionary[str, AttentionBackend] = weakref.WeakValueDictionary()


def register(backend: AttentionBackend) -> str:
    """A key of its own for ``backend`` (an object that is not the registered one of its
    name), kept while the object lives. Called when the object is made, never while tracing
    (dynamo cannot trace a weak reference)."""
    key = f"{backend.name}@{id(backend):x}"
    _LIVE[key] = backend
    return key


def backend_of(key: str) -> AttentionBackend:
    """The backend whose ``key`` is ``key``."""
    found = BACKENDS.get(key) or _LIVE.get(key)
    if found is None:
        raise KeyError(f"no live attention backend {key!r}")
    return found


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
