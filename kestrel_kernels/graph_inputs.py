"""The fixed buffers a CUDA graph's attention reads, made by the backend the graph runs on.

A captured step cannot be handed new tensors: every replay reads the same buffers, and the
host refills them before each one. Which buffers those are, how a replay fills them and the
``AttentionBatch`` the step builds from them inside the graph are the attention backend's
(``AttentionBackend.decode_graph_inputs`` / ``prefill_graph_inputs``; SGLang's backends keep
the same split in their capture and replay metadata hooks). The runtime's graph sets
(``kestrel/runtime/cuda_graphs.py``, ``prefill_graphs.py``) hold one per bucket and refill it
with one non-blocking upload per replay (``load``: through the pinned ring on CUDA).

- ``DecodeGraphInputs``: one int64 ``[2 + lanes, B]`` block: each row's page-table row (0:
  the reserved padding row) and its KV length before the step, then ``lanes`` lanes of the
  caller's own per-row values (the decode step's token ids and override flags), so one upload
  carries the whole step. Padding rows write no page and read one key.
- ``PrefillGraphInputs``: one int32 ``RowsLayout`` block with room for one bidirectional block
  per row (positions, -1 on padding; key and query counts; page-table rows; each row's last
  position; its block), whether the bucket has blocks at all, and the causal bound the plan
  is built for. Padding positions and rows write nothing; padding queries' outputs are left
  unzeroed (the step drops them).

Both build their batch with no host read, so it is recorded into the graph; on a CPU the same
objects run the same step eagerly (the counting runs and the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kestrel_kernels.batch import AttentionBatch, RowsLayout, RowsMeta, RowSpan
from kestrel_kernels.contract import KernelInputError
from kestrel_kernels.plan import AttentionBackend
from kestrel_kernels.transfer import upload_into

__all__ = ["DecodeGraphInputs", "GraphedBackend", "PrefillGraphInputs"]


class GraphedBackend(AttentionBackend, Protocol):
    """An attention backend whose steps CUDA graphs replay: it makes the fixed buffers a
    graph's attention reads (``backends.BackendBase`` does, for every backend)."""

    def decode_graph_inputs(
        self, size: int, device: torch.device, lanes: int = 0
    ) -> DecodeGraphInputs: ...

    def prefill_graph_inputs(
        self, rows: int, tokens: int, device: torch.device, *, regions: bool,
        causal_rows: int | None,
    ) -> PrefillGraphInputs: ...  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class DecodeGraphInputs:
    """A decode graph's attention inputs for ``size`` rows (module doc)."""

    backend: AttentionBackend
    block: Tensor  # int64 [2 + lanes, size]

    @classmethod
    def allocate(
        cls, backend: AttentionBackend, size: int, device: torch.device, lanes: int = 0
    ) -> DecodeGraphInputs:
        if size < 1 or lanes < 0:
            raise KernelInputError(f"a decode graph needs >= 1 row and >= 0 lanes, got {size}, "
                                   f"{lanes}")  # fmt: skip
        return cls(backend, torch.zeros(2 + lanes, size, dtype=torch.int64, device=device))

    @property
    def size(self) -> int:
        return int(self.block.shape[1])

    def host(self, rows: Sequence[int], lengths: Sequence[int], *lanes: Sequence[int]) -> Tensor:
        """The block's values for ``len(rows)`` live rows, padding rows (row 0, length 0, 0 in
        every lane) filled in: what :meth:`load` uploads."""
        n, width = len(rows), self.block.shape[0]
        if n > self.size or len(lanes) != width - 2:
            raise KernelInputError(
                f"{n} rows and {len(lanes)} lanes for a [{width}, {self.size}] decode block"
            )
        pad = [0] * (self.size - n)
        return torch.tensor([[*v, *pad] for v in (rows, lengths, *lanes)], dtype=torch.int64)

    def load(self, host: Tensor) -> None:
        """``host`` (from :meth:`host`) into the block, without blocking."""
        upload_into(self.block, host)

    def lane(self, i: int) -> Tensor:
        """The caller's lane ``i``: a view of the block, ``[size]``."""
        return self.block[2 + i]

    def batch(self, page_table_RP: Tensor) -> AttentionBatch:
        """The step's attention batch, read from the block inside the graph: every row's full
        page-table row of ``page_table_RP``, one new position at its length."""
        rows_B, lengths_B = self.block[0], self.block[1]
        pages_BP = page_table_RP.index_select(0, rows_B)
        return AttentionBatch.decode(pages_BP, lengths_B, live_B=rows_B > 0, backend=self.backend)


@dataclass(frozen=True, slots=True, eq=False)
class PrefillGraphInputs:
    """A prefill graph's attention inputs for ``[B, T]`` new positions (module doc)."""

    backend: AttentionBackend
    layout: RowsLayout  # R = 1: room for one block per row
    regions: bool  # whether the rows have a bidirectional block
    causal_rows: int | None  # the bound on a row's queries outside its block (None: T)
    block: Tensor  # int32 [layout.size]

    @classmethod
    def allocate(
        cls, backend: AttentionBackend, rows: int, tokens: int, device: torch.device, *,
        regions: bool, causal_rows: int | None,
    ) -> PrefillGraphInputs:  # fmt: skip
        layout = RowsLayout(rows, tokens, 1)
        block = torch.zeros(layout.size, dtype=torch.int32, device=device)
        inputs = cls(backend, layout, regions, causal_rows, block)
        block.copy_(inputs.host([]))
        return inputs

    def host(self, spans: Sequence[RowSpan]) -> Tensor:
        """The block's values for ``spans`` (padding rows: no position, one key on page 0)."""
        if not self.regions and any(s.regions for s in spans):
            raise KernelInputError("this prefill graph's rows have no bidirectional block")
        return torch.tensor(self.layout.encode(spans), dtype=torch.int32)

    def load(self, host: Tensor) -> None:
        """``host`` (from :meth:`host`) into the block, without blocking."""
        upload_into(self.block, host)

    def views(self) -> RowsMeta:
        """The block's fields as views (``RowsLayout.views``)."""
        return self.layout.views(self.block)

    def batch(self, page_table_RP: Tensor) -> AttentionBatch:
        """The forward's attention batch, read from the block inside the graph: every row's
        full page-table row of ``page_table_RP``, padding writing nothing, padding queries'
        outputs unzeroed (they are dropped; positions do not mix)."""
        meta = self.views()
        if not self.regions:
            meta = dataclasses.replace(meta, regions=None)
        pages_BP = page_table_RP.index_select(0, meta.rows_B.long())
        return AttentionBatch.from_rows(
            meta, pages_BP, padded=True, causal_rows=self.causal_rows, zero_padding=False,
            backend=self.backend,
        )  # fmt: skip
