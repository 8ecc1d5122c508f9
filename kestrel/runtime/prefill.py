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

from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.text import PagedKV, text_forward
from kestrel.runtime.sequence import SequenceError, SequenceState
from kestrel.tokens import ImageToken
from kestrel_kernels.backends import AttentionBackend
from kestrel_kernels.batch import AttentionBatch, RowsLayout, RowSpan
from kestrel_kernels.transfer import upload

__all__ = [
    "MAX_PADDING",
    "PrefillItem",
    "causal_rows",
    "check_items",
    "group_by_length",
    "prefill_batch",
    "prefill_item",
]

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

    @property
    def span(self) -> RowSpan:
        """The item's row as the attention metadata sees it (``kestrel_kernels.batch``)."""
        return RowSpan(self.row, self.skip, self.prompt_length, self.regions)


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


def check_items(items: Sequence[PrefillItem]) -> None:
    """Refuse an empty prefill or an item whose positions do not end its prompt."""
    if not items:
        raise ValueError("prefill_batch needs at least one item")
    for it in items:
        if it.n < 1 or it.skip + it.n != it.prompt_length:
            raise ValueError(f"prefill covers {it.skip}+{it.n} != prompt {it.prompt_length}")


def prefill_batch(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    items: Sequence[PrefillItem],
    backend: AttentionBackend | None,
) -> Tensor:
    """Compute every item's positions into its row's pages; returns the hidden state (before
    post_ln) of each item's last prompt position, ``[len(items), dim]``, in item order."""
    check_items(items)
    groups = group_by_length([it.n for it in items])
    if len(groups) == 1:  # one forward: its rows in item order, nothing to scatter
        return _forward(items, model, kv, page_table_RP, backend)
    out = items[0].x_TC.new_empty(len(items), items[0].x_TC.shape[1])
    for group in groups:
        out[group] = _forward([items[i] for i in group], model, kv, page_table_RP, backend)
    return out


def _forward(
    items: Sequence[PrefillItem], model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor,
    backend: AttentionBackend | None,
) -> Tensor:  # fmt: skip
    """One padded forward over ``items``: the last real position's hidden state per row."""
    dev = items[0].x_TC.device
    B, T = len(items), max(it.n for it in items)
    padded = any(it.n < T for it in items)
    layout = RowsLayout(B, T, max(len(it.regions) for it in items))
    # the metadata made on the host, uploaded in one non-blocking copy
    meta = layout.views(upload(layout.encode([it.span for it in items]), torch.int32, dev))
    if B == 1:
        x_BTC = items[0].x_TC[None]
    else:
        x_BTC = items[0].x_TC.new_zeros(B, T, items[0].x_TC.shape[1])
        for b, it in enumerate(items):
            x_BTC[b, : it.n] = it.x_TC
    max_k = max(it.prompt_length for it in items)
    rows = [it.row for it in items]
    if rows == list(range(rows[0], rows[0] + B)):  # consecutive rows: a view, no gather
        pages_BK = page_table_RP[rows[0] : rows[0] + B, :max_k]
    else:
        pages_BK = page_table_RP[:, :max_k].index_select(0, meta.rows_B)
    attention = AttentionBatch.from_rows(
        meta, pages_BK, padded=padded, backend=backend,
        causal_rows=None if meta.regions is None else max(causal_rows(it) for it in items),
    )  # fmt: skip
    inputs = ForwardInputs.of(attention, [it.adapter for it in items])
    hidden_BTC = text_forward(x_BTC, model.text, model.config.text, inputs, kv)
    if not padded:  # every row ends at T - 1
        return hidden_BTC[:, -1]
    return hidden_BTC.reshape(B * T, -1).index_select(0, meta.last_B)


def causal_rows(item: PrefillItem) -> int:
    """The item's computed positions outside its bidirectional blocks (the host's count, which
    lets the attention plan take its one-call form for a short question after an image)."""
    lo, hi = item.skip, item.prompt_length
    inside = sum(max(0, min(e, hi) - max(s, lo)) for s, e in item.regions)
    return item.n - inside


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
            text = []
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
