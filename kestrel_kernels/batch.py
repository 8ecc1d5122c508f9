"""What one decoder forward attends with, as one value: ``AttentionBatch``.

A forward over ``[B, T]`` new positions needs, besides its embeddings, the same few tensors in
every layer: each position's absolute position (RoPE) and the page its K/V go to, each row's
page-table row, key and query counts and bidirectional blocks, and the host-known facts the
attention plan is built from (a bound on the causal queries, whether padding rows must be
zeros, the backend object). ``AttentionBatch`` holds them, checked once when it is made (shapes,
dtypes, devices: ``contract.validate_batch_inputs``; no host read, so it can be made inside a
captured or compiled step). ``kestrel_kernels.plan_batch`` turns it into the forward's
``AttentionPlan`` and ``kestrel_kernels.attend`` runs one layer's attention from that plan.

The constructors are the forms the runtime builds: ``from_rows`` for a (padded) prefill, whose
int32 metadata is laid out by ``RowsLayout`` in one block (uploaded per call, or a captured
graph's fixed buffer), and ``decode`` / ``decode_host`` for one new position per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kestrel_kernels.contract import AttentionMeta, KernelInputError, validate_batch_inputs
from kestrel_kernels.transfer import upload

if TYPE_CHECKING:
    from kestrel_kernels.plan import AttentionBackend

__all__ = ["AttentionBatch", "RowSpan", "RowsLayout", "RowsMeta"]


@dataclass(frozen=True, slots=True, eq=False)
class AttentionBatch:
    """The attention inputs of one forward over ``[B, T]`` new positions.

    ``positions_BT``: int64 (or int32) absolute positions; ``slot_mapping``: int32/int64
    ``[B*T]``, the page each position's K/V is written to, row-major (< 0: none);
    ``page_table``: int32 ``[B, max_pages]``; ``seqused_k``: int32 ``[B]``, keys per row after
    this forward; ``seqused_q``: int32 ``[B]`` real queries per row (None: all ``T``);
    ``bidir_regions``: int32 ``[B, 2]`` or ``[B, R, 2]`` blocks (None: none). ``causal_rows``:
    a host-known bound on each row's real queries outside its blocks (None: ``T``);
    ``zero_padding=False``: padding queries' outputs may hold anything; ``backend``: the
    attention backend (``kestrel_kernels.resolve_backend``; None: ``"auto"`` when planned).
    """

    positions_BT: Tensor
    slot_mapping: Tensor
    page_table: Tensor
    seqused_k: Tensor
    seqused_q: Tensor | None = None
    bidir_regions: Tensor | None = None
    causal_rows: int | None = None
    zero_padding: bool = True
    backend: AttentionBackend | None = None

    def __post_init__(self) -> None:
        validate_batch_inputs(
            self.positions_BT, self.slot_mapping, self.page_table, self.seqused_k,
            self.seqused_q, self.bidir_regions,
        )  # fmt: skip
        bound = self.causal_rows
        if bound is not None and (not isinstance(bound, int) or bound < 0):
            raise KernelInputError(f"causal_rows must be None or an int >= 0, got {bound!r}")

    @property
    def rows(self) -> int:
        return int(self.positions_BT.shape[0])

    @property
    def q_len(self) -> int:
        return int(self.positions_BT.shape[1])

    @property
    def meta(self) -> AttentionMeta:
        """The attention metadata of its (causal) calls."""
        return AttentionMeta(self.page_table, self.seqused_k, self.seqused_q, self.bidir_regions)

    @classmethod
    def from_pages(
        cls, positions_BT: Tensor, pages_BK: Tensor, seqused_k: Tensor, *, padded: bool = False,
        **options,
    ) -> AttentionBatch:  # fmt: skip
        """Rows whose position ``t`` writes page ``pages_BK[b, positions_BT[b, t]]``. With
        ``padded``, a position of -1 is padding: computed at position 0, writing no K/V (slot
        -1). ``options``: the other fields (``seqused_q``, ``bidir_regions``, ...)."""
        positions_BT = positions_BT.long()
        if padded:
            real_BT, positions_BT = positions_BT >= 0, positions_BT.clamp(min=0)
            slots = torch.where(real_BT, pages_BK.gather(1, positions_BT), -1)
        else:
            slots = pages_BK.gather(1, positions_BT)
        return cls(positions_BT, slots.reshape(-1), pages_BK, seqused_k, **options)

    @classmethod
    def from_rows(
        cls, meta: RowsMeta, pages_BK: Tensor, *, padded: bool, **options
    ) -> AttentionBatch:
        """A prefill over ``RowsLayout`` metadata and the rows' pages (``pages_BK``, row ``b``
        of the batch). Not ``padded``: every row's ``T`` positions are real and no query count
        is passed on (nothing to mask)."""
        return cls.from_pages(
            meta.positions_BT, pages_BK, meta.seqused_k, padded=padded,
            seqused_q=meta.seqused_q if padded else None, bidir_regions=meta.regions, **options,
        )  # fmt: skip

    @classmethod
    def decode(
        cls, pages_BK: Tensor, lengths_B: Tensor, *, live_B: Tensor | None = None,
        backend: AttentionBackend | None = None,
    ) -> AttentionBatch:  # fmt: skip
        """One new position per row at ``lengths_B`` (int64, KV length before it), written to
        ``pages_BK[b, lengths_B[b]]``; rows where the bool ``live_B`` is False write nothing
        (slot -1). No host read: the form a captured decode step builds."""
        slots_B = pages_BK.gather(1, lengths_B[:, None])[:, 0].to(torch.int64)
        if live_B is not None:
            slots_B = torch.where(live_B, slots_B, -1)
        seqused_k = (lengths_B + 1).to(torch.int32)
        return cls(lengths_B[:, None], slots_B, pages_BK, seqused_k, backend=backend)

    @classmethod
    def decode_host(
        cls, page_table_RP: Tensor, rows: Sequence[int], lengths: Sequence[int], *,
        backend: AttentionBackend | None = None,
    ) -> AttentionBatch:  # fmt: skip
        """``decode`` of batch rows ``rows`` (of the runtime's page table ``page_table_RP``)
        at the host's ``lengths``: one upload, the table cut to the longest row."""
        if len(rows) != len(lengths) or not rows:
            raise KernelInputError(
                f"decode needs one length per row and at least one row, got {len(rows)} rows "
                f"and {len(lengths)} lengths"
            )
        dev = page_table_RP.device
        rows_B, lengths_B = upload([list(rows), list(lengths)], torch.int64, dev).unbind(0)
        pages_BK = page_table_RP[rows_B, : max(lengths) + 1]
        return cls.decode(pages_BK, lengths_B, backend=backend)


@dataclass(frozen=True, slots=True)
class RowSpan:
    """One row of a prefill, on the host: its page-table ``row``, its new positions
    ``start .. end - 1`` (``end``: the row's KV length after the forward) and the ``(start,
    end)`` bidirectional blocks some of whose queries it computes."""

    row: int
    start: int
    end: int
    regions: tuple[tuple[int, int], ...] = ()

    @property
    def n(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RowsMeta:
    """Views of one ``RowsLayout`` block: positions ``[B, T]`` (-1 on padding), then per row
    ``seqused_k``, ``seqused_q``, its page-table row, its last real query's packed index
    ``b * T + n - 1``, and its blocks (``[B, 2]`` for one per row, ``[B, R, 2]``, or None)."""

    positions_BT: Tensor
    seqused_k: Tensor
    seqused_q: Tensor
    rows_B: Tensor
    last_B: Tensor
    regions: Tensor | None


@dataclass(frozen=True, slots=True)
class RowsLayout:
    """Where a ``[B, T]`` prefill's int32 metadata lies in one flat block of ``size`` ints,
    with room for ``R`` bidirectional blocks per row (``R = 0``: none). Padding rows (fewer
    spans than ``B``) have no position, one key and query (page 0: row 0 is the padding row)
    and no block, so they write nothing and read one harmless page."""

    B: int
    T: int
    R: int = 0

    @property
    def size(self) -> int:
        return self.B * self.T + 4 * self.B + 2 * self.R * self.B

    def encode(self, spans: Sequence[RowSpan]) -> list[int]:
        """The block's values for ``spans`` (at most ``B`` rows of at most ``T`` positions
        and ``R`` blocks each), padding rows filled in."""
        B, T, R, pad = self.B, self.T, self.R, self.B - len(spans)
        if pad < 0 or any(s.n < 0 or s.n > T or len(s.regions) > R for s in spans):
            raise KernelInputError(f"spans {spans} do not fit a [{B}, {T}] layout with {R} blocks")
        out = [p for s in spans for p in [*range(s.start, s.end), *[-1] * (T - s.n)]]
        out += [-1] * (T * pad)
        out += [s.end for s in spans] + [1] * pad  # seqused_k
        out += [s.n for s in spans] + [1] * pad  # seqused_q
        out += [s.row for s in spans] + [0] * pad  # page-table rows
        out += [b * T + max(s.n - 1, 0) for b, s in enumerate(spans)]
        out += [b * T for b in range(len(spans), B)]  # last real query (padding: its first)
        for s in spans:
            out += [v for r in (*s.regions, *[(0, 0)] * (R - len(s.regions))) for v in r]
        return out + [0] * (2 * R * pad)

    def views(self, block: Tensor) -> RowsMeta:
        """The fields of ``block`` (int32 ``[size]``) as views, no copy."""
        if block.dtype != torch.int32 or tuple(block.shape) != (self.size,):
            raise KernelInputError(
                f"a {self} block must be int32 [{self.size}], got {block.dtype} {list(block.shape)}"
            )
        B, T, R = self.B, self.T, self.R
        rest = block[B * T : B * T + 4 * B].view(4, B)
        regions = block[B * T + 4 * B :].view(B, R, 2) if R else None
        if regions is not None and R == 1:
            regions = regions[:, 0]
        return RowsMeta(block[: B * T].view(B, T), rest[0], rest[1], rest[2], rest[3], regions)
