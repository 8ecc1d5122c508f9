"""Prefill replayed from CUDA graphs, one per (rows, token bucket): the host launches a handful
of kernels per prefill instead of ~200.

A prefill of a few new positions (a cache hit) is ~200 small kernels whose launch costs the host
far more than the GPU spends on them. Its shape varies, so it is padded up to a bucket: up to
``rows`` sequences of at most ``tokens`` new positions each, with or without a bidirectional
image block (a miss of an image prompt has one). Each bucket's inputs live in a
``ForwardBatch``, fixed buffers the graph reads: the embeddings, and one int32 block holding the
positions (-1 on padding), each row's KV and query lengths, its page-table row and its image
block. The graph computes the page slots, the decoder, the last real position's hidden state
and its logits. Padding positions and rows write no K/V (slot -1) and their outputs are
dropped, as in the eager padded prefill (``prefill.py``), whose arithmetic per row this is.

Every bucket is captured at start-up (``capture_all``, like the decode graphs: never while
serving). ``run_all`` splits a wave of prefills that fits no single bucket (each image miss
alone, the hits in groups); what fits no bucket -- LoRA adapters, several image blocks in one
row, more positions than the largest bucket -- runs eagerly, in one batched forward. Moondream
3's MoE layers and FP8 KV pages get no prefill graphs at all (``graph_set.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import kestrel.runtime.cuda_graphs as cuda_graphs
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV, lm_head
from kestrel.runtime.prefill import PrefillItem, causal_rows, check_items, paged_text_forward
from kestrel_kernels.counting import count_upload
from kestrel_kernels.segments import SINGLE_CALL_MAX_CAUSAL_ROWS

__all__ = ["ForwardBatch", "PrefillGraphs", "prefill_buckets"]

log = logging.getLogger("kestrel.runtime")

HIT_TOKENS = (16, 32, 64)
HIT_ROWS = (1, 2, 4, 8)
_META_ROWS = 6  # per row: KV length, query length, page-table row, block start, block end, pad
Shape = tuple[int, int, bool, "int | None"]  # rows, tokens, image block, causal-rows bound
Output = tuple[Tensor, Tensor]  # hidden [n, C], logits [n, V]


def prefill_buckets(prefix_len: int, max_context: int, max_batch: int) -> list[Shape]:
    """(rows, tokens, image block, causal bound) of every bucket: hits of up to 64 new
    positions on up to 8 rows, and one-row misses whose prompt is the BOS + image block and a
    question: one whose question has at most ``SINGLE_CALL_MAX_CAUSAL_ROWS`` positions (one
    attention call per layer), one for longer questions (two)."""
    hits = [(r, t, False, None) for r in HIT_ROWS if r <= max_batch for t in HIT_TOKENS]
    short, long = SINGLE_CALL_MAX_CAUSAL_ROWS, SINGLE_CALL_MAX_CAUSAL_ROWS + 128
    misses = [(1, min(max_context, -(-(prefix_len + extra) // 64) * 64), True, bound)
              for extra, bound in ((short, short), (long, None))]  # fmt: skip
    return hits + [m for m in dict.fromkeys(misses) if m[1] > prefix_len]


@dataclass(slots=True)
class ForwardBatch:
    """The fixed inputs of one prefill shape ``[B, T]`` (module doc): ``x_BTC`` and ``meta``,
    int32 ``[B * T + 6 * B]``: positions, then per row the fields of ``_META_ROWS``.
    ``causal_rows``: the bound on a row's queries outside its image block that the attention
    plan is built for (None: ``T``)."""

    B: int
    T: int
    regions: bool
    causal_rows: int | None
    x_BTC: Tensor
    meta: Tensor

    @classmethod
    def allocate(cls, shape: Shape, dim: int, dtype, device) -> ForwardBatch:
        B, T, regions, causal_rows = shape
        x = torch.zeros(B, T, dim, dtype=dtype, device=device)
        meta = torch.zeros(B * T + _META_ROWS * B, dtype=torch.int32, device=device)
        batch = cls(B, T, regions, causal_rows, x, meta)
        batch.meta.copy_(batch.host_meta([]))
        return batch

    @property
    def shape(self) -> Shape:
        return (self.B, self.T, self.regions, self.causal_rows)

    def fits(self, items: Sequence[PrefillItem]) -> bool:
        return len(items) <= self.B and all(
            it.n <= self.T
            and it.adapter is None
            and len(it.regions) == int(self.regions)
            and (self.causal_rows is None or causal_rows(it) <= self.causal_rows)
            for it in items
        )

    def host_meta(self, items: Sequence[PrefillItem]) -> Tensor:
        """The ``meta`` block for ``items`` (padding rows: no position, one key on page 0)."""
        pad = self.B - len(items)
        positions = [p for it in items for p in [*range(it.skip, it.prompt_length),
                                                  *[-1] * (self.T - it.n)]]  # fmt: skip
        positions += [-1] * (self.T * pad)
        starts = [it.regions[0][0] if it.regions else 0 for it in items] + [0] * pad
        ends = [it.regions[0][1] if it.regions else 0 for it in items] + [0] * pad
        fields = [
            [it.prompt_length for it in items] + [1] * pad,  # seqused_k
            [it.n for it in items] + [1] * pad,  # seqused_q
            [it.row for it in items] + [0] * pad,  # page-table rows (0: the padding row)
            starts,
            ends,
            [0] * self.B,
        ]
        return torch.tensor(positions + [v for f in fields for v in f], dtype=torch.int32)

    def fields(self) -> tuple[Tensor, ...]:
        """(positions [B, T], seqused_k, seqused_q, rows, regions [B, 2]) views of ``meta``."""
        B, T = self.B, self.T
        positions, rest = self.meta[: B * T].view(B, T), self.meta[B * T :].view(_META_ROWS, B)
        return positions, rest[0], rest[1], rest[2], rest[3:5].t()


def prefill_static(
    model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor, batch: ForwardBatch, backend: str
) -> tuple[Tensor, Tensor]:
    """The whole padded prefill of ``batch`` as a pure function of its buffers (no host sync):
    (hidden before post_ln [B, C], logits [B, V]) of each row's last real position."""
    positions_BT, seqused_k, seqused_q, rows_B, regions_B2 = batch.fields()
    pages_BP = page_table_RP.index_select(0, rows_B.long())
    hidden_BTC = paged_text_forward(
        model,
        kv,
        batch.x_BTC,
        positions_BT,
        pages_BP,
        padded=True,
        seqused_k=seqused_k,
        seqused_q=seqused_q,
        bidir_regions=regions_B2.contiguous() if batch.regions else None,
        backend=backend,
        causal_rows=batch.causal_rows,
        zero_padding=False,  # padding positions' outputs are dropped; positions do not mix
    )
    B, T = batch.B, batch.T
    last_B = (seqused_q.long() - 1).clamp(min=0) + torch.arange(B, device=seqused_q.device) * T
    hidden_BC = hidden_BTC.reshape(B * T, -1).index_select(0, last_B)
    return hidden_BC, lm_head(hidden_BC, model.text)


@dataclass(slots=True)
class _Bucket:
    batch: ForwardBatch
    graph: object | None = None
    out: tuple[Tensor, Tensor] | None = None


class PrefillGraphs:
    """Runs a prefill that fits a bucket from its graph (or, uncaptured, from the same static
    step eagerly); ``run`` returns None for one that fits none."""

    def __init__(
        self, model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor, *, max_batch_size: int,
        backend: str, capture: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.kv, self.page_table_RP = model, kv, page_table_RP
        self.backend, self.capture = backend, capture
        cfg = model.config
        shapes = prefill_buckets(cfg.prefix_len, cfg.text.max_context, max_batch_size)
        dim, dev = cfg.text.dim, page_table_RP.device
        self._buckets = [_Bucket(ForwardBatch.allocate(s, dim, model.dtype, dev)) for s in shapes]
        self._capturer: cuda_graphs.GraphCapture | None = None
        self.failures: dict[Shape, str] = {}
        self.replays = 0

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(b.batch.shape for b in self._buckets)

    @property
    def captured(self) -> tuple[Shape, ...]:
        return tuple(b.batch.shape for b in self._buckets if b.graph is not None)

    def capture_all(self) -> None:
        """Capture every bucket (start-up only; a failure is logged, the bucket runs eagerly)."""
        if not self.capture:
            return
        for bucket in self._buckets:
            shape = bucket.batch.shape
            if bucket.graph is not None or shape in self.failures:
                continue
            if self._capturer is None:
                self._capturer = cuda_graphs.GraphCapture(self.page_table_RP.device)
            try:
                bucket.graph, bucket.out = self._capturer.capture(lambda b=bucket: self._step(b))
            except RuntimeError as exc:
                self.failures[shape] = str(exc)
                log.warning("prefill graph capture failed for %s (%s); eager", shape, exc)

    def run(self, items: Sequence[PrefillItem]) -> tuple[Tensor, Tensor] | None:
        """(hidden [n, C], logits [n, V]) of ``items`` from the smallest bucket they fit, or
        None when none fits."""
        check_items(items)
        bucket = next((b for b in self._buckets if b.batch.fits(items)), None)
        if bucket is None:
            return None
        batch = bucket.batch
        count_upload(blocking=False)
        cuda_graphs.upload_into(batch.meta, batch.host_meta(items))
        for b, it in enumerate(items):
            batch.x_BTC[b, : it.n].copy_(it.x_TC)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            hidden, logits = bucket.out
        else:
            hidden, logits = self._step(bucket)
        n = len(items)
        return hidden[:n].clone(), logits[:n].clone()

    def run_all(
        self, items: Sequence[PrefillItem], eager: Callable[[list[PrefillItem]], Output]
    ) -> Output:
        """Every item's (hidden, logits), in item order: all of them from one bucket where
        they fit one; else each image miss from a miss bucket, the hits in groups of as many
        rows as a hit bucket holds, and what fits no bucket through ``eager`` (one call)."""
        whole = self.run(items)
        if whole is not None:
            return whole
        groups: list[list[int]] = []
        hits, rest = [], []
        for i, it in enumerate(items):
            if not any(b.batch.fits([it]) for b in self._buckets):
                rest.append(i)
            elif it.regions:
                groups.append([i])
            else:
                hits.append(i)
        rows = max((b.batch.B for b in self._buckets if not b.batch.regions), default=1)
        groups += [hits[k : k + rows] for k in range(0, len(hits), rows)]
        parts: list[tuple[list[int], Output]] = []
        for group in groups:
            out = self.run([items[i] for i in group])
            if out is None:  # every bucket's rows fit, so only a bucket set without one
                rest += group
            else:
                parts.append((group, out))
        if rest:
            rest.sort()
            parts.append((rest, eager([items[i] for i in rest])))
        at = {i: (k, j) for k, (group, _) in enumerate(parts) for j, i in enumerate(group)}
        order = [at[i] for i in range(len(items))]  # one cat each: no index upload
        hidden = torch.cat([parts[k][1][0][j : j + 1] for k, j in order])
        logits = torch.cat([parts[k][1][1][j : j + 1] for k, j in order])
        return hidden, logits

    def _step(self, bucket: _Bucket) -> tuple[Tensor, Tensor]:
        return prefill_static(self.model, self.kv, self.page_table_RP, bucket.batch, self.backend)
