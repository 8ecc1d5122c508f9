"""The attention backend: one object, chosen once at start-up, that plans and runs.

An ``AttentionBackend`` (the protocol, ``plan.AttentionBackend``) has a ``name``,
``plan(meta, q_len, ...)`` (what every layer of one forward shares, built once:
``plan.AttentionPlan``), ``forward(q, k_cache, v_cache, plan)`` (one layer's attention), its
decode route (``decode_route``, ``swaps_decode``: which decode calls run the Triton
flash-decoding kernel, ``dispatch``), and what a CUDA graph of it reads (``captures_decode``;
``decode_graph_inputs`` / ``prefill_graph_inputs``, the fixed buffers of ``graph_inputs``).
On ``BackendBase``:

- ``TorchBackend`` (``"torch"``): the reference, page-table gather, explicit mask, SDPA; CPU
  and GPU; it reads ``max(seqused_k)`` on the host, so nothing on it is graph-captured;
- ``FlashBackend`` (``"fa"``, alias ``"fa3"``): FlashAttention 4 (``fa_backend``) on a
  compute capability 9.x GPU; its plan holds the segment plan and the per-segment page table.
  ``FlashBackend(binding=fn)`` calls ``fn`` in place of the package's varlen function and
  skips its probe: the counting stand-in ``scripts/kernel_counts.py`` runs on a CPU;
- ``TritonDecode(base, route)``: ``base`` whose decode calls of the batch sizes ``route``
  measured faster (and, where the kernel agreed, over FP8 pages) run the Triton kernel; a
  CUDA runtime builds it from its start-up measurement (``decode_tune.route_of``).

``"auto"`` resolves to ``"fa"`` where FlashAttention can run (and, given a dtype, only for
float16 / bfloat16), else ``"torch"``; ``set_default_backend`` changes what it means for the
process. The runtime resolves its option once in its constructor (a name, or an object it
takes as is) and hands the object down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from kestrel_kernels import compile_op, fa_backend, torch_backend
from kestrel_kernels.contract import (
    AttentionShape,
    BackendUnavailableError,
    KernelInputError,
    KvScales,
    default_scale,
    validate_attention_inputs,
)
from kestrel_kernels.decode_route import NO_ROUTE, DecodeRoute
from kestrel_kernels.dispatch import run_attention
from kestrel_kernels.graph_inputs import DecodeGraphInputs, PrefillGraphInputs
from kestrel_kernels.plan import (
    BACKENDS,
    AttentionBackend,
    AttentionMeta,
    AttentionPlan,
    register,
)
from kestrel_kernels.segments import choose_segment_plan

__all__ = [
    "FLASH",
    "TORCH",
    "AttentionBackend",
    "BackendBase",
    "FlashBackend",
    "TorchBackend",
    "TritonDecode",
    "auto_backend",
    "available_backends",
    "get_default_backend",
    "prepare_compile",
    "resolve_backend",
    "set_default_backend",
]

_ALIASES = {"fa3": "fa", "auto": "auto", "torch": "torch", "fa": "fa"}
_default_backend = "auto"


class BackendBase:
    """What the backends share: ``forward`` (validation, then ``dispatch``) and a plan of
    the metadata alone (module doc)."""

    name = ""
    key = ""  # the torch.library op's handle (plan.register): the name for registered ones
    captures_decode = False  # decode steps on it can be replayed from CUDA graphs
    swaps_decode = False  # its 16-bit decode calls may run the Triton decode kernel
    decode_route: DecodeRoute = NO_ROUTE  # which decode calls do (decode_route)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def plan(
        self, meta: AttentionMeta, q_len: int, *, causal_rows: int | None = None,
        zero_padding: bool = True,
    ) -> AttentionPlan:  # fmt: skip
        """What every layer shares (no host sync). ``causal_rows``: a host-known bound on a
        row's real queries outside its regions (None: ``q_len``); ``zero_padding=False``:
        padding query rows may hold anything (for callers that drop them)."""
        return AttentionPlan(self, q_len, meta)

    def forward(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, *,
        kv_scales: KvScales | None = None, softmax_scale: float | None = None,
    ) -> Tensor:  # fmt: skip
        """One layer's attention over ``plan``'s metadata (``kestrel_kernels.paged_attention``
        says what it computes). Under ``torch.compile`` it is one opaque op (``compile_op``)."""
        if q.shape[1] != plan.q_len:
            raise KernelInputError(
                f"the plan is for {plan.q_len} queries per row, q has {q.shape[1]}"
            )
        if torch.compiler.is_compiling():
            scale = default_scale(q.shape[-1], softmax_scale)
            return compile_op.attention_op(q, k_cache, v_cache, plan, scale, kv_scales)
        shape = validate_attention_inputs(q, k_cache, v_cache, plan.meta, kv_scales)
        scale = default_scale(shape.head_dim, softmax_scale)
        return run_attention(q, k_cache, v_cache, plan, shape, scale, kv_scales)

    def kernel(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan,
        shape: AttentionShape, softmax_scale: float,
    ) -> Tensor:  # fmt: skip
        """The backend's own kernel for validated, unscaled inputs (``dispatch``)."""
        raise NotImplementedError

    def decode_graph_inputs(
        self, size: int, device: torch.device, lanes: int = 0
    ) -> DecodeGraphInputs:
        """The fixed buffers a decode graph of ``size`` rows reads, with ``lanes`` more
        per-row lanes for the caller (``graph_inputs``)."""
        return DecodeGraphInputs.allocate(self, size, device, lanes)

    def prefill_graph_inputs(
        self, rows: int, tokens: int, device: torch.device, *, regions: bool,
        causal_rows: int | None,
    ) -> PrefillGraphInputs:  # fmt: skip
        """The fixed buffers a prefill graph of ``[rows, tokens]`` reads (``graph_inputs``)."""
        return PrefillGraphInputs.allocate(self, rows, tokens, device, regions=regions,
                                           causal_rows=causal_rows)  # fmt: skip


class TorchBackend(BackendBase):
    """The reference: gather through the page table, explicit mask, SDPA (``torch_backend``)."""

    name = key = "torch"

    def kernel(self, q, k_cache, v_cache, plan, shape, softmax_scale) -> Tensor:
        return torch_backend.paged_attention_torch(
            q, k_cache, v_cache, plan.meta, shape, softmax_scale
        )


class FlashBackend(BackendBase):
    """FlashAttention 4 over the forward's segments (``fa_backend``, ``segments``);
    ``binding``: a stand-in for the package's varlen function (module doc; None: the real)."""

    name = "fa"
    captures_decode = True
    swaps_decode = True

    def __init__(self, binding: Callable[..., object] | None = None) -> None:
        self.binding = binding
        self.key = self.name if binding is None else register(self)  # plain: FLASH's equal

    def __repr__(self) -> str:
        return "FlashBackend()" if self.binding is None else f"FlashBackend({self.binding!r})"

    def plan(self, meta, q_len, *, causal_rows=None, zero_padding=True) -> AttentionPlan:
        segments = choose_segment_plan(
            q_len, meta.seqused_k, meta.seqused_q, meta.bidir_regions, meta.causal, causal_rows
        )
        if not zero_padding and segments.valid_BL is not None:
            segments = dataclasses.replace(segments, valid_BL=None)
        pages = fa_backend.pages_per_segment(meta.page_table.contiguous(), segments.segs_per_row)
        return AttentionPlan(self, q_len, meta, segments, pages)

    def kernel(self, q, k_cache, v_cache, plan, shape, softmax_scale) -> Tensor:
        if q.numel() == 0:
            return q.new_zeros(q.shape)
        return fa_backend.paged_attention_fa(q, k_cache, v_cache, plan, shape, softmax_scale,
                                             binding=self.binding)  # fmt: skip


class TritonDecode(BackendBase):
    """``base`` on a measured decode route (module doc): its plans and kernel, and the Triton
    kernel for the decode calls ``route`` sends there (``dispatch``)."""

    def __init__(self, base: AttentionBackend, route: DecodeRoute) -> None:
        self.base, self.decode_route = base, route
        self.name, self.captures_decode = base.name, base.captures_decode
        self.swaps_decode = base.swaps_decode
        self.key = register(self)

    def __repr__(self) -> str:
        return f"TritonDecode({self.base!r}, {self.decode_route!r})"

    def plan(self, meta, q_len, *, causal_rows=None, zero_padding=True) -> AttentionPlan:
        base = self.base.plan(meta, q_len, causal_rows=causal_rows, zero_padding=zero_padding)
        return dataclasses.replace(base, backend=self)  # dispatch reads this object's route

    def kernel(self, q, k_cache, v_cache, plan, shape, softmax_scale) -> Tensor:
        return self.base.kernel(q, k_cache, v_cache, plan, shape, softmax_scale)


TORCH, FLASH = TorchBackend(), FlashBackend()
BACKENDS.update({TORCH.name: TORCH, FLASH.name: FLASH})


def _canonical(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in _ALIASES:
        raise KernelInputError(
            f"unknown attention backend {name!r}; choose one of 'auto', 'torch', 'fa'"
        )
    return _ALIASES[name.lower()]


def set_default_backend(name: str) -> None:
    """Set what ``"auto"`` means in this process: "auto" (default), "torch" or "fa"."""
    global _default_backend
    _default_backend = _canonical(name)


def get_default_backend() -> str:
    return _default_backend


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: the current CUDA device if any, else CPU)."""
    found = fa_backend.probe(device) if device is not None or torch.cuda.is_available() else None
    return ["torch", "fa"] if found is not None and found.ok else ["torch"]


def resolve_backend(
    name: str | AttentionBackend = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend object ``name`` means on ``device`` (None: the current CUDA device if any,
    else CPU) for queries of ``dtype`` (None: any); an object is taken as it is.

    ``"auto"`` gives ``"fa"`` when FlashAttention can run on ``device`` (a CUDA device of compute
    capability 9.x, ``flash-attn-4`` importable; given a ``dtype``, only float16 / bfloat16),
    else ``"torch"``. ``"fa"`` where it cannot run raises ``BackendUnavailableError`` naming the
    package and the reason.
    """
    if isinstance(name, BackendBase):
        return name
    wanted = _canonical(name)
    explicit = wanted != "auto" or _default_backend != "auto"
    if wanted == "auto":
        wanted = _default_backend
    if wanted == "torch":
        return TORCH
    if device is None and not torch.cuda.is_available():
        device = "cpu"
    found = fa_backend.probe(device)
    if not found.ok:
        if wanted == "fa":
            raise BackendUnavailableError(
                f"attention backend 'fa' (FlashAttention, package {fa_backend.PACKAGE}) cannot "
                f"run: {found.reason}"
            )
        return TORCH
    if dtype is not None and not explicit and dtype not in (torch.float16, torch.bfloat16):
        return TORCH  # auto never sends float32 to a kernel that cannot take it
    return FLASH


def _traced_resolve(device: torch.device, dtype: torch.dtype) -> str:
    """``auto_backend``'s name as dynamo sees it: after :func:`prepare_compile`, run once while
    tracing and kept in the graph as a constant."""
    return resolve_backend("auto", device, dtype).name


def prepare_compile() -> None:
    """Call before ``torch.compile`` traces code that resolves ``"auto"`` per call: the choice
    becomes a constant of the graph (probing FlashAttention is not traceable on CUDA). Kept out
    of import time because marking the function imports dynamo (about a second)."""
    torch.compiler.assume_constant_result(_traced_resolve)


def auto_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``resolve_backend("auto", device, dtype)``, traceable (see :func:`prepare_compile`)."""
    if torch.compiler.is_compiling():
        return BACKENDS[_traced_resolve(device, dtype)]
    return resolve_backend("auto", device, dtype)
