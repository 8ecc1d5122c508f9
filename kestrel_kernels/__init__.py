"""Every kernel kestrel launches; attention and the KV write behind one contract (``contract``).

The rule for what lives here: every Triton or CUDA kernel, with its launcher, its torch
reference where it has one and its dispatch, whatever it computes; the code that decides what
to compute (the model, the crop wing, the runtime) lives above and calls in. So this package
holds attention and the KV write (this module's face), the fused ops (``fused``,
``triton_fused``), the MoE kernels (``moe``, ``triton_moe``), the flash-decoding kernel
(``triton_decode``) and the image resampler that cuts an image's crops on the GPU in libvips'
integer arithmetic (``triton_resample``, jitted in ``_resample_jit``; its tables and their
layout are the crop wing's, ``kestrel/crops/resample.py`` and ``stages.py``), with the pinned
memory, uploads and launch counting they share. It imports nothing of ``kestrel``.

Attention backends: ``"torch"`` (the reference: page-table gather, explicit mask, SDPA; CPU and
GPU) and ``"fa"`` (FlashAttention 4 from the ``flash-attn-4`` package, the ``gpu`` extra, on a
compute capability 9.x GPU; alias ``"fa3"``). ``"auto"`` picks ``"fa"`` for float16/bfloat16
inputs on such a GPU when the package imports, else ``"torch"``. FlashAttention is imported
lazily by the ``fa`` backend, so importing this package on a CPU machine never touches it.
Decode-shaped calls can instead run a Triton flash-decoding kernel (``triton_decode``): under
the default ``KESTREL_DECODE_KERNEL=auto`` a CUDA runtime measures both at start-up and keeps
the faster per batch size (``decode_tune``); ``set_decode_kernel`` / the variable force ``"fa"``
or ``"triton"`` (``dispatch``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel_kernels import compile_op, fa_backend, torch_backend
from kestrel_kernels.batch import AttentionBatch
from kestrel_kernels.contract import (
    BackendUnavailableError,
    KernelInputError,
    KvScales,
    default_scale,
    validate_attention_inputs,
    validate_write_kv_inputs,
)
from kestrel_kernels.dispatch import get_decode_kernel, run_attention, set_decode_kernel
from kestrel_kernels.segments import SegmentPlan, choose_segment_plan

__all__ = [
    "AttentionBatch",
    "AttentionPlan",
    "BackendUnavailableError",
    "KernelInputError",
    "KvScales",
    "attend",
    "available_backends",
    "get_decode_kernel",
    "get_default_backend",
    "paged_attention",
    "plan_attention",
    "plan_batch",
    "prepare_compile",
    "resolve_backend",
    "set_decode_kernel",
    "set_default_backend",
    "write_kv",
]

_BACKENDS = ("torch", "fa")
_ALIASES = {"fa3": "fa", "auto": "auto", "torch": "torch", "fa": "fa"}
_default_backend = "auto"


def _canonical(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in _ALIASES:
        raise KernelInputError(
            f"unknown attention backend {name!r}; choose one of 'auto', 'torch', 'fa'"
        )
    return _ALIASES[name.lower()]


def set_default_backend(name: str) -> None:
    """Set what ``backend="auto"`` means in this process: "auto" (default), "torch" or "fa"."""
    global _default_backend
    _default_backend = _canonical(name)


def get_default_backend() -> str:
    return _default_backend


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: the current CUDA device if any, else CPU)."""
    found = fa_backend.probe(device) if device is not None or torch.cuda.is_available() else None
    return ["torch", "fa"] if found is not None and found.ok else ["torch"]


def resolve_backend(name: str = "auto", device: torch.device | str | None = None) -> str:
    """Turn a backend name into the concrete backend used on ``device``.

    ``"auto"`` gives ``"fa"`` when FlashAttention can run on ``device`` (a CUDA device of compute
    capability 9.x, ``flash-attn-4`` importable), else ``"torch"``. ``"fa"`` where it cannot run
    raises ``BackendUnavailableError`` naming the package and the reason. ``device=None`` means
    the current CUDA device if any, else CPU.
    """
    name = _canonical(name)
    if name == "auto":
        name = _default_backend
    if name == "torch":
        return "torch"
    if device is None and not torch.cuda.is_available():
        device = "cpu"
    found = fa_backend.probe(device)
    if found.ok:
        return "fa"
    if name == "fa":
        raise BackendUnavailableError(
            f"attention backend 'fa' (FlashAttention, package {fa_backend.PACKAGE}) cannot run: "
            f"{found.reason}"
        )
    return "torch"


def _backend_for(backend: str, q: Tensor) -> str:
    return _resolve_for(backend, q.device, q.dtype)


def _traced_resolve(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``_resolve_for`` as dynamo sees it: after :func:`prepare_compile`, run once while tracing
    and kept in the graph as a constant."""
    return _resolve_for(backend, device, dtype)


def prepare_compile() -> None:
    """Call before ``torch.compile`` traces code that calls these kernels: the backend choice
    becomes a constant of the graph (probing FlashAttention is not traceable on CUDA). Kept out
    of import time because marking the function imports dynamo (about a second)."""
    torch.compiler.assume_constant_result(_traced_resolve)


def _resolve_for(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    name = _canonical(backend)
    explicit = name != "auto" or _default_backend != "auto"
    resolved = resolve_backend(name, device)
    if resolved == "fa" and not explicit and dtype not in (torch.float16, torch.bfloat16):
        return "torch"  # auto never sends float32 to a kernel that cannot take it
    return resolved


@dataclass(frozen=True, slots=True, eq=False)
class AttentionPlan:
    """What every layer of one forward shares: the resolved backend and, for ``fa``, the
    segment plan and the per-segment page table (built once, not once per layer).

    Made by :func:`plan_attention`; ``paged_attention(..., plan=)`` checks that it is handed
    the very metadata tensors the plan was built from.
    """

    backend: str
    q_len: int
    causal: bool
    page_table: Tensor
    seqused_k: Tensor
    seqused_q: Tensor | None
    bidir_regions: Tensor | None
    segments: SegmentPlan | None = None
    segment_pages: Tensor | None = None

    def check(self, q: Tensor, page_table, seqused_k, seqused_q, bidir_regions, causal) -> None:
        same = (
            self.page_table is page_table
            and self.seqused_k is seqused_k
            and self.seqused_q is seqused_q
            and self.bidir_regions is bidir_regions
            and self.causal == causal
            and self.q_len == q.shape[1]
        )
        if not same:
            raise KernelInputError(
                "paged_attention got a plan built for other metadata (page_table, seqused_k, "
                "seqused_q, bidir_regions, causal and q_len must be the plan's)"
            )


def plan_attention(
    q_len: int,
    page_table: Tensor,
    seqused_k: Tensor,
    *,
    seqused_q: Tensor | None = None,
    causal: bool = True,
    bidir_regions: Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    causal_rows: int | None = None,
    zero_padding: bool = True,
) -> AttentionPlan:
    """Build once per forward what every layer's ``paged_attention`` call would rebuild.

    No host synchronisation (the segment plan is computed on the device), so a forward that
    CUDA graphs capture records these few kernels once, not once per layer. ``causal_rows``:
    a host-known bound on each row's real queries outside ``bidir_regions`` (None = ``q_len``);
    with regions and a bound of at most ``segments.SINGLE_CALL_MAX_CAUSAL_ROWS``, ``fa`` makes
    one attention call per layer instead of two. ``zero_padding=False``: padding query rows
    (beyond ``seqused_q``) may hold anything instead of zeros (one masking launch per layer
    saved; for callers that drop those rows and whose rows do not mix, as a padded prefill's).
    """
    resolve = _traced_resolve if torch.compiler.is_compiling() else _resolve_for
    resolved = resolve(backend, page_table.device, dtype)
    segments = pages = None
    if resolved == "fa":
        segments = choose_segment_plan(
            q_len, seqused_k, seqused_q, bidir_regions, causal, causal_rows
        )
        if not zero_padding and segments.valid_BL is not None:
            segments = dataclasses.replace(segments, valid_BL=None)
        pages = fa_backend.pages_per_segment(page_table.contiguous(), segments.segs_per_row)
    return AttentionPlan(resolved, q_len, causal, page_table, seqused_k, seqused_q,
                         bidir_regions, segments, pages)  # fmt: skip


def plan_batch(batch: AttentionBatch, dtype: torch.dtype) -> AttentionPlan:
    """:func:`plan_attention` for one forward's :class:`AttentionBatch` (causal), its queries
    of ``dtype``: the plan every layer's :func:`attend` runs from."""
    return plan_attention(
        batch.q_len, batch.page_table, batch.seqused_k, seqused_q=batch.seqused_q, causal=True,
        bidir_regions=batch.bidir_regions, dtype=dtype, backend=batch.backend,
        causal_rows=batch.causal_rows, zero_padding=batch.zero_padding,
    )  # fmt: skip


def attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    *,
    kv_scales: KvScales | None = None,
) -> Tensor:
    """One layer's :func:`paged_attention` over the metadata ``plan`` was built from (by
    :func:`plan_batch` or :func:`plan_attention`): the same call, nothing listed twice."""
    return paged_attention(
        q, k_cache, v_cache, plan.page_table, plan.seqused_k, seqused_q=plan.seqused_q,
        causal=plan.causal, bidir_regions=plan.bidir_regions, plan=plan, kv_scales=kv_scales,
    )  # fmt: skip


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    *,
    seqused_q: Tensor | None = None,
    causal: bool = True,
    bidir_regions: Tensor | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
    plan: AttentionPlan | None = None,
    kv_scales: KvScales | None = None,
) -> Tensor:
    """Attention of ``q`` over one layer's paged K/V; returns ``[B, Lq, Hq, D]``.

    Shapes: ``q`` ``[B, Lq, Hq, D]``; ``k_cache``/``v_cache`` ``[n_pages, Hkv, D]``;
    ``page_table`` int32 ``[B, max_pages]``; ``seqused_k`` int32 ``[B]`` (keys per row, this
    call's new keys included, already written with ``write_kv``); ``seqused_q`` int32 ``[B]``
    (real queries per row, None = all ``Lq``); ``bidir_regions`` int32 ``[B, 2]`` of
    ``(start, end)`` (``start >= end`` = none). Masking: query ``i`` of a row sits at
    ``p = seqused_k - seqused_q + i`` and sees keys ``j <= p``, plus all of ``[start, end)`` when
    ``start <= p < end``; ``causal=False`` sees every valid key. Padding query rows are zeros.
    ``softmax_scale`` defaults to ``1/sqrt(D)``. Bad inputs raise ``KernelInputError``.
    ``plan``: the forward's :func:`plan_attention` (its backend replaces ``backend``).
    ``kv_scales``: the caches are FP8 pages with these scales (the contract's scaled-KV case);
    that case runs the torch reference, or on CUDA for decode shapes the Triton decode kernel
    unless ``set_decode_kernel("fa")`` (``kestrel_kernels.dispatch``).
    Under ``torch.compile`` the call is one opaque op (``kestrel_kernels.compile_op``).
    """
    if torch.compiler.is_compiling():
        return _traced_attention(
            q, k_cache, v_cache, page_table, seqused_k, seqused_q, causal, bidir_regions,
            softmax_scale, backend, plan, kv_scales,
        )  # fmt: skip
    shape = validate_attention_inputs(
        q, k_cache, v_cache, page_table, seqused_k, seqused_q, bidir_regions, kv_scales
    )
    if plan is not None:
        plan.check(q, page_table, seqused_k, seqused_q, bidir_regions, causal)
    return run_attention(
        q, k_cache, v_cache, page_table, seqused_k, shape,
        backend=plan.backend if plan is not None else _backend_for(backend, q),
        seqused_q=seqused_q, causal=causal, bidir_regions=bidir_regions,
        softmax_scale=default_scale(shape.head_dim, softmax_scale),
        segments=None if plan is None else plan.segments,
        segment_pages=None if plan is None else plan.segment_pages, kv_scales=kv_scales,
    )  # fmt: skip


def _traced_attention(
    q, k_cache, v_cache, page_table, seqused_k, seqused_q, causal, bidir_regions,
    softmax_scale, backend, plan, kv_scales,
) -> Tensor:  # fmt: skip
    """``paged_attention`` as dynamo sees it: ``torch.ops.kestrel.paged_attention``, whose eager
    implementation validates the inputs and runs the backend at run time."""
    if plan is not None:
        plan.check(q, page_table, seqused_k, seqused_q, bidir_regions, causal)
        name = plan.backend
    else:
        name = _traced_resolve(backend, q.device, q.dtype)
    return compile_op.attention_op(
        q, k_cache, v_cache, page_table, seqused_k, seqused_q=seqused_q, causal=causal,
        bidir_regions=bidir_regions, softmax_scale=default_scale(q.shape[-1], softmax_scale),
        backend=name, segments=None if plan is None else plan.segments,
        segment_pages=None if plan is None else plan.segment_pages, kv_scales=kv_scales,
    )  # fmt: skip


def write_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k: Tensor,
    v: Tensor,
    kv_scales: KvScales | None = None,
) -> None:
    """Write new keys/values in place: ``k_cache[slot_mapping[n]] = k[n]`` (same for v).

    ``slot_mapping``: int32/int64 ``[N]`` physical page per new position; ``k``, ``v``:
    ``[N, Hkv, D]`` in the caches' dtype. Slots < 0 are padding and are skipped: no page changes
    because of them (page 0, the reserved padding page, included). Shared by every backend.
    With ``kv_scales`` the caches are FP8 pages and K/V are quantised by those scales.
    """
    validate_write_kv_inputs(k_cache, v_cache, slot_mapping, k, v, kv_scales)
    if kv_scales is not None:
        torch_backend.write_kv_scaled(k_cache, v_cache, slot_mapping, k, v, kv_scales)
        return
    torch_backend.write_kv_indexed(k_cache, v_cache, slot_mapping, k, v)
