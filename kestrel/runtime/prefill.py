"""Batched prefill: the prompts of several prepared sequences in as few decoder forwards as fit.

Each sequence brings the input embeddings of its uncached positions ``skip .. prompt_len - 1``
(``PrefillItem``). Sequences of similar length share one padded forward (``[B, T]`` with
``seqused_q`` per row); a miss of 750 positions and a hit of 15 do not, because padding the
hit to 750 would cost more than a second forward. ``group_by_length`` decides the split.

Padding positions write no K/V (slot -1) and their outputs are ignored; each row attends over
its own page-table row with the kernel's right-aligned causal rule, plus the BOS + image
bidirectional block when a query falls inside it (a miss of an image prompt). The arithmetic
per row is the single-sequence prefill's, so greedy answers do not change with batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.text import PagedKV, text_forward
from kestrel.runtime.sequence import SequenceError, SequenceState
from kestrel.tokens import ImageToken
from kestrel_kernels.transfer import upload

__all__ = ["MAX_PADDING", "PrefillItem", "group_by_length", "prefill_batch", "prefill_item"]

# A group's padded size may exceed its real positions by at most this fraction.
MAX_PADDING = 0.25


@dataclass(frozen=True, slots=True, eq=False)
class PrefillItem:
    """One sequence's share of a batched prefill.

    ``x_TC``: embeddings of positions ``skip .. prompt_length - 1``; ``row``: its batch row in
    the page table; ``regions``: the ``(start, end)`` bidirectional block of each image some of
    whose queries are computed (BOS joins a first image's block); ``adapter``: its LoRA
    adapter or None.
    """

    x_TC: Tensor
    row: int
    skip: int
    prompt_length: int
    regions: tuple[tuple[int, int], ...] = ()
    adapter: LoraAdapter | None = None

    @property
    def n(self) -> int:
        return int(self.x_TC.shape[0])


def group_by_length(lengths: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices into ``lengths`` split into groups whose padded size (count x longest) stays
    within ``1 + max_padding`` of their real positions; longest first, greedy."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            real = sum(lengths[j] for j in g) + lengths[i]
            if longest * (len(g) + 1) <= (1 + max_padding) * real:
                g.append(i)
                continue
        groups.append([i])
    return groups


def prefill_batch(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    items: Sequence[PrefillItem],
    backend: str,
) -> Tensor:
    """Compute every item's positions into its row's pages; returns the hidden state (before
    post_ln) of each item's last prompt position, ``[len(items), dim]``, in item order."""
    if not items:
        raise ValueError("prefill_batch needs at least one item")
    for it in items:
        if it.n < 1 or it.skip + it.n != it.prompt_length:
            raise ValueError(f"prefill covers {it.skip}+{it.n} != prompt {it.prompt_length}")
    out = items[0].x_TC.new_empty(len(items), items[0].x_TC.shape[1])
    for group in group_by_length([it.n for it in items]):
        out[group] = _forward([items[i] for i in group], model, kv, page_table_RP, backend)
    return out


def _forward(
    items: Sequence[PrefillItem], model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor,
    backend: str,
) -> Tensor:  # fmt: skip
    """One padded forward over ``items``: the last real position's hidden state per row."""
    dev = items[0].x_TC.device
    B, T = len(items), max(it.n for it in items)
    # one non-blocking upload: real positions, skip, batch row, prompt length per row
    meta_4B = upload([[it.n for it in items], [it.skip for it in items],
                      [it.row for it in items], [it.prompt_length for it in items]],
                     torch.int64, dev)  # fmt: skip
    n_B, skip_B, rows_B, prompt_B = meta_4B.unbind(0)
    if B == 1:
        x_BTC = items[0].x_TC[None]
    else:
        x_BTC = items[0].x_TC.new_zeros(B, T, items[0].x_TC.shape[1])
        for b, it in enumerate(items):
            x_BTC[b, : it.n] = it.x_TC
    t_1T = torch.arange(T, device=dev)[None]
    real_BT = t_1T < n_B[:, None]
    positions_BT = torch.where(real_BT, skip_B[:, None] + t_1T, 0)  # padding: position 0
    max_k = max(it.prompt_length for it in items)
    pages_BK = page_table_RP.index_select(0, rows_B)[:, :max_k]
    slots_BT = pages_BK.gather(1, positions_BT)
    slots = torch.where(real_BT, slots_BT, -1).reshape(-1)
    bidir = _regions(items, dev)
    adapters = [it.adapter for it in items]
    hidden_BTC = text_forward(
        x_BTC,
        model.text,
        model.config.text,
        positions_BT=positions_BT,
        kv=kv,
        slot_mapping=slots,
        page_table=pages_BK,
        seqused_k=prompt_B.to(torch.int32),
        seqused_q=None if all(it.n == T for it in items) else n_B.to(torch.int32),
        bidir_regions=bidir,
        lora=adapters if any(a is not None for a in adapters) else None,
        backend=backend,
    )
    return hidden_BTC[torch.arange(B, device=dev), n_B - 1]


def _regions(items: Sequence[PrefillItem], dev: torch.device) -> Tensor | None:
    """int32 ``[B, 2]`` (at most one block per row) or ``[B, R, 2]``; ``(0, 0)`` = none."""
    most = max(len(it.regions) for it in items)
    if most == 0:
        return None
    rows = [list(it.regions) + [(0, 0)] * (most - len(it.regions)) for it in items]
    out = upload(rows, torch.int32, dev)
    return out[:, 0] if most == 1 else out


def prefill_item(
    state: SequenceState,
    model: MoondreamModel,
    dtype: torch.dtype,
    image_embeddings: Sequence[Tensor | None],
) -> PrefillItem:
    """The embeddings of a prepared sequence's uncached positions, ready for
    ``prefill_batch``: its text embedded, and ``image_embeddings`` (one per image of the
    sequence, the vision encoder's output; None for an image inside the reused positions) in
    the images' places. ``skip`` falls on a cache-token boundary (a match ends on one; the
    backoff steps back a whole token)."""
    skip, parts, text, pos = state.reused_page_count, [], [], 0
    embeddings = iter(image_embeddings)
    for tok in state.cache_tokens:
        emb = next(embeddings) if isinstance(tok, ImageToken) else None
        if pos >= skip and not isinstance(tok, ImageToken):
            text.append(tok)
        elif pos >= skip:
            if emb is None:
                raise SequenceError(f"the image at position {pos} is neither cached nor encoded")
            parts += [embed_tokens(text, model)] if text else []
            parts.append(emb.to(dtype))
            text, state.vision_encoded = [], True
        elif pos + tok.kv_length() > skip:
            raise SequenceError(f"reused positions ({skip}) end inside a cache token")
        pos += tok.kv_length()
    parts += [embed_tokens(text, model)] if text else []
    return PrefillItem(
        x_TC=torch.cat(parts, dim=0) if len(parts) > 1 else parts[0],
        row=state.batch_idx,
        skip=skip,
        prompt_length=state.prompt_length,
        # a block attends both ways only where some of its queries are computed
        regions=tuple(r for r in state.image_regions if r[1] > skip),
        adapter=state.adapter,
    )
