"""FlashAttention backend for Hopper (sm90) GPUs.

Two packages are accepted, tried in this order, and imported only when a CUDA sm90 device asks
(``import kestrel_kernels`` never imports them):

- FA3 (``flash_attn_interface``, built from flash-attention's ``hopper/``):
  ``flash_attn_with_kvcache`` reads the paged cache directly (``page_table`` + ``cache_seqlens``,
  the cache viewed as ``[n_pages, page_size=1, Hkv, D]``) with varlen queries (``cu_seqlens_q``).
- flash-attn-4 (``flash_attn.cute``): its sm90 kernel has no paged KV, so the rows' pages are
  gathered into contiguous K/V once per call and addressed with ``cu_seqlens_k`` offsets plus
  ``seqused_k`` lengths (several segments of a row share one offset).

The bidirectional region needs no mask function: ``contract.build_segment_plan`` turns the masking
rule into varlen sequences that are plain right-aligned causal or non-causal attention, and
``contract.run_segmented`` makes one causal call and, only when regions are given, one non-causal
call. CPU tests run the same orchestration on a torch model of the kernel.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel_kernels.contract import (
    AttentionShape,
    BackendUnavailableError,
    build_segment_plan,
    run_segmented,
)

__all__ = ["FaProbe", "paged_attention_fa", "probe"]

_FA_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_HEAD_DIM_ALIGN = 8  # 16 bytes of fp16/bf16


@dataclass(frozen=True, slots=True)
class FaProbe:
    """Whether the ``fa`` backend can run on one device, with which package, and if not, why."""

    ok: bool
    flavor: str | None  # "fa3" or "cute"
    reason: str


def probe(device: torch.device | str | None = None) -> FaProbe:
    """Check (once per device) for CUDA, an sm90 GPU and an importable FlashAttention package."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if not torch.cuda.is_available():
            return FaProbe(
                False, None, "needs a CUDA device, and torch.cuda.is_available() is False"
            )
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return FaProbe(False, None, f"needs a CUDA device, got {dev.type}")
    if not torch.cuda.is_available():
        return FaProbe(False, None, "needs CUDA, and torch.cuda.is_available() is False")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _probe_cuda(index)


@functools.cache
def _probe_cuda(index: int) -> FaProbe:
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return FaProbe(
            False, None, f"needs a Hopper-class GPU (sm90), cuda:{index} is sm{major}{minor}"
        )
    errors = []
    for flavor, module in (("fa3", "flash_attn_interface"), ("cute", "flash_attn.cute")):
        try:
            importlib.import_module(module)
        except Exception as exc:  # broken CUDA builds raise more than ImportError
            errors.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        return FaProbe(True, flavor, f"using {module}")
    return FaProbe(
        False,
        None,
        "no FlashAttention package imports ("
        + "; ".join(errors)
        + "); install FA3 (flash-attention hopper/) or `pip install flash-attn-4`",
    )


def _fa3_kernel(
    q_THD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table_BP: Tensor,
    segs_per_row: int,
    seqlens_k: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    causal: bool,
    softmax_scale: float,
) -> Tensor:
    from flash_attn_interface import flash_attn_with_kvcache

    pages_SP = page_table_BP.repeat_interleave(segs_per_row, dim=0).contiguous()
    out = flash_attn_with_kvcache(
        q_THD,
        k_cache.unsqueeze(1),  # [n_pages, page_size=1, Hkv, D]
        v_cache.unsqueeze(1),
        cache_seqlens=seqlens_k,
        page_table=pages_SP,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return out[0] if isinstance(out, tuple) else out


def _cute_kernel(
    q_THD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table_BP: Tensor,
    segs_per_row: int,
    seqlens_k: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    causal: bool,
    softmax_scale: float,
) -> Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    batch, max_pages = page_table_BP.shape
    flat_pages = page_table_BP.reshape(-1).long()
    k_flat, v_flat = k_cache[flat_pages], v_cache[flat_pages]  # [B * max_pages, Hkv, D]
    # Every segment of row b starts at b's offset; seqused_k gives its length.
    starts = torch.arange(batch, device=q_THD.device, dtype=torch.int32) * max_pages
    total = torch.tensor([batch * max_pages], device=q_THD.device, dtype=torch.int32)
    cu_seqlens_k = torch.cat([starts.repeat_interleave(segs_per_row), total])
    out = flash_attn_varlen_func(
        q_THD,
        k_flat,
        v_flat,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_pages,
        seqused_k=seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return out[0] if isinstance(out, tuple) else out


_KERNELS: dict[str, Callable[..., Tensor]] = {"fa3": _fa3_kernel, "cute": _cute_kernel}


def check_fa_inputs(q: Tensor, shape: AttentionShape) -> FaProbe:
    """Raise ``BackendUnavailableError`` unless the ``fa`` backend can take these inputs."""
    found = probe(q.device)
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
    return found


def paged_attention_fa(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    shape: AttentionShape,
    *,
    seqused_q: Tensor | None,
    causal: bool,
    bidir_regions: Tensor | None,
    softmax_scale: float,
) -> Tensor:
    """``paged_attention`` on FlashAttention (inputs already validated; see ``contract``)."""
    found = check_fa_inputs(q, shape)
    assert found.flavor is not None
    plan = build_segment_plan(shape.q_len, seqused_k, seqused_q, bidir_regions, causal)
    return run_segmented(
        q, k_cache, v_cache, page_table.contiguous(), plan, _KERNELS[found.flavor], softmax_scale
    )
