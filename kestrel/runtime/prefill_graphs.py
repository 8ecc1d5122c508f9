"""Prefill replayed from CUDA graphs, one per (rows, token bucket): the host launches a handful
of kernels per prefill instead of ~200.

A prefill of a few new positions (a cache hit) is ~200 small kernels whose launch costs the host
far more than the GPU spends on them. Its shape varies, so it is padded up to a bucket: up to
``rows`` sequences of at most ``tokens`` new positions each, with or without a bidirectional
image block (a miss of an image prompt has one). Each bucket's inputs live in its
``PrefillGraphBuffers``, the fixed buffers its graph reads (a CUDA graph's static inputs, not
a batch of requests): the embeddings, and the attention inputs the backend makes for it
(``AttentionBackend.prefill_graph_inputs``: one int32 block holding the positions, -1 on
padding, each row's KV and query lengths, its page-table row, its last position and its image
block, laid out as the eager prefill's, ``kestrel_kernels.batch.RowsLayout``), read into the
same ``ForwardInputs``. The graph
computes the page slots, the decoder, the last real position's hidden state and its logits.
Padding positions and rows write no K/V (slot -1) and their outputs are dropped, as in the
eager padded prefill (``prefill.py``), whose arithmetic per row this is.

Every bucket is captured at start-up (``capture_all``, like the decode graphs: never while
serving). ``run_all`` splits a wave of prefills that fits no single bucket (each image miss
alone, the hits in groups); what fits no bucket -- LoRA adapters, several image blocks in one
row, more positions than the largest bucket -- runs eagerly, in one batched forward. Both
families are captured (Moondream 3's MoE layers are static grouped GEMMs); FP8 KV pages get no
prefill graphs (``graph_set.py`` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import kestrel.runtime.cuda_graphs as cuda_graphs
from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV, lm_head, text_forward
from kestrel.runtime.prefill import PrefillItem, causal_rows, check_items
from kestrel_kernels.counting import graph_body
from kestrel_kernels.graph_inputs import GraphedBackend, PrefillGraphInputs
from kestrel_kernels.segments import SINGLE_CALL_MAX_CAUSAL_ROWS

__all__ = ["PrefillGraphBuffers", "PrefillGraphs", "prefill_buckets"]

log = logging.getLogger("kestrel.runtime")

HIT_TOKENS = (16, 32, 64)
HIT_ROWS = (1, 2, 4, 8)
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


@dataclass(frozen=True, slots=True, eq=False)
class PrefillGraphBuffers:
    """The fixed inputs of one prefill shape ``[B, T]`` (module doc): the embeddings ``x_BTC``
    and the attention inputs its backend made (``attention``: an int32
    ``kestrel_kernels.batch.RowsLayout`` block with one image block per row, the layout the
    eager prefill uploads, and the bound on a row's queries outside its block that the plan
    is built for, ``causal_rows``; None: ``T``)."""

    x_BTC: Tensor
    attention: PrefillGraphInputs

    @classmethod
    def allocate(
        cls, shape: Shape, dim: int, dtype: torch.dtype, backend: GraphedBackend,
        device: torch.device,
    ) -> PrefillGraphBuffers:  # fmt: skip
        B, T, regions, causal_rows = shape
        x = torch.zeros(B, T, dim, dtype=dtype, device=device)
        attention = backend.prefill_graph_inputs(B, T, device, regions=regions,
                                                 causal_rows=causal_rows)  # fmt: skip
        return cls(x, attention)

    @property
    def B(self) -> int:
        return self.attention.layout.B

    @property
    def T(self) -> int:
        return self.attention.layout.T

    @property
    def regions(self) -> bool:
        return self.attention.regions

    @property
    def causal_rows(self) -> int | None:
        return self.attention.causal_rows

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

    def load(self, items: Sequence[PrefillItem]) -> None:
        """``items`` into the buffers: their metadata in one non-blocking upload, then their
        embeddings (the rows past them keep what they held: padding, dropped)."""
        self.attention.load(self.attention.host([it.span for it in items]))
        for b, it in enumerate(items):
            self.x_BTC[b, : it.n].copy_(it.x_TC)

    def inputs(self, page_table_RP: Tensor) -> ForwardInputs:
        """The forward's inputs read from these buffers (no host sync;
        ``PrefillGraphInputs.batch``)."""
        return ForwardInputs(self.attention.batch(page_table_RP))


def prefill_static(
    model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor, batch: PrefillGraphBuffers
) -> tuple[Tensor, Tensor]:
    """The whole padded prefill of ``batch`` as a pure function of its buffers (no host sync):
    (hidden before post_ln [B, C], logits [B, V]) of each row's last real position."""
    inputs = batch.inputs(page_table_RP)
    hidden_BTC = text_forward(batch.x_BTC, model.text, model.config.text, inputs, kv)
    last_B = batch.attention.views().last_B
    hidden_BC = hidden_BTC.reshape(batch.B * batch.T, -1).index_select(0, last_B)
    return hidden_BC, lm_head(hidden_BC, model.text)


@dataclass(slots=True)
class _Bucket:
    batch: PrefillGraphBuffers
    graph: object | None = None
    out: tuple[Tensor, Tensor] | None = None


class PrefillGraphs:
    """Runs a prefill that fits a bucket from its graph (or, uncaptured, from the same static
    step eagerly); ``run`` returns None for one that fits none."""

    def __init__(
        self, model: MoondreamModel, kv: PagedKV, page_table_RP: Tensor, *, max_batch_size: int,
        backend: GraphedBackend, capture: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.kv, self.page_table_RP = model, kv, page_table_RP
        self.backend, self.capture = backend, capture
        cfg = model.config
        shapes = prefill_buckets(cfg.prefix_len, cfg.text.max_context, max_batch_size)
        dim, dev = cfg.text.dim, page_table_RP.device
        self._buckets = [
            _Bucket(PrefillGraphBuffers.allocate(s, dim, model.dtype, backend, dev)) for s in shapes
        ]
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
        bucket.batch.load(items)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            hidden, logits = bucket.out
        else:
            with graph_body():  # what a replay would launch, for a launch counter
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
        return prefill_static(self.model, self.kv, self.page_table_RP, bucket.batch)
