"""SkillOps over a MoondreamModel: sampling, region decoding and detokenizing for the skills."""

from __future__ import annotations

import random
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
from kestrel.moondream.sampling import greedy, sample_rows, suppress
from kestrel.skills.base import Draw
from kestrel.tokens import CoordToken, SizeToken
from kestrel_kernels.transfer import upload

__all__ = ["ModelHeads", "RowLogits", "batch_rows"]


@dataclass(frozen=True, slots=True)
class RowLogits:
    """One row of a batch's logits [V], with what was read back for the whole batch at once:
    its argmax and, when the row's skill announced its draw (``Skill.next_draw``), the token
    that draw chose (sampled on the device with the rest of the batch).

    A greedy decision whose argmax is not a suppressed id needs nothing more from the device
    either: suppressing other ids cannot change the first maximum. So a batch costs one
    device-to-host transfer per step, not one per row.
    """

    logits_V: Tensor
    argmax: int
    draw: Draw | None = None
    chosen: int | None = None


def _draw_table(draws: Sequence[Draw | None], device) -> tuple[Tensor, ...]:
    """Per-row temperature, top-p, top-k, u and suppressed ids, in one non-blocking upload
    (float32 holds every token id exactly: they are below 2**24)."""
    width = max((len(d.banned) for d in draws if d is not None), default=0)
    rows = []
    for d in draws:
        if d is None:
            rows.append([0.0, 1.0, 0.0, 0.0] + [-1.0] * width)
        else:
            pad = [-1.0] * (width - len(d.banned))
            rows.append([d.temperature, d.top_p, float(d.top_k), d.u, *d.banned, *pad])
    table = upload(rows, torch.float32, device)
    banned = table[:, 4:].to(torch.int64) if width else None
    return table[:, 0], table[:, 1], table[:, 2].to(torch.int64), table[:, 3], banned


def batch_rows(logits_BV: Tensor, draws: Sequence[Draw | None] | None = None) -> list[RowLogits]:
    """The rows of a batch's logits with their argmax and, for rows with a draw, the chosen
    token: one set of device ops for the batch and one transfer back."""
    rows = logits_BV.unbind(0)  # one call for every row's view
    if draws is not None and len(draws) != logits_BV.shape[0]:
        raise ValueError(f"{len(draws)} draws for {logits_BV.shape[0]} rows of logits")
    if draws is None or not any(d is not None and d.temperature > 0 for d in draws):
        # every row greedy: the argmaxes alone (a row whose argmax it suppresses is decided
        # again from its own logits, which is rare)
        ids = greedy(logits_BV).tolist()  # the one transfer
        return [RowLogits(row, i) for row, i in zip(rows, ids, strict=True)]
    temp, top_p, top_k, u, banned = _draw_table(draws, logits_BV.device)
    chosen = sample_rows(logits_BV, temp, top_p, top_k, u, banned)
    argmax, picks = torch.stack([greedy(logits_BV), chosen]).tolist()  # the one transfer
    return [
        RowLogits(row, best, d, None if d is None else pick)
        for row, best, d, pick in zip(rows, argmax, draws, picks, strict=True)
    ]


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

    def rng(self, seed: int | None) -> random.Random:
        """The request's random stream (one uniform number per sampled token)."""
        return random.Random(seed)

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
        rng: random.Random | None,
        u: float | None = None,
        top_k: int = 0,
    ) -> int:
        """One token id (see ``SkillOps.sample``); answered from the batch's choice when the
        row's announced draw is this one, else computed for this row alone."""
        banned = tuple(banned)
        if isinstance(logits_V, RowLogits):
            d = logits_V.draw
            if (
                d is not None
                and logits_V.chosen is not None
                and d == Draw(temperature, top_p, banned, d.u if u is None else u, top_k)
            ):
                return logits_V.chosen  # chosen with the batch, on the device
            if temperature == 0.0 and logits_V.argmax not in banned:
                return logits_V.argmax
            logits_V = logits_V.logits_V
        if temperature == 0.0:
            return int(greedy(suppress(logits_V[None], banned))[0])
        if u is None:
            u = (rng or random).random()
        draw = Draw(temperature, top_p, banned, u, top_k)
        return batch_rows(logits_V[None], [draw])[0].chosen  # type: ignore[return-value]

    def coord_token(self, hidden_C: Tensor) -> tuple[CoordToken, Tensor]:
        logits = decode_coordinate(hidden_C, self.model.region)
        return coord_token(int(greedy(logits[None])[0]), self.region_config), logits

    def size_token(self, hidden_C: Tensor) -> tuple[SizeToken, Tensor]:
        logits = decode_size(hidden_C, self.model.region)  # [2, size_bins]
        w_bin, h_bin = (int(b) for b in greedy(logits))
        return size_token(w_bin, h_bin, self.region_config), logits

    def spatial_tokens(self, refs: Sequence[Sequence[float]]) -> list[CoordToken | SizeToken]:
        return spatial_ref_tokens(refs, self.region_config)
