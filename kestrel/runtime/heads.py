"""SkillOps over a MoondreamModel: sampling, region decoding and detokenizing for the skills."""

from __future__ import annotations

import functools
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
from kestrel.moondream.sampling import (
    greedy,
    mask_tokens,
    sample_table,
    suppress,
    table_row,
    token_logprobs,
)
from kestrel.runtime.token_masks import LogprobRead, logprob_rows, mask_table, shaped
from kestrel.skills.base import Draw
from kestrel.tokens import CoordToken, SizeToken
from kestrel_kernels.transfer import Readback, upload

__all__ = ["BatchChoice", "ModelHeads", "RowLogits", "batch_rows", "choose"]


class RowLogits:
    """One row of a batch's logits [V], with what was read back for the whole batch at once:
    the token its announced draw chose (``Skill.next_draw``; sampled on the device with the
    rest of the batch) and its plain argmax, where known.

    A row without a draw gets its argmax as ``chosen``. ``argmax`` is None for a greedy row
    whose draw suppressed ids (only the suppressed argmax was computed). A decision the batch
    did not foresee is computed from ``logits_V`` (one more transfer); a greedy decision whose
    argmax is not a suppressed id needs nothing more: suppressing other ids cannot change the
    first maximum. So a batch costs one device-to-host transfer per step, not one per row.

    ``logprobs``: where the draw asked for them (``Draw.logprobs``), the chosen token's
    log-probability and its top alternatives ``((id, logprob), ...)``, read with the batch.

    A value (never changed after it is made), written as a plain slotted class rather than a
    frozen dataclass: one is built for every row of every step, and a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``.
    """

    __slots__ = ("_batch_BV", "_index", "chosen", "draw", "logprobs")

    def __init__(
        self,
        logits_BV: Tensor,
        index: int,
        draw: Draw | None,
        chosen: int | None,
        logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None,
    ) -> None:
        self._batch_BV, self._index, self.draw, self.chosen = logits_BV, index, draw, chosen
        self.logprobs = logprobs

    @property
    def logits_V(self) -> Tensor:
        """The row's logits [V] (a view, made when asked for: most decisions never ask)."""
        return self._batch_BV[self._index]

    @property
    def argmax(self) -> int | None:
        """The plain argmax, where the pick is one (no draw, or greedy with nothing
        suppressed); else None."""
        d = self.draw
        if d is None or (d.temperature == 0 and not d.banned and d.constraint is None):
            return self.chosen
        return None

    def __repr__(self) -> str:
        return f"RowLogits(argmax={self.argmax}, draw={self.draw}, chosen={self.chosen})"


@functools.lru_cache(maxsize=32)
def _banned_table(
    banned: tuple[tuple[int, ...], ...], device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Suppressed ids per row (0 where unused) and their fill values (-inf, or +inf unused: the
    ``amin`` scatter leaves those alone), the form ``sampling.sample_table`` uses too; uploaded
    once per distinct set: greedy batches repeat the same sets step after step."""
    width = max(len(b) for b in banned)
    table = upload(
        [[*b, *([0] * (width - len(b))), *([-1] * len(b)), *([1] * (width - len(b)))]
         for b in banned],
        torch.int64,
        device,
    )  # fmt: skip
    return table[:, :width], table[:, width:].to(dtype) * float("inf")


def _draw_table(draws: Sequence[Draw | None], device) -> Tensor:
    """Every row's ``sampling.table_row`` in one non-blocking upload (a row without a draw
    is greedy)."""
    width = max((len(d.banned) for d in draws if d is not None), default=0)
    none = table_row(0.0, 1.0, 0, 0.0, (), width)
    rows = [
        none if d is None else table_row(d.temperature, d.top_p, d.top_k, d.u, d.banned, width)
        for d in draws
    ]
    return upload(rows, torch.float32, device)


@dataclass(frozen=True, slots=True)
class BatchChoice:
    """A step's tokens, chosen on the device (``choose``) and on their way to the host.

    ``chosen_B``: int64 [B] on the device, row ``b``'s token under its draw (its argmax when it
    has none) -- what a look-ahead step feeds before the host has read it. ``rows()`` reads the
    batch back (one transfer, started when the choice was made; a second one when some row
    asked for log-probabilities).
    """

    logits_BV: Tensor
    draws: tuple[Draw | None, ...]
    chosen_B: Tensor
    values: Readback
    logprobs: LogprobRead | None = None

    @property
    def picks(self) -> list[int]:
        """Every row's chosen id (the one read: waits for the copy)."""
        return self.values.tolist()[0]

    def rows(self) -> list[RowLogits]:
        picks, logits = self.picks, self.logits_BV
        if self.logprobs is not None:
            found = self.logprobs.rows()
            return [
                RowLogits(logits, i, d, p, lp)
                for i, (p, d, lp) in enumerate(zip(picks, self.draws, found, strict=True))
            ]
        return [
            RowLogits(logits, i, d, p)
            for i, (p, d) in enumerate(zip(picks, self.draws, strict=True))
        ]


def choose(
    logits_BV: Tensor, draws: Sequence[Draw | None] | None = None, *, special: bool | None = None
) -> BatchChoice:
    """Every row's token under its draw, in one set of device ops, the transfer started.

    ``special``: whether some row may have a grammar or ask for log-probabilities (None: look
    at the draws); False skips that look, so a batch without them costs what it always did."""
    batch = logits_BV.shape[0]
    draws = (None,) * batch if draws is None else tuple(draws)
    if len(draws) != batch:
        raise ValueError(f"{len(draws)} draws for {batch} rows of logits")
    if special is None:
        special = shaped(draws)
    masked = logits_BV
    if special:  # grammars: their rows' disallowed tokens at -inf (token_masks.py)
        mask_BW = mask_table(draws, logits_BV.shape[-1], logits_BV.device)
        if mask_BW is not None:
            masked = mask_tokens(logits_BV, mask_BW)
    if not any(d is not None and d.temperature > 0 for d in draws):
        # every row greedy: the (suppressed) argmaxes alone, no sampling ops
        banned = tuple(() if d is None else d.banned for d in draws)
        if any(banned):
            ids_BN, fill_BN = _banned_table(banned, logits_BV.device, logits_BV.dtype)
            if masked is logits_BV:  # the logits stay as the model gave them (RowLogits)
                masked = masked.scatter_reduce(1, ids_BN, fill_BN, reduce="amin")
            else:  # the grammar's masked copy: suppressed in place, no second copy
                masked.scatter_reduce_(1, ids_BN, fill_BN, reduce="amin")
        chosen = greedy(masked)
    else:
        chosen = sample_table(masked, _draw_table(draws, logits_BV.device))
    values = Readback(chosen[None])
    lps = logprob_rows(logits_BV, chosen, draws) if special else None
    return BatchChoice(logits_BV, draws, chosen, values, lps)


def batch_rows(logits_BV: Tensor, draws: Sequence[Draw | None] | None = None) -> list[RowLogits]:
    """The rows of a batch's logits with their argmax and, for rows with a draw, the chosen
    token: one set of device ops for the batch and one transfer back."""
    return choose(logits_BV, draws).rows()


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
        constraint: object | None = None,
    ) -> int:
        """One token id (see ``SkillOps.sample``); answered from the batch's choice when the
        row's announced draw is this one, else computed for this row alone. ``constraint``:
        the row's grammar (``Draw.constraint``)."""
        banned = tuple(banned)
        if isinstance(logits_V, RowLogits):
            d = logits_V.draw
            if (  # field by field: this runs for every row of every step
                d is not None
                and logits_V.chosen is not None
                and d.temperature == temperature
                and d.top_p == top_p
                and d.banned == banned
                and (u is None or d.u == u)
                and d.top_k == top_k
                and d.constraint is constraint
            ):
                return logits_V.chosen  # chosen with the batch, on the device
            best = logits_V.argmax
            plain = temperature == 0.0 and constraint is None
            if plain and best is not None and best not in banned:
                return best
            logits_V = logits_V.logits_V
        if temperature == 0.0 and constraint is None:
            return int(greedy(suppress(logits_V[None], banned))[0])
        if u is None:
            u = (rng or random).random() if temperature > 0 else 0.0
        draw = Draw(temperature, top_p, banned, u, top_k, False, constraint)
        return batch_rows(logits_V[None], [draw])[0].chosen  # type: ignore[return-value]

    def logprobs(
        self, logits_V: Tensor | RowLogits, token_id: int, k: int
    ) -> tuple[float, tuple[tuple[int, float], ...]]:
        """``token_id``'s log-probability under the row's raw logits and the ``k`` most
        likely ids' (one row alone; a batch reads them with its choice)."""
        if isinstance(logits_V, RowLogits):
            logits_V = logits_V.logits_V
        chosen = torch.tensor([token_id], device=logits_V.device)
        row = token_logprobs(logits_V[None], chosen, k)[0].tolist()
        return row[0], tuple((int(row[1 + j]), row[1 + k + j]) for j in range(k))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a special token's name for it)."""
        return self.tokenizer.token_bytes(token_id)

    def coord_token(self, hidden_C: Tensor) -> tuple[CoordToken, Tensor]:
        logits = decode_coordinate(hidden_C, self.model.region)
        return coord_token(int(greedy(logits[None])[0]), self.region_config), logits

    def size_token(self, hidden_C: Tensor) -> tuple[SizeToken, Tensor]:
        logits = decode_size(hidden_C, self.model.region)  # [2, size_bins]
        w_bin, h_bin = (int(b) for b in greedy(logits))
        return size_token(w_bin, h_bin, self.region_config), logits

    def spatial_tokens(self, refs: Sequence[Sequence[float]]) -> list[CoordToken | SizeToken]:
        return spatial_ref_tokens(refs, self.region_config)
