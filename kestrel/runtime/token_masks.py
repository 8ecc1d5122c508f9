"""A step's grammar masks and log-probabilities: the host's part of constrained decoding.

A row whose draw carries a constraint (``Draw.constraint``, a grammar's matcher) may only
choose the tokens its grammar allows next. The host writes every row's allowed set as an int32
bitmask (``sampling.allowed_tokens``) straight into a slot of the pinned ring taken at start-up
(``kestrel_kernels.pinned``; rows without a constraint allow everything) and copies it to the
device without blocking; ``heads.choose`` masks the logits with it before the batch's tokens
are chosen. The fill runs after the step's forward was queued, so on a GPU it overlaps the
forward (with look-ahead, the queued next step). Constraints that can fill many rows at once
(``fill_rows``: llguidance's thread pool) are handed all their rows in one call.

``logprob_rows`` reads back the log-probabilities rows asked for (``Draw.logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kestrel.moondream.sampling import token_logprobs
from kestrel.skills.base import Draw
from kestrel_kernels import pinned
from kestrel_kernels.counting import count_upload
from kestrel_kernels.transfer import Readback, upload

__all__ = ["LogprobRead", "logprob_rows", "mask_table", "shaped"]


def shaped(draws: Sequence[Draw | None]) -> bool:
    """Whether any row of the step has a constraint or asks for log-probabilities."""
    return any(d is not None and (d.constraint is not None or d.logprobs >= 0) for d in draws)


def _host_rows(rows: int, width: int, device: torch.device) -> tuple[Tensor, int]:
    """An int32 [rows, width] host table: a pinned ring slot on CUDA (slot index), else a
    plain tensor (-1)."""
    ring = pinned.ring(device) if device.type == "cuda" else None
    taken = ring.take(rows * width * 4) if ring is not None else None
    if taken is None:
        return torch.empty((rows, width), dtype=torch.int32), -1
    slot, raw = taken
    return raw.view(torch.int32).view(rows, width), slot


def mask_table(draws: Sequence[Draw | None], vocab: int, device: torch.device) -> Tensor | None:
    """Every row's allowed tokens as int32 bitmasks [B, ceil(vocab / 32)] on ``device`` (the
    copy queued, not waited for), or None when no row has a constraint."""
    found = [(b, d.constraint) for b, d in enumerate(draws)
             if d is not None and d.constraint is not None]  # fmt: skip
    if not found:
        return None
    width = (vocab + 31) // 32
    host, slot = _host_rows(len(draws), width, device)
    host.fill_(-1)
    many = getattr(type(found[0][1]), "fill_rows", None)
    if many is not None and all(type(c) is type(found[0][1]) for _, c in found):
        many([(c, b) for b, c in found], host)
    else:
        for b, c in found:
            c.fill(host[b])
    if slot < 0:
        return upload(host, torch.int32, device)
    count_upload(blocking=False)
    out = host.to(device, non_blocking=True)
    ring = pinned.ring(device)
    assert ring is not None
    ring.copied(slot)
    return out


class LogprobRead:
    """The log-probabilities of a step's rows on their way to the host (``Readback``):
    per row, the chosen token's and its top ``k`` alternatives (k per row's draw)."""

    __slots__ = ("_draws", "_values")

    def __init__(self, values: Readback, draws: Sequence[Draw | None]) -> None:
        self._values, self._draws = values, draws

    def rows(self) -> list[tuple[float, tuple[tuple[int, float], ...]] | None]:
        table = self._values.tolist()
        out: list[tuple[float, tuple[tuple[int, float], ...]] | None] = []
        for d, row in zip(self._draws, table, strict=True):
            if d is None or d.logprobs < 0:
                out.append(None)
                continue
            k, width = d.logprobs, (len(row) - 1) // 2
            top = tuple((int(row[1 + j]), row[1 + width + j]) for j in range(k))
            out.append((row[0], top))
        return out


def logprob_rows(
    logits_BV: Tensor, chosen_B: Tensor, draws: Sequence[Draw | None]
) -> LogprobRead | None:
    """The rows' log-probabilities, their read-back started (None: no row asked)."""
    k = max((d.logprobs for d in draws if d is not None), default=-1)
    if k < 0:
        return None
    return LogprobRead(Readback(token_logprobs(logits_BV, chosen_B, k)), draws)
