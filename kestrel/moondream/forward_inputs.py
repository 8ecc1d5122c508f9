"""What one decoder forward (``text.text_forward``) runs with, besides its embeddings.

``ForwardInputs`` is the attention half, a ``kestrel_kernels.AttentionBatch`` (positions, K/V
slots, page table, key and query counts, bidirectional blocks, the plan's host facts and the
backend), plus the per-forward option of the model itself: the rows' LoRA adapters. Prefill,
decode, the prefill and decode graphs, the compiled steps, the KV-pool warm-up and the
reference path all build one and hand it to ``text_forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kestrel.moondream.lora import LoraAdapter
from kestrel_kernels.batch import AttentionBatch

__all__ = ["ForwardInputs"]


@dataclass(frozen=True, slots=True, eq=False)
class ForwardInputs:
    """``attention``: the forward's ``AttentionBatch``; ``lora``: None, or one adapter (or
    None) per row with at least one adapter (``of`` drops an all-None list)."""

    attention: AttentionBatch
    lora: tuple[LoraAdapter | None, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionBatch):
            raise TypeError(f"attention must be an AttentionBatch, got {type(self.attention)}")
        if self.lora is None:
            return
        if not isinstance(self.lora, tuple):
            raise TypeError(f"lora must be a tuple (ForwardInputs.of takes any sequence), got "
                            f"{type(self.lora).__name__}")  # fmt: skip
        if len(self.lora) != self.attention.rows:
            raise ValueError(
                f"lora has {len(self.lora)} entries for a batch of {self.attention.rows} rows"
            )
        for a in self.lora:
            if a is not None and not isinstance(a, LoraAdapter):
                raise TypeError(f"a lora entry must be a LoraAdapter or None, got {type(a)}")

    @classmethod
    def of(
        cls,
        attention: AttentionBatch,
        adapters: Sequence[LoraAdapter | None] | None = None,
    ) -> ForwardInputs:
        """The inputs with ``adapters`` (one per row) as ``lora``, None where no row has one."""
        if adapters is not None and all(a is None for a in adapters):
            if len(adapters) != attention.rows:
                raise ValueError(
                    f"lora has {len(adapters)} entries for a batch of {attention.rows} rows"
                )
            adapters = None
        lora = None if adapters is None else tuple(adapters)
        return cls(attention, lora)
