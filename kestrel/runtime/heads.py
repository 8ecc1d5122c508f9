"""SkillOps over a MoondreamModel: sampling, region decoding and detokenizing for the skills."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel.moondream.config import TokenizerConfig
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import (
    coord_token,
    decode_coordinate,
    decode_size,
    size_token,
    spatial_ref_tokens,
)
from kestrel.moondream.sampling import greedy, sample, suppress
from kestrel.tokens import CoordToken, SizeToken

__all__ = ["ModelHeads", "RowLogits", "batch_rows"]


@dataclass(frozen=True, slots=True)
class RowLogits:
    """One row of a batch's logits [V] with its argmax, read back for the whole batch at once.

    A greedy decision whose argmax is not a suppressed id needs nothing more from the device:
    suppressing other ids cannot change the first maximum. So a batch of greedy rows costs one
    device-to-host transfer per step instead of one per row.
    """

    logits_V: Tensor
    argmax: int


def batch_rows(logits_BV: Tensor) -> list[RowLogits]:
    ids = greedy(logits_BV).tolist()  # the one transfer
    return [RowLogits(logits_BV[i], ids[i]) for i in range(len(ids))]


class _NoStream:
    """A stand-in decoder for tokenizers without ``stream_decoder`` (text arrives at the end)."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class ModelHeads:
    """The model-side operations every skill uses (see ``kestrel.skills.base.SkillOps``).

    ``tokenizer`` is anything with ``encode(text) -> ids`` and ``decode(ids) -> str`` (a
    ``MoondreamTokenizer`` also streams).
    """

    def __init__(self, model: MoondreamModel, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.region_config = model.config.region

    @property
    def tokens(self) -> TokenizerConfig:
        return self.model.config.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def stream_decoder(self):
        make = getattr(self.tokenizer, "stream_decoder", None)
        return make() if make is not None else _NoStream()

    def rng(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = torch.Generator(device=self.model.device)
        gen.manual_seed(seed)
        return gen

    def pick(self, logits_V: Tensor | RowLogits, ids: Sequence[int]) -> int:
        if isinstance(logits_V, RowLogits):
            logits_V = logits_V.logits_V
        sub = logits_V[list(ids)].tolist()  # torch.argmax takes the first maximum too
        return ids[sub.index(max(sub))]

    def sample(
        self,
        logits_V: Tensor | RowLogits,
        temperature: float,
        top_p: float,
        banned: Sequence[int],
        rng: torch.Generator | None,
    ) -> int:
        if isinstance(logits_V, RowLogits):
            if temperature == 0.0 and logits_V.argmax not in banned:
                return logits_V.argmax
            logits_V = logits_V.logits_V
        logits_1V = logits_V[None]
        if banned:
            logits_1V = suppress(logits_1V, banned)
        if temperature == 0.0:
            return int(greedy(logits_1V)[0])
        return int(sample(logits_1V, temperature, top_p, generator=rng)[0])

    def coord_token(self, hidden_C: Tensor) -> tuple[CoordToken, Tensor]:
        logits = decode_coordinate(hidden_C, self.model.region)
        return coord_token(int(greedy(logits[None])[0]), self.region_config), logits

    def size_token(self, hidden_C: Tensor) -> tuple[SizeToken, Tensor]:
        logits = decode_size(hidden_C, self.model.region)  # [2, size_bins]
        w_bin, h_bin = (int(b) for b in greedy(logits))
        return size_token(w_bin, h_bin, self.region_config), logits

    def spatial_tokens(self, refs: Sequence[Sequence[float]]) -> list[CoordToken | SizeToken]:
        return spatial_ref_tokens(refs, self.region_config)
