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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "SamplingError",
    "apply_top_p",
    "greedy",
    "sample",
    "sample_rows",
    "suppress",
    "suppress_rows",
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
    ``any_sampled=False`` (every row greedy) skips the sampling ops.
    """
    logits = logits_BV.float()
    if banned_BN is not None:
        logits = suppress_rows(logits, banned_BN)
    best_B = greedy(logits)
    if not any_sampled:
        return best_B
    hot_B = temperature_B > 0
    scaled = logits / torch.where(hot_B, temperature_B, 1.0)[:, None]
    p_sorted, idx = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
    cdf = torch.cumsum(p_sorted, dim=-1)
    rank_1V = torch.arange(logits.shape[-1], device=logits.device)[None]
    k_B = torch.where(top_k_B > 0, top_k_B, logits.shape[-1])
    keep = ((cdf - p_sorted) <= top_p_B[:, None]) & (rank_1V < k_B[:, None])
    cdf = torch.cumsum(p_sorted * keep, dim=-1)
    target_B1 = (u_B * cdf[:, -1])[:, None]
    pos_B1 = torch.searchsorted(cdf, target_B1, right=True).clamp(max=logits.shape[-1] - 1)
    drawn_B = idx.gather(1, pos_B1)[:, 0]
    return torch.where(hot_B, drawn_B, best_B)


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
