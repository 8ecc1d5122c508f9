"""Batched decode on CUDA, replayed from one CUDA graph per batch-size bucket.

A decode step of a small model is launch-bound: ~25 kernels per layer, each a few microseconds
of work. ``decode.decode_static`` is the whole step, token embedding included, as a pure function
of static buffers with no host synchronisation; it is captured once per batch-size bucket (1, 2,
4, ... up to ``max_batch_size``) and replayed. A batch of ``n`` uses the smallest bucket
``>= n``; its extra rows point at the reserved padding row 0, write no page and are dropped.
Moondream 3's MoE layers run inside the step as grouped GEMMs over the chosen experts
(``moe.moe_mlp``: no host synchronisation, shapes fixed by the bucket size).

A bucket's attention inputs are fixed buffers its backend makes (``AttentionBackend.
decode_graph_inputs``: rows and lengths, with two lanes of the step's own for token ids and
override flags). Per step the host writes them into one pinned buffer and copies it without
blocking (``DecodeGraphInputs.load``), replays, and clones the outputs (the next replay
overwrites them).
Text tokens are embedded inside the graph. Coordinate and size tokens (point / detect feedback)
need the region encoders: those steps embed on the host side first (a synchronising upload) and
pass the rows through the override buffer.

Every bucket is captured at start-up (``capture_all``, which the runtime calls before it serves
anything), never on first use: a capture while requests run would share the process with crop
threads and uploads, and one forbidden call on another thread during a global-mode capture
invalidates it and fails the request in that step. Captures run in CUDA's ``thread_local``
capture mode (only this thread's calls are checked), and the per-step index upload is staged in
the pinned ring reserved at start-up (``kestrel_kernels/pinned.py``), so nothing is pinned while
serving. A capture that fails at start-up is logged with its reason (``failures``) and that
bucket decodes eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.text import PagedKV
from kestrel.runtime.compiled import CompiledDecode
from kestrel.runtime.decode import LANES, TOKEN_IDS, decode_static
from kestrel.tokens import CoordToken, SizeToken, TextToken
from kestrel_kernels.counting import graph_body
from kestrel_kernels.graph_inputs import DecodeGraphInputs, GraphedBackend

__all__ = ["DecodeGraphs", "GraphCapture", "bucket_sizes", "graphs_supported"]

log = logging.getLogger("kestrel.runtime")

Token = TextToken | CoordToken | SizeToken


def graphs_supported(model: MoondreamModel, backend: GraphedBackend) -> bool:
    """Whether decode can be graph-captured: CUDA, fp16/bf16 weights, a backend that
    ``captures_decode`` (the ``fa`` backend)."""
    if model.device.type != "cuda" or model.dtype not in (torch.float16, torch.bfloat16):
        return False
    return backend.captures_decode


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


class GraphCapture:
    """Captures CUDA graphs on one device into one shared memory pool, in ``thread_local``
    capture mode; ``captures`` counts them (tests stand in for this class)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None
        self.captures = 0

    def capture(self, fn: Callable[[], tuple[Tensor, ...]]) -> tuple[object, tuple]:
        """Warm ``fn`` up twice on a side stream (compiles its kernels), then capture it:
        (the graph, ``fn``'s outputs, which every replay overwrites). Raises what CUDA raised
        if the capture failed (after waiting for the device)."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self.captures += 1
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn()
        except RuntimeError:
            torch.cuda.synchronize(self.device)
            raise
        return graph, out


@dataclass(slots=True)
class _Bucket:
    """Static buffers of one batch size and, once captured, its graph."""

    size: int
    inputs: DecodeGraphInputs  # rows, lengths; lanes: token ids, override flags
    override_BC: Tensor  # embeddings of the override rows
    hidden_BC: Tensor | None = None
    logits_BV: Tensor | None = None
    graph: object | None = None  # a torch.cuda.CUDAGraph: replay()


class DecodeGraphs:
    """Runs ``decode_static`` for the runtime: graph replay per bucket, or eagerly."""

    def __init__(
        self,
        model: MoondreamModel,
        kv: PagedKV,
        page_table_RP: Tensor,
        *,
        max_batch_size: int,
        backend: GraphedBackend,
        capture: bool = True,
        compile: bool = False,
    ) -> None:
        self.model, self.kv, self.page_table_RP = model, kv, page_table_RP
        self.backend = backend
        self.capture = capture
        # compile: the step built by torch.compile (compiled.py), once per bucket in the warm-up
        self.compiled = CompiledDecode() if compile else None
        self.sizes = bucket_sizes(max_batch_size)
        self._buckets: dict[int, _Bucket] = {}
        self._capturer: GraphCapture | None = None
        self.failures: dict[int, str] = {}  # bucket size -> why its capture failed
        self.replays = 0

    @property
    def captured(self) -> tuple[int, ...]:
        """Bucket sizes that have a captured graph."""
        return tuple(sorted(s for s, b in self._buckets.items() if b.graph is not None))

    def run(
        self,
        rows: Sequence[int],
        lengths: Sequence[int],
        tokens: Sequence[Token] | None,
        ids_B: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Decode ``len(rows)`` rows fed ``tokens``, or the text ids ``ids_B`` (int64, on the
        device: a look-ahead step); returns fresh (hidden [n, C], logits [n, V]) tensors."""
        n = len(rows)
        bucket = self._bucket(next(s for s in self.sizes if s >= n))
        if tokens is None:
            is_text, ids = [True] * n, [0] * n
        else:
            is_text = [isinstance(t, TextToken) for t in tokens]
            ids = [t.token_id if text else 0 for t, text in zip(tokens, is_text, strict=True)]
        flags = [0 if text else 1 for text in is_text]
        bucket.inputs.load(bucket.inputs.host(rows, lengths, ids, flags))
        if ids_B is not None:
            bucket.inputs.lane(TOKEN_IDS)[:n].copy_(ids_B)  # device to device, after the upload
        elif not all(is_text):
            assert tokens is not None
            bucket.override_BC[:n].copy_(embed_tokens(list(tokens), self.model))
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
        else:
            with graph_body():  # what a replay would launch, for a launch counter
                self._forward(bucket)
        assert bucket.hidden_BC is not None and bucket.logits_BV is not None
        return bucket.hidden_BC[:n].clone(), bucket.logits_BV[:n].clone()

    def capture_all(self) -> None:
        """Make every bucket's buffers and, with ``capture``, capture its graph: at start-up,
        before any request runs (the module doc says why never later). A failed capture is
        logged and kept in ``failures``; that bucket decodes eagerly."""
        for size in self.sizes:
            bucket = self._bucket(size)
            if self.capture and bucket.graph is None and size not in self.failures:
                self._capture(bucket)

    # ------------------------------------------------------------------ internals
    def _step(self, bucket: _Bucket) -> tuple[Tensor, Tensor]:
        step = decode_static if self.compiled is None else self.compiled
        return step(self.model, self.kv, self.page_table_RP, bucket.inputs, bucket.override_BC)

    def _forward(self, bucket: _Bucket) -> None:
        bucket.hidden_BC, bucket.logits_BV = self._step(bucket)

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            dev, dim = self.page_table_RP.device, self.model.config.text.dim
            bucket = _Bucket(
                size,
                self.backend.decode_graph_inputs(size, dev, lanes=LANES),
                torch.zeros(size, dim, dtype=self.model.dtype, device=dev),
            )
            self._buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Capture ``bucket``'s step; on failure log why and leave it eager. The buffers hold
        padding rows while this runs, so no KV page is written."""
        if self._capturer is None:
            self._capturer = GraphCapture(self.page_table_RP.device)
        try:
            graph, (hidden, logits) = self._capturer.capture(lambda: self._step(bucket))
        except RuntimeError as exc:  # e.g. a kernel that syncs; serve this bucket eagerly
            self.failures[bucket.size] = str(exc)
            log.warning("decode graph capture failed for batch %d (%s); eager", bucket.size, exc)
            return
        bucket.hidden_BC, bucket.logits_BV, bucket.graph = hidden, logits, graph
