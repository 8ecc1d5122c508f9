"""The attention / KV-write contract shared by every backend.

``paged_attention(q, k_cache, v_cache, AttentionMeta(page_table, seqused_k, seqused_q,
bidir_regions, causal), softmax_scale=)`` with

- ``q_BLHD``: ``[B, Lq, Hq, D]``; row ``b`` holds ``seqused_q[b]`` real queries (all ``Lq`` when
  ``seqused_q`` is None), the rest is padding and comes back as zeros.
- ``k_cache`` / ``v_cache``: ``[n_pages, Hkv, D]``, one layer's paged storage; page_size is 1, so a
  physical page is one position. ``Hq`` is a multiple of ``Hkv``: KV head ``h`` serves query heads
  ``[h*g, (h+1)*g)`` with ``g = Hq // Hkv``.
- ``page_table``: int32 ``[B, max_pages]``, logical position -> physical page (padding = page 0).
- ``seqused_k``: int32 ``[B]``, valid keys per row, this call's new keys included.

Masking rule (right-aligned causal). Query ``i`` of row ``b`` (``Lb = seqused_q[b]``,
``K = seqused_k[b]``) sits at absolute position ``p = K - Lb + i`` and sees keys ``j <= p``. With
``bidir_regions[b] = (s, e)`` (``s >= e`` means none), a query with ``s <= p < e`` additionally sees
every key ``j`` with ``s <= j < min(e, K)``. ``bidir_regions`` ``[B, R, 2]`` gives each row up to
``R`` such regions (one per image of a multi-image prompt), in order and disjoint; unused ones are
``(0, 0)``; each applies on its own. With ``causal=False`` every real query sees ``0..K-1``.
The one rule serves full prefill (``Lq = K``), append prefill (cached prefix + new suffix in one
call), decode (``Lq = 1``) and varlen batches.

How a kernel without mask functions serves the rule: ``kestrel_kernels.segments``.

Scaled KV (FP8 pages). A layer's caches may instead be float8_e4m3fn with one float32 scale each
(``KvScales``: ``k`` and ``v``, a single positive finite value per layer, as Moondream 3's
``kv_quantizer.{k_scale, v_scale}`` give them). Writing stores ``e4m3(clamp(x / scale, +-448))``;
reading sees ``stored * scale`` in q's dtype, and the masking rule is unchanged: attention over
scaled pages equals attention over the widened pages. ``validate_scaled_kv`` checks the case;
``quantize_kv`` / ``dequantize_kv`` are the two conversions every backend must match.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "KV_FP8_DTYPE",
    "AttentionMeta",
    "AttentionShape",
    "BackendUnavailableError",
    "KernelInputError",
    "KvScales",
    "dequantize_kv",
    "quantize_kv",
    "regions_BR2",
    "validate_attention_inputs",
    "validate_batch_inputs",
    "validate_scaled_kv",
    "validate_write_kv_inputs",
    "value_checks_paused",
]

KV_FP8_DTYPE = torch.float8_e4m3fn
_E4M3_MAX = 448.0

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SLOT_DTYPES = (torch.int32, torch.int64)
_value_checks_paused = 0  # > 0 inside value_checks_paused()


@contextlib.contextmanager
def value_checks_paused() -> Iterator[None]:
    """Inside, ``validate_attention_inputs`` skips the value checks it makes on CPU tensors (the
    host reads of lengths, page ids and regions), as on CUDA, where they would be a sync per
    layer. A counting hook: ``scripts/kernel_counts.py`` runs the GPU's branches on a CPU, and
    those reads are on no GPU path. Shapes, dtypes and devices are still checked."""
    global _value_checks_paused
    _value_checks_paused += 1
    try:
        yield
    finally:
        _value_checks_paused -= 1


class KernelInputError(ValueError):
    """An attention / KV-write input has the wrong shape, dtype, device or value."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (no CUDA, wrong GPU, package missing, dtype)."""


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMeta:
    """One call's metadata: ``page_table`` int32 ``[B, max_pages]``, ``seqused_k`` int32
    ``[B]`` (keys per row, this call's new keys included), ``seqused_q`` int32 ``[B]`` (real
    queries per row; None: all ``Lq``), ``bidir_regions`` int32 ``[B, 2]`` or ``[B, R, 2]``
    (None: none) and ``causal`` (False: every real query sees every valid key)."""

    page_table: Tensor
    seqused_k: Tensor
    seqused_q: Tensor | None = None
    bidir_regions: Tensor | None = None
    causal: bool = True


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Dimensions of one validated ``paged_attention`` call."""

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    n_pages: int
    max_pages: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise KernelInputError(msg)


def _check_int_vector(t: Tensor | None, name: str, shape: tuple[int, ...], device) -> None:
    if t is None:
        return
    _need(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(
        t.dtype == torch.int32,
        f"{name} must be int32 (the FlashAttention kernels need it), got {t.dtype}",
    )
    _need(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _need(t.device == device, f"{name} is on {t.device} but q (or positions_BT) is on {device}")


def validate_attention_inputs(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMeta,
    kv_scales: KvScales | None = None,
) -> AttentionShape:
    """Check shapes, dtypes and devices (always) and lengths / page ids (CPU tensors only) of
    ``q``, the caches and ``meta``.
    With ``kv_scales`` the caches are the scaled-KV case's e4m3 pages (``validate_scaled_kv``).

    Value checks need the numbers on the host; on CUDA that would be a sync per layer, so there
    they are left to the kernels. Raises ``KernelInputError`` saying what is wrong.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _need(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if kv_scales is None or name == "q":
            _need(
                t.dtype in _FLOAT_DTYPES, f"{name} must be float32/float16/bfloat16, got {t.dtype}"
            )
    if kv_scales is not None:
        validate_scaled_kv(q.dtype, k_cache, v_cache, kv_scales)
    _need(q.dim() == 4, f"q must be [B, Lq, Hq, D], got shape {list(q.shape)}")
    _need(k_cache.dim() == 3, f"k_cache must be [n_pages, Hkv, D], got {list(k_cache.shape)}")
    _need(
        v_cache.shape == k_cache.shape,
        f"v_cache shape {list(v_cache.shape)} != k_cache shape {list(k_cache.shape)}",
    )
    _need(
        kv_scales is not None or q.dtype == k_cache.dtype == v_cache.dtype,
        f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}",
    )
    _need(
        q.device == k_cache.device == v_cache.device,
        f"q, k_cache, v_cache devices differ: {q.device}, {k_cache.device}, {v_cache.device}",
    )
    batch, q_len, q_heads, head_dim = q.shape
    n_pages, kv_heads, kv_dim = k_cache.shape
    _need(kv_dim == head_dim, f"head_dim differs: q has {head_dim}, k_cache has {kv_dim}")
    _need(
        kv_heads > 0 and q_heads % kv_heads == 0,
        f"Hq ({q_heads}) must be a multiple of Hkv ({kv_heads})",
    )
    page_table = meta.page_table
    several = _check_metadata(
        batch, q.device, page_table, meta.seqused_k, meta.seqused_q, meta.bidir_regions
    )
    shape = AttentionShape(
        batch, q_len, q_heads, kv_heads, head_dim, n_pages, int(page_table.shape[1])
    )
    if q.device.type == "cpu" and not _value_checks_paused:
        _check_values(shape, page_table, meta.seqused_k, meta.seqused_q)
        if several:
            _check_regions(meta.bidir_regions)
    return shape


def validate_batch_inputs(
    positions_BT: Tensor,
    slot_mapping: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    seqused_q: Tensor | None,
    bidir_regions: Tensor | None,
) -> None:
    """Check one forward's attention metadata (``batch.AttentionBatch``) once: shapes, dtypes
    and devices against ``positions_BT`` ``[B, T]``. No values are read (no host sync); each
    ``paged_attention`` call still checks its own inputs as above."""
    _need(
        isinstance(positions_BT, Tensor) and positions_BT.dim() == 2,
        f"positions_BT must be a [B, T] tensor, got {_describe(positions_BT)}",
    )
    _need(
        positions_BT.dtype in _SLOT_DTYPES,
        f"positions_BT must be int32/int64, got {positions_BT.dtype}",
    )
    batch, q_len = positions_BT.shape
    dev = positions_BT.device
    _need(
        isinstance(slot_mapping, Tensor)
        and slot_mapping.dtype in _SLOT_DTYPES
        and tuple(slot_mapping.shape) == (batch * q_len,),
        f"slot_mapping must be int32/int64 [B*T={batch * q_len}], got {_describe(slot_mapping)}",
    )
    _need(slot_mapping.device == dev, f"slot_mapping is on {slot_mapping.device}, not {dev}")
    _check_metadata(batch, dev, page_table, seqused_k, seqused_q, bidir_regions)


def _check_metadata(batch: int, device, page_table, seqused_k, seqused_q, bidir_regions) -> bool:
    """The per-row metadata's shapes, dtypes and devices; whether regions are ``[B, R, 2]``."""
    _need(isinstance(page_table, Tensor), "page_table must be a torch.Tensor")
    _need(
        page_table.dim() == 2 and page_table.shape[0] == batch,
        f"page_table must be [B={batch}, max_pages], got {list(page_table.shape)}",
    )
    _check_int_vector(page_table.reshape(-1), "page_table", (page_table.numel(),), device)
    _check_int_vector(seqused_k, "seqused_k", (batch,), device)
    _check_int_vector(seqused_q, "seqused_q", (batch,), device)
    several = isinstance(bidir_regions, Tensor) and bidir_regions.dim() == 3
    want = (batch, max(1, bidir_regions.shape[1]), 2) if several else (batch, 2)
    _check_int_vector(bidir_regions, "bidir_regions", want, device)
    return several


def _describe(t: object) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)}"


def regions_BR2(bidir_regions: Tensor | None) -> Tensor | None:
    """``bidir_regions`` as ``[B, R, 2]`` (a ``[B, 2]`` tensor is one region per row)."""
    if bidir_regions is None or bidir_regions.dim() == 3:
        return bidir_regions
    return bidir_regions[:, None, :]


def _check_regions(regions_BR2: Tensor) -> None:
    """Each row's non-empty regions are in order and disjoint (CPU only: a host read)."""
    for b, row in enumerate(regions_BR2.tolist()):
        spans = [(s, e) for s, e in row if s < e]
        for (_, e0), (s1, _) in itertools.pairwise(spans):
            _need(s1 >= e0, f"bidir_regions[{b}] must be in order and disjoint, got {row}")


def _check_values(
    shape: AttentionShape, page_table: Tensor, seqused_k: Tensor, seqused_q: Tensor | None
) -> None:
    if shape.batch == 0:
        return
    k_lens = seqused_k.tolist()
    q_lens = seqused_q.tolist() if seqused_q is not None else [shape.q_len] * shape.batch
    for b, (k_len, q_len) in enumerate(zip(k_lens, q_lens, strict=True)):
        _need(
            0 <= k_len <= shape.max_pages,
            f"seqused_k[{b}] = {k_len} is outside [0, max_pages={shape.max_pages}]",
        )
        _need(0 <= q_len <= shape.q_len, f"seqused_q[{b}] = {q_len} is outside [0, Lq]")
        _need(
            q_len <= k_len,
            f"row {b} has {q_len} queries but only {k_len} keys; seqused_k must count this "
            "call's new keys too (write them with write_kv first)",
        )
    used = page_table[:, : max(k_lens)]
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        _need(
            lo >= 0 and hi < shape.n_pages,
            f"page_table holds page ids in [{lo}, {hi}] but the cache has {shape.n_pages} pages",
        )


def validate_write_kv_inputs(
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k: Tensor,
    v: Tensor,
    kv_scales: KvScales | None = None,
) -> None:
    """Check ``write_kv`` inputs; slot range is checked on CPU only (a sync on CUDA). With
    ``kv_scales``, float K/V go into the scaled-KV case's e4m3 pages."""
    if kv_scales is not None:
        validate_scaled_kv(k.dtype, k_cache, v_cache, kv_scales)
    _need(k_cache.dim() == 3, f"k_cache must be [n_pages, Hkv, D], got {list(k_cache.shape)}")
    _need(v_cache.shape == k_cache.shape, "v_cache and k_cache shapes differ")
    _need(
        slot_mapping.dim() == 1 and slot_mapping.dtype in _SLOT_DTYPES,
        "slot_mapping must be int32/int64 [N], got "
        f"{slot_mapping.dtype} {list(slot_mapping.shape)}",
    )
    n = slot_mapping.shape[0]
    want = (n, *k_cache.shape[1:])
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _need(tuple(t.shape) == want, f"{name} must be {list(want)}, got {list(t.shape)}")
        _need(
            kv_scales is not None or t.dtype == cache.dtype,
            f"{name} is {t.dtype} but its cache is {cache.dtype}",
        )
        _need(t.device == cache.device, f"{name} is on {t.device} but its cache on {cache.device}")
    _need(slot_mapping.device == k_cache.device, "slot_mapping must be on the cache's device")
    if slot_mapping.device.type == "cpu" and n:
        hi = int(slot_mapping.max())
        _need(hi < k_cache.shape[0], f"slot {hi} is beyond the cache's {k_cache.shape[0]} pages")


@dataclass(frozen=True, slots=True)
class KvScales:
    """One layer's K and V scales for FP8 pages: float32 tensors of one element each."""

    k: Tensor
    v: Tensor


def quantize_kv(x: Tensor, scale: Tensor) -> Tensor:
    """K or V as stored in a scaled page: e4m3 of ``x / scale``, clamped to e4m3's range."""
    return (x.float() / scale.float()).clamp(-_E4M3_MAX, _E4M3_MAX).to(KV_FP8_DTYPE)


def dequantize_kv(stored: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """What attention reads from a scaled page: ``stored * scale`` in ``dtype``."""
    return (stored.float() * scale.float()).to(dtype)


def validate_scaled_kv(dtype: torch.dtype, k_cache: Tensor, v_cache: Tensor, scales) -> None:
    """The scaled-KV case: e4m3 caches, float activations (``dtype``), one positive finite
    float32 scale for K and one for V on the caches' device (values checked on CPU only)."""
    _need(isinstance(scales, KvScales), f"scaled KV needs KvScales, got {type(scales).__name__}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(cache.dtype == KV_FP8_DTYPE, f"{name} must be float8_e4m3fn, got {cache.dtype}")
    _need(dtype in _FLOAT_DTYPES, f"q and new K/V must be float32/float16/bfloat16, got {dtype}")
    _need(v_cache.shape == k_cache.shape, "v_cache and k_cache shapes differ")
    for name, t in (("k scale", scales.k), ("v scale", scales.v)):
        _need(isinstance(t, Tensor) and t.numel() == 1, f"the {name} must be a one-element tensor")
        _need(t.dtype == torch.float32, f"the {name} must be float32, got {t.dtype}")
        _need(
            t.device == k_cache.device,
            f"the {name} is on {t.device}, the cache on {k_cache.device}",
        )
        if t.device.type == "cpu":
            value = float(t)
            _need(
                math.isfinite(value) and value > 0,
                f"the {name} must be finite and > 0, got {value}",
            )


class EnvSwitch:
    """A process-wide choice among ``choices``: the environment variable ``env`` when made (at
    import; ``default`` when unset), then whatever :meth:`set` is given. ``what`` names it in
    the error a bad value raises (``KernelInputError``)."""

    __slots__ = ("choices", "value", "what")

    def __init__(self, env: str, choices: tuple[str, ...], default: str, what: str) -> None:
        self.choices, self.what = choices, what
        value = os.environ.get(env, default)
        if value not in choices:
            raise KernelInputError(f"{env}={value!r}; choose one of {choices}")
        self.value = value

    def set(self, name: str) -> None:
        if name not in self.choices:
            raise KernelInputError(f"unknown {self.what} {name!r}; choose one of {self.choices}")
        self.value = name


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
