"""FlashAttention backend for Hopper (sm90) GPUs, through the ``flash-attn-4`` package.

The binding is ``flash_attn.cute.flash_attn_varlen_func`` (FlashAttention 4, written in the CuTe
DSL and compiled at first use). Its sm90 forward reads a paged cache directly: the cache is viewed
as ``[n_pages, page_size=1, Hkv, D]``, each varlen query sequence gets a ``page_table`` row and a
``seqused_k`` key count, and causal masking is right-aligned. Pages of one position cannot be
loaded by TMA, so the kernel uses its cp.async paged-KV path (``paged_kv_non_tma``).

The package is imported only when a CUDA sm90 device asks for it (``import kestrel_kernels``
never imports it); ``load_binding`` is the single import point. A backend object may bring
its own binding instead (``FlashBackend(binding=...)``: the counting stand-in, the CPU
contract tests' recording fakes), which runs without the package or its probe.

The bidirectional region needs no mask function: ``segments`` turns the masking rule into varlen
sequences that are plain right-aligned causal or non-causal attention, and
``segments.run_segmented`` calls the kernel over them. A miss with an image and a short question
is one non-causal call (BOS + image as one sequence, each text query a one-row sequence,
``segments.build_single_call_plan``); with a long text suffix, one non-causal pass over BOS +
image and one causal pass over the text; an append or a decode step (no region reaches their
queries) is one causal call.

``KESTREL_FA_PAGED=0`` switches to a fallback that gathers each row's pages into contiguous K/V
first and addresses them with ``cu_seqlens_k`` offsets (for builds whose paged path misbehaves).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel_kernels.contract import (
    AttentionShape,
    BackendUnavailableError,
)
from kestrel_kernels.plan import AttentionPlan
from kestrel_kernels.segments import VarlenSeqs, run_segmented

__all__ = ["INSTALL_HINT", "PACKAGE", "FaProbe", "load_binding", "paged_attention_fa", "probe"]

PACKAGE = "flash-attn-4"
MODULE = "flash_attn.cute"
INSTALL_HINT = "pip install 'kestrel[gpu]' (which installs flash-attn-4)"

_FA_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_HEAD_DIM_ALIGN = 8  # 16 bytes of fp16/bf16


@dataclass(frozen=True, slots=True)
class FaProbe:
    """Whether the ``fa`` backend can run on one device, and if not, why."""

    ok: bool
    reason: str


def probe(device: torch.device | str | None = None) -> FaProbe:
    """Check (once per device) for CUDA, an sm90 GPU and an importable ``flash-attn-4``."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if not torch.cuda.is_available():
            return FaProbe(False, "needs a CUDA device, and torch.cuda.is_available() is False")
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return FaProbe(False, f"needs a CUDA device, got {dev.type}")
    if not torch.cuda.is_available():
        return FaProbe(False, "needs CUDA, and torch.cuda.is_available() is False")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _probe_cuda(index)


@functools.cache
def _probe_cuda(index: int) -> FaProbe:
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return FaProbe(
            False,
            f"needs a Hopper-class GPU (compute capability 9.x), cuda:{index} is {major}.{minor}",
        )
    try:
        load_binding()
    except Exception as exc:  # a broken CUDA build raises more than ImportError
        return FaProbe(
            False,
            f"the {PACKAGE} package does not import ({MODULE}: {type(exc).__name__}: {exc}); "
            f"install it with: {INSTALL_HINT}",
        )
    return FaProbe(True, f"using {MODULE} from {PACKAGE}")


def load_binding() -> Callable[..., object]:
    """``flash_attn.cute.flash_attn_varlen_func`` (imported on first use)."""
    return importlib.import_module(MODULE).flash_attn_varlen_func


def _paged_enabled() -> bool:
    return os.environ.get("KESTREL_FA_PAGED", "1") != "0"


def _first(out: object) -> Tensor:
    """The binding returns ``(out, lse)``; keep the output."""
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _paged_kernel(
    q_THD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table_BP: Tensor,
    seqs: VarlenSeqs,
    *,
    pages_SP: Tensor | None = None,
    binding: Callable[..., object] | None = None,
) -> Tensor:
    """One varlen call over the paged cache; sequence ``s`` reads page-table row ``s // segs``
    (``pages_SP``: those rows already expanded, one per sequence); ``binding``: the varlen
    function (None: the package's)."""
    if pages_SP is None:
        pages_SP = pages_per_segment(page_table_BP, seqs.segs_per_row)
    out = (binding or load_binding())(
        q_THD,
        k_cache.unsqueeze(1),  # [n_pages, page_size=1, Hkv, D]
        v_cache.unsqueeze(1),
        cu_seqlens_q=seqs.cu_seqlens_q,
        max_seqlen_q=seqs.max_seqlen_q,
        seqused_k=seqs.seqlens_k,
        page_table=pages_SP,
        softmax_scale=seqs.softmax_scale,
        causal=seqs.causal,
    )
    return _first(out)


def _gather_kernel(
    q_THD: Tensor, k_cache: Tensor, v_cache: Tensor, page_table_BP: Tensor, seqs: VarlenSeqs, *,
    binding: Callable[..., object] | None = None,
) -> Tensor:  # fmt: skip
    """Fallback: gather the rows' pages into contiguous K/V, then ``cu_seqlens_k`` offsets."""
    batch, max_pages = page_table_BP.shape
    flat = page_table_BP.reshape(-1).long()
    k_flat, v_flat = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    # Every segment of row b starts at b's offset; seqused_k gives its length.
    starts = torch.arange(batch, device=q_THD.device, dtype=torch.int32) * max_pages
    total = torch.full((1,), batch * max_pages, device=q_THD.device, dtype=torch.int32)
    cu_seqlens_k = torch.cat([starts.repeat_interleave(seqs.segs_per_row), total])
    out = (binding or load_binding())(
        q_THD,
        k_flat,  # [B * max_pages, Hkv, D]
        v_flat,
        cu_seqlens_q=seqs.cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=seqs.max_seqlen_q,
        max_seqlen_k=max_pages,
        seqused_k=seqs.seqlens_k,
        softmax_scale=seqs.softmax_scale,
        causal=seqs.causal,
    )
    return _first(out)


def check_fa_inputs(q: Tensor, shape: AttentionShape, *, probed: bool = True) -> None:
    """Raise ``BackendUnavailableError`` unless the ``fa`` backend can take these inputs
    (``probed=False``: the package is not needed, a stand-in binding runs)."""
    found = probe(q.device) if probed else FaProbe(True, "a stand-in binding")
    if not found.ok:
        raise BackendUnavailableError(f"attention backend 'fa' cannot run: {found.reason}")
    if q.dtype not in _FA_DTYPES:
        raise BackendUnavailableError(
            f"attention backend 'fa' needs float16/bfloat16, got {q.dtype}; use backend='torch'"
        )
    if shape.head_dim > _MAX_HEAD_DIM or shape.head_dim % _HEAD_DIM_ALIGN:
        raise BackendUnavailableError(
            f"attention backend 'fa' needs head_dim <= {_MAX_HEAD_DIM} and a multiple of "
            f"{_HEAD_DIM_ALIGN}, got {shape.head_dim}; use backend='torch'"
        )


def pages_per_segment(page_table_BP: Tensor, segs_per_row: int) -> Tensor:
    """``[B, P] -> [B * segs, P]``: every segment of a row reads the row's pages."""
    if segs_per_row == 1:
        return page_table_BP
    return page_table_BP.repeat_interleave(segs_per_row, dim=0)


def paged_attention_fa(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    shape: AttentionShape,
    softmax_scale: float,
    *,
    binding: Callable[..., object] | None = None,
) -> Tensor:
    """``paged_attention`` on FlashAttention (inputs already validated; see ``contract``)
    over the forward's ``plan`` (``backends.FlashBackend.plan``: its segments and, for the
    paged kernel, the per-segment page table, built once for all layers); ``binding``: a
    stand-in for the package's varlen function (None: the package's, probed)."""
    check_fa_inputs(q, shape, probed=binding is None)
    segments, page_table = plan.segments, plan.meta.page_table
    assert segments is not None, "an fa plan holds its segments"
    kernel: Callable[..., Tensor] = functools.partial(_gather_kernel, binding=binding)
    if _paged_enabled():
        segment_pages = plan.segment_pages
        if segment_pages is None:
            segment_pages = pages_per_segment(page_table.contiguous(), segments.segs_per_row)
        kernel = functools.partial(_paged_kernel, pages_SP=segment_pages, binding=binding)
    else:
        page_table = page_table.contiguous()
    return run_segmented(q, k_cache, v_cache, page_table, segments, kernel, softmax_scale)
