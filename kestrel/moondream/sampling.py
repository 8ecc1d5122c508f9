"""Token sampling over logits, separate from the forward pass.

Per-row settings: temperature 0 is greedy (argmax; ties pick the lowest id), otherwise
softmax(logits / T) truncated by top-p as the reference does (sort descending, drop a token when
the probability mass strictly before it already exceeds top_p, so the top token always
survives), renormalized, then one multinomial draw.

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
    "suppress",
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


def _per_row(value: float | Sequence[float] | Tensor, batch: int, device, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
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
    """One token per row, int64 [B]. Settings are scalars or per-row sequences."""
    B = logits_BV.shape[0]
    temp = _per_row(temperature, B, logits_BV.device, "temperature")
    top = _per_row(top_p, B, logits_BV.device, "top_p")
    if bool((temp < 0).any()) or bool(((top <= 0) | (top > 1)).any()):
        raise SamplingError("temperature must be >= 0 and top_p in (0, 1]")
    out = greedy(logits_BV)
    hot = temp > 0
    if not bool(hot.any()):
        return out
    rows = hot.nonzero().squeeze(1)
    scaled = logits_BV[rows].float() / temp[rows].unsqueeze(1)
    probs = apply_top_p(torch.softmax(scaled, dim=-1), top[rows])
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return out.index_copy(0, rows, drawn)


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
