"""Token sampling over logits, separate from the forward pass: every row of a batch at once.

Per-row settings: temperature 0 is greedy (argmax; ties pick the lowest id), otherwise
softmax(logits / T) truncated by top-p as the reference does (sort descending, drop a token when
the probability mass strictly before it already exceeds top_p, so the top token always
survives) and by top-k (k > 0 keeps the k most likely), renormalized, then one draw.

The draw is inverse-CDF sampling with one uniform number ``u`` in [0, 1) per row, given by the
caller: the first kept token (in descending order) whose cumulative mass exceeds ``u`` times the
kept mass. That is the same distribution as a multinomial draw over the renormalized nucleus,
and it lets the caller own the random stream: a request with a seed draws its ``u`` from its own
generator, so its answer does not depend on what else shares the batch. ``sample_rows`` is one
fixed set of tensor ops for the whole batch -- greedy and sampled rows mixed, per-row
temperature, top-p, top-k and suppressed ids -- with no host synchronisation, so the chosen ids
come back in one transfer per step.

Which ids are suppressed when is skill logic and lives in ``kestrel.skills.text``.

Grammar masks (``allowed_tokens`` / ``mask_tokens``) come as int32 bitmasks, one word per 32
ids (bit ``i % 32`` of word ``i // 32`` set: id ``i`` allowed), unpacked on the device;
``token_logprobs`` gives a row's chosen log-probability and its most likely alternatives.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from kestrel_kernels.counting import active_counter

__all__ = [
    "SamplingError",
    "allowed_tokens",
    "apply_top_p",
    "greedy",
    "mask_tokens",
    "sample",
    "sample_rows",
    "sample_table",
    "suppress",
    "suppress_rows",
    "table_row",
    "token_logprobs",
]


class SamplingError(ValueError):
    """Invalid sampling settings (negative temperature, top_p outside (0, 1])."""


def greedy(logits_BV: Tensor) -> Tensor:
    """argmax per row, int64 [B]; ties pick the lowest id (torch.argmax returns the first)."""
    return torch.argmax(logits_BV, dim=-1)


def apply_top_p(probs_BV: Tensor, top_p_B: Tensor) -> Tensor:
    """Zero the tail beyond top-p per row and renormalize. top_p_B float [B] (or [B, 1])."""
    p_sorted, idx = torch.sort(probs_BV, dim=-1, descending=True)
    mass_before = torch.cumsum(p_sorted, dim=-1) - p_sorted
    p_sorted = p_sorted.masked_fill(mass_before > top_p_B.reshape(-1, 1), 0.0)
    p_sorted = p_sorted / p_sorted.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs_BV).scatter_(-1, idx, p_sorted)


def suppress_rows(logits_BV: Tensor, banned_BN: Tensor) -> Tensor:
    """Copy of ``logits_BV`` with row ``b``'s ids ``banned_BN[b]`` set to -inf (-1 = unused)."""
    if banned_BN.numel() == 0:
        return logits_BV
    # unused entries (-1) aim at id 0 with +inf, which the minimum ignores
    value_BN = torch.where(banned_BN >= 0, float("-inf"), float("inf")).to(logits_BV.dtype)
    return logits_BV.scatter_reduce(1, banned_BN.clamp(min=0), value_BN, reduce="amin")


@functools.lru_cache(maxsize=8)
def _ranks(vocab: int, device: torch.device) -> Tensor:
    """float32 [1, V]: 0, 1, ... V-1 (kept, not rebuilt every step)."""
    return torch.arange(vocab, dtype=torch.float32, device=device)[None]


@functools.lru_cache(maxsize=256)
def _suppressed_columns(banned: tuple[int, ...], width: int) -> tuple[float, ...]:
    pad = width - len(banned)
    return (
        *map(float, banned),
        *([0.0] * pad),
        *([float("-inf")] * len(banned)),
        *([float("inf")] * pad),
    )


def table_row(
    temperature: float, top_p: float, top_k: int, u: float, banned: Sequence[int], width: int
) -> tuple[float, ...]:
    """One row of a ``sample_table`` table (host values; float32 holds every id exactly, they
    are below 2**24): 1/T, top-p, u, the top-k bound (0 = off; a greedy row keeps 1), then
    ``width`` suppressed ids (0 where unused) and their fill values (-inf, or +inf unused)."""
    tail = _suppressed_columns(tuple(banned), width)
    if temperature > 0:
        return (1.0 / temperature, top_p, u, float(top_k) if top_k > 0 else _INF, *tail)
    return (1.0, 1.0, 0.0, 1.0, *tail)


_INF = float("inf")


def sample_table(logits_BV: Tensor, table_BW: Tensor) -> Tensor:
    """One token per row, int64 [B], under each row's ``table_row`` (float32 [B, 4 + 2N], on
    the logits' device): one fixed set of tensor ops for the batch, no host synchronisation.

    Greedy rows keep one token (their first maximum: the sort is stable) with ``u`` 0; a
    sampled row's kept tokens are those of its top-k whose mass before them is within top-p.
    """
    vocab = logits_BV.shape[-1]
    logits = logits_BV.float()
    width = (table_BW.shape[1] - 4) // 2
    if width:  # suppressed ids: a -inf minimum; unused entries aim +inf at id 0
        ids_BN = table_BW[:, 4 : 4 + width].to(torch.int64)
        logits = logits.scatter_reduce(1, ids_BN, table_BW[:, 4 + width :], reduce="amin")
    scaled = logits * table_BW[:, 0:1]
    s_sorted, idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    p_sorted = torch.softmax(s_sorted, dim=-1)
    cdf = torch.cumsum(p_sorted, dim=-1)
    in_top_k = _ranks(vocab, logits.device) < table_BW[:, 3:4]
    keep = ((cdf - p_sorted) <= table_BW[:, 1:2]) & in_top_k
    kept_cdf = torch.cumsum(p_sorted * keep, dim=-1)
    target_B1 = table_BW[:, 2:3] * kept_cdf[:, -1:]
    # the first kept token whose cumulative mass reaches the target (past the nucleus the mass
    # is flat at the total, which the target never exceeds)
    pos_B1 = (kept_cdf < target_B1).sum(dim=-1, keepdim=True)
    return idx.gather(1, pos_B1)[:, 0]


def sample_rows(
    logits_BV: Tensor,
    temperature_B: Tensor,
    top_p_B: Tensor,
    top_k_B: Tensor,
    u_B: Tensor,
    banned_BN: Tensor | None = None,
    *,
    any_sampled: bool = True,
) -> Tensor:
    """One token per row, int64 [B], for a batch of mixed settings (see the module doc).

    ``temperature_B`` / ``top_p_B`` / ``u_B`` float [B], ``top_k_B`` int [B] (0 = off),
    ``banned_BN`` int [B, N] ids suppressed per row (-1 = unused) or None. No host sync;
    ``any_sampled=False`` (every row greedy) skips the sampling ops. The settings as tensors;
    ``sample_table`` takes them as one table built on the host.
    """
    logits = logits_BV.float()
    if not any_sampled:
        return greedy(logits if banned_BN is None else suppress_rows(logits, banned_BN))
    hot_B = temperature_B > 0
    one = torch.ones_like(top_p_B)
    bound_B = torch.where(top_k_B > 0, top_k_B.to(torch.float32), float("inf"))
    cols = [
        torch.where(hot_B, 1.0 / torch.where(hot_B, temperature_B, 1.0), 1.0),
        torch.where(hot_B, top_p_B, one),
        torch.where(hot_B, u_B, 0.0),
        torch.where(hot_B, bound_B, 1.0),
    ]
    if banned_BN is not None and banned_BN.numel():
        cols += [*banned_BN.clamp(min=0).to(torch.float32).unbind(1)]
        fill = torch.where(banned_BN >= 0, float("-inf"), float("inf"))
        cols += [*fill.unbind(1)]
    return sample_table(logits, torch.stack(cols, dim=1))


def _per_row(value: float | Sequence[float] | Tensor, batch: int, device, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch)
    if t.numel() != batch:
        raise SamplingError(f"{name} has {t.numel()} values for a batch of {batch} rows")
    return t


def sample(
    logits_BV: Tensor,
    temperature: float | Sequence[float] | Tensor = 0.0,
    top_p: float | Sequence[float] | Tensor = 1.0,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row, int64 [B]. Settings are scalars or per-row sequences (host values,
    checked here); the uniform numbers come from ``generator`` (CPU)."""
    B = logits_BV.shape[0]
    temp = _per_row(temperature, B, logits_BV.device, "temperature")
    top = _per_row(top_p, B, logits_BV.device, "top_p")
    if bool((temp < 0).any()) or bool(((top <= 0) | (top > 1)).any()):
        raise SamplingError("temperature must be >= 0 and top_p in (0, 1]")
    u = torch.rand(B, generator=generator)
    dev = logits_BV.device
    return sample_rows(
        logits_BV, temp.to(dev), top.to(dev), torch.zeros(B, dtype=torch.int64, device=dev),
        u.to(dev), any_sampled=bool((temp > 0).any()),
    )  # fmt: skip


def suppress(logits_BV: Tensor, ids: Iterable[int], rows: Tensor | None = None) -> Tensor:
    """Copy of ``logits_BV`` with ``ids`` set to -inf (in every row, or only where ``rows``
    (bool [B]) is True)."""
    ids = list(ids)
    out = logits_BV.clone()
    if not ids:
        return out
    if rows is None:
        out[:, ids] = float("-inf")
    else:
        cols = out[:, ids]
        out[:, ids] = cols.masked_fill(rows.reshape(-1, 1), float("-inf"))
    return out


@functools.lru_cache(maxsize=8)
def _bit_shifts(device: torch.device) -> Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def allowed_tokens(mask_BW: Tensor, vocab: int) -> Tensor:
    """bool [B, vocab] from int32 bitmasks [B, W] (module doc); ids past ``32 * W`` are not
    allowed. On the CPU numpy unpacks the bits in one pass; on a device, shifts (and so in a
    counted run, which stands in for a GPU's ops: ``kestrel_kernels.counting``)."""
    if mask_BW.device.type == "cpu" and active_counter() is None:
        flat = _unpacked_bits(mask_BW)
    else:
        flat = _shifted_bits(mask_BW)
    if flat.shape[1] < vocab:
        flat = torch.nn.functional.pad(flat, (0, vocab - flat.shape[1]))
    if flat.dtype == torch.uint8:  # 0 / 1 bytes read as bools: no pass over them
        return flat[:, :vocab].view(torch.bool)
    return flat[:, :vocab] != 0


def _unpacked_bits(mask_BW: Tensor) -> Tensor:
    """uint8 [B, 32 W] of 0 / 1: each little-endian word's bytes unpacked bit 0 first."""
    raw = mask_BW.contiguous().numpy().view(np.uint8)
    return torch.from_numpy(np.unpackbits(raw, axis=1, bitorder="little"))


def _shifted_bits(mask_BW: Tensor) -> Tensor:
    """int32 [B, 32 W] of 0 / 1; the arithmetic shift keeps the sign bit, so ``& 1`` reads
    bit 31 as well."""
    bits = (mask_BW.unsqueeze(-1) >> _bit_shifts(mask_BW.device)) & 1
    return bits.reshape(mask_BW.shape[0], -1)


def mask_tokens(logits_BV: Tensor, mask_BW: Tensor) -> Tensor:
    """``logits_BV`` with every id its row's bitmask does not allow set to -inf (a copy)."""
    allowed = allowed_tokens(mask_BW, logits_BV.shape[-1])
    return torch.where(allowed, logits_BV, float("-inf"))


def token_logprobs(logits_BV: Tensor, chosen_B: Tensor, k: int) -> Tensor:
    """float32 [B, 1 + 2k]: each row's chosen id's log-probability under its raw logits
    (before temperature, masks or suppression), then the ``k`` most likely ids (as floats:
    exact below 2**24) and their log-probabilities. No host synchronisation."""
    lp = torch.log_softmax(logits_BV.float(), dim=-1)
    cols = [lp.gather(1, chosen_B.reshape(-1, 1))]
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        cols += [top_ids.to(torch.float32), top_lp]
    return torch.cat(cols, dim=1)
