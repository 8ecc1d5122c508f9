"""LoRA deltas for a batch whose rows use different adapters (or none).

The adapters of one forward are given slots (0..S-1, one per distinct adapter); each row that
uses an adapter is tagged with its slot. For every layer and module the slots' A and B are
stacked (zero-padded to the largest rank, which changes nothing) and gathered per row, so the
delta of the whole batch is two batched matmuls whatever the mix:

    delta_RTO = (x_RTI @ A_R^T) @ B_R^T      R = rows with an adapter

Rows without an adapter are left out (gathered in and scattered back with index ops), so a
mostly-base batch pays only for its adapter rows. One adapter for every row is the common case
and skips the gathers altogether.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.lora import LoraAdapter, LoraPair

__all__ = ["LoraBatch"]


def _padded(t: Tensor, rank: int, dim: int) -> Tensor:
    """Zero-pad ``t`` along ``dim`` (its rank axis) up to ``rank``."""
    missing = rank - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
    return F.pad(t, pad)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    adapters: tuple[LoraAdapter, ...]  # slot -> adapter
    rows: Tensor | None  # int64 [R]: rows that use an adapter (None: every row)
    slots: Tensor | None  # int64 [R]: each such row's slot (None: a single slot)
    rank: int

    @classmethod
    def plan(
        cls, lora: Sequence[LoraAdapter | None] | None, batch: int, device: torch.device
    ) -> LoraBatch | None:
        """None when no row uses an adapter."""
        if lora is None:
            return None
        if len(lora) != batch:
            raise ValueError(f"lora has {len(lora)} entries for a batch of {batch} rows")
        slot_of: dict[int, int] = {}
        adapters: list[LoraAdapter] = []
        rows: list[int] = []
        slots: list[int] = []
        for row, adapter in enumerate(lora):
            if adapter is None:
                continue
            if id(adapter) not in slot_of:
                slot_of[id(adapter)] = len(adapters)
                adapters.append(adapter)
            rows.append(row)
            slots.append(slot_of[id(adapter)])
        if not adapters:
            return None
        every_row = len(rows) == batch
        return cls(
            adapters=tuple(adapters),
            rows=None if every_row else torch.tensor(rows, device=device),
            slots=None if len(adapters) == 1 else torch.tensor(slots, device=device),
            rank=max(a.rank for a in adapters),
        )

    def _stacked(self, layer: int, module: str) -> tuple[Tensor, Tensor]:
        """A [S, r, in] and B [S, out, r] of every slot."""
        pairs: list[LoraPair] = [getattr(a.layers[layer], module) for a in self.adapters]
        a = torch.stack([_padded(p.A, self.rank, 0) for p in pairs])
        b = torch.stack([_padded(p.B, self.rank, 1) for p in pairs])
        return a, b

    def add(self, out: Tensor, x: Tensor, layer: int, module: str) -> Tensor:
        """``out + delta`` for the adapter rows (x: [B, T, in], out: [B, T, out])."""
        x_R = x if self.rows is None else x.index_select(0, self.rows)
        if self.slots is None:  # one adapter: plain matmuls
            pair: LoraPair = getattr(self.adapters[0].layers[layer], module)
            delta = F.linear(F.linear(x_R, pair.A), pair.B)
        else:
            a_S, b_S = self._stacked(layer, module)
            a_R = a_S.index_select(0, self.slots)  # [R, r, in]
            b_R = b_S.index_select(0, self.slots)  # [R, out, r]
            delta = torch.bmm(torch.bmm(x_R, a_R.transpose(1, 2)), b_R.transpose(1, 2))
        return out + delta if self.rows is None else out.index_add(0, self.rows, delta)
