"""``ForwardInputs`` / ``AttentionBatch``: the one value a decoder forward attends with.

Each constructor is compared with what the runtime built before it existed (the formulas are
restated here: decode rows from host lists, the static decode step's device-side rows, a padded
prefill with and without image blocks, the prefill graphs' fixed buffers); then the errors for
bad shapes and dtypes, the adapters' rules, and ``attend`` against the explicit kernel call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kestrel_kernels as kk
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.lora import load_adapter
from kestrel.runtime.prefill import PrefillItem
from kestrel.runtime.prefill_graphs import PrefillGraphBuffers
from kestrel_kernels.backends import TORCH
from kestrel_kernels.batch import AttentionBatch, RowsLayout, RowSpan
from kestrel_kernels.contract import KernelInputError
from tests.conftest import fixture_dir

CPU = torch.device("cpu")

I32, I64 = torch.int32, torch.int64


def _table(rows: int = 6, width: int = 40) -> torch.Tensor:
    """A runtime-like page table: row 0 is the padding row (page 0), others distinct pages."""
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(rows * width, generator=g).view(rows, width).to(I32) + 1
    table[0] = 0
    return table


def _same(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None and got.dtype == want.dtype and torch.equal(got, want)


def test_decode_from_host_lists_matches_the_old_eager_step() -> None:
    table, rows, lengths = _table(), [3, 1, 4], [7, 0, 12]
    got = AttentionBatch.decode_host(table, rows, lengths, backend=TORCH)
    rows_B, lengths_B = torch.tensor([rows, lengths], dtype=I64).unbind(0)
    pages = table[rows_B, : max(lengths) + 1]
    _same(got.positions_BT, lengths_B[:, None])
    _same(got.slot_mapping, pages.gather(1, lengths_B[:, None]).reshape(-1).to(torch.long))
    _same(got.page_table, pages)
    _same(got.seqused_k, (lengths_B + 1).to(I32))
    assert got.seqused_q is None and got.bidir_regions is None and got.backend is TORCH
    assert (got.rows, got.q_len, got.causal_rows, got.zero_padding) == (3, 1, None, True)
    with pytest.raises(KernelInputError, match="one length per row"):
        AttentionBatch.decode_host(table, [1, 2], [3], backend=TORCH)


def test_static_decode_rows_match_the_old_device_side_step() -> None:
    table = _table()
    rows_B, lengths_B = torch.tensor([2, 0, 5, 0]), torch.tensor([9, 0, 3, 0])  # two padding
    pages = table.index_select(0, rows_B)
    got = AttentionBatch.decode(pages, lengths_B, live_B=rows_B > 0)
    slots = pages.gather(1, lengths_B[:, None])[:, 0].to(I64)
    _same(got.slot_mapping, torch.where(rows_B > 0, slots, -1))
    assert got.slot_mapping.tolist()[1::2] == [-1, -1]  # padding rows write nothing
    _same(got.seqused_k, (lengths_B + 1).to(I32))
    assert got.page_table is pages  # full width, no copy


def _items(dim: int = 4) -> list[PrefillItem]:
    """A miss with its image block (BOS + 5), a hit of 3 and a text row of 6 positions."""
    x = torch.zeros(8, dim)
    return [
        PrefillItem(x, row=2, skip=0, prompt_length=8, regions=((0, 6),)),
        PrefillItem(x[:3], row=4, skip=9, prompt_length=12),
        PrefillItem(x[:6], row=1, skip=2, prompt_length=8),
    ]


def _old_metadata(items, T: int) -> dict[str, list]:
    """What ``prefill._Metadata.upload`` held for ``items`` (padded rows)."""
    most = max(len(it.regions) for it in items)
    return {
        "positions": [[*range(it.skip, it.prompt_length), *[-1] * (T - it.n)] for it in items],
        "seqused_k": [it.prompt_length for it in items],
        "rows": [it.row for it in items],
        "seqused_q": [it.n for it in items],
        "last": [b * T + it.n - 1 for b, it in enumerate(items)],
        "regions": [[*it.regions, *[(0, 0)] * (most - len(it.regions))] for it in items],
    }


def _old_slots(positions: list[list[int]], pages: torch.Tensor) -> torch.Tensor:
    """``paged_text_forward``'s slots with padding: -1 where a position is -1."""
    pos = torch.tensor(positions, dtype=I32).long()
    real, pos = pos >= 0, pos.clamp(min=0)
    return torch.where(real, pages.gather(1, pos), -1).reshape(-1)


def test_padded_prefill_rows_match_the_old_metadata_and_slots() -> None:
    items, table, T = _items(), _table(), 8
    layout = RowsLayout(len(items), T, 1)
    meta = layout.views(torch.tensor(layout.encode([it.span for it in items]), dtype=I32))
    old = _old_metadata(items, T)
    assert meta.positions_BT.tolist() == old["positions"]
    assert meta.seqused_k.tolist() == old["seqused_k"] and meta.rows_B.tolist() == old["rows"]
    assert meta.seqused_q.tolist() == old["seqused_q"] and meta.last_B.tolist() == old["last"]
    assert meta.regions.tolist() == [list(row[0]) for row in old["regions"]]
    assert meta.regions.is_contiguous()  # no copy needed before the kernels
    pages = table[:, :12].index_select(0, meta.rows_B)
    got = AttentionBatch.from_rows(meta, pages, padded=True, causal_rows=3, backend=TORCH)
    _same(got.positions_BT, torch.tensor(old["positions"]).clamp(min=0))
    _same(got.slot_mapping, _old_slots(old["positions"], pages))
    assert got.seqused_q is meta.seqused_q and got.bidir_regions is meta.regions
    assert got.causal_rows == 3 and got.backend is TORCH


def test_unpadded_rows_pass_no_query_counts_and_several_blocks_keep_their_axis() -> None:
    x = torch.zeros(5, 4)
    items = [PrefillItem(x, row=1, skip=0, prompt_length=5, regions=((0, 2), (3, 5))),
             PrefillItem(x, row=2, skip=3, prompt_length=8)]  # fmt: skip
    layout = RowsLayout(2, 5, 2)
    meta = layout.views(torch.tensor(layout.encode([it.span for it in items]), dtype=I32))
    assert meta.regions.tolist() == [[[0, 2], [3, 5]], [[0, 0], [0, 0]]]
    pages = _table()[1:3, :8]
    got = AttentionBatch.from_rows(meta, pages, padded=False)
    assert got.seqused_q is None  # every row's 5 positions are real: nothing to mask
    _same(got.slot_mapping, pages.gather(1, meta.positions_BT.long()).reshape(-1))
    assert (
        RowsLayout(2, 5, 0).views(torch.zeros(RowsLayout(2, 5, 0).size, dtype=I32)).regions is None
    )


def test_graph_buffers_give_the_eager_rows_in_the_same_type() -> None:
    items, table = _items()[1:], _table()  # two hits in a 4-row bucket
    batch = PrefillGraphBuffers.allocate((4, 8, False, None), 4, torch.float32, TORCH, CPU)
    batch.load(items)
    got = batch.inputs(table)
    assert isinstance(got, ForwardInputs) and got.lora is None
    att = got.attention
    layout = RowsLayout(2, 8, 0)
    eager_meta = layout.views(torch.tensor(layout.encode([it.span for it in items]), dtype=I32))
    eager = AttentionBatch.from_rows(eager_meta, table.index_select(0, eager_meta.rows_B),
                                     padded=True)  # fmt: skip
    for name in ("positions_BT", "seqused_k", "seqused_q"):
        assert torch.equal(getattr(att, name)[:2], getattr(eager, name))
    assert torch.equal(att.slot_mapping[:16], eager.slot_mapping)
    assert att.slot_mapping[16:].tolist() == [-1] * 16  # padding rows write nothing
    assert att.seqused_k[2:].tolist() == [1, 1] and att.page_table[2:].eq(0).all()
    assert att.bidir_regions is None and att.zero_padding is False
    assert batch.attention.views().last_B.tolist() == [2, 8 + 5, 16, 24]


def test_graph_buffers_keep_the_image_block() -> None:
    item = _items()[0]
    batch = PrefillGraphBuffers.allocate((1, 64, True, 64), 4, torch.float32, TORCH, CPU)
    batch.load([item])
    att = batch.inputs(_table(width=64)).attention
    assert att.bidir_regions.tolist() == [[0, 6]] and att.causal_rows == 64


def test_adapters_are_normalised_and_checked() -> None:
    cfg = MoondreamConfig.from_json_file(fixture_dir() / "config.json")
    ad = load_adapter(fixture_dir() / "adapter", cfg)
    att = AttentionBatch.decode_host(_table(), [1, 2], [3, 4])
    assert ForwardInputs.of(att, [None, None]).lora is None  # no row has one: no LoRA pass
    assert ForwardInputs.of(att, [ad, None]).lora == (ad, None)
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        ForwardInputs.of(att, [ad, None, ad])
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        ForwardInputs.of(att, [None, None, None])
    with pytest.raises(TypeError, match="LoraAdapter or None"):
        ForwardInputs.of(att, [ad, "french"])
    with pytest.raises(TypeError, match="AttentionBatch"):
        ForwardInputs(object())


def _fields(**change) -> dict:
    B, T = 2, 3
    fields = dict(
        positions_BT=torch.zeros(B, T, dtype=I64),
        slot_mapping=torch.zeros(B * T, dtype=I64),
        page_table=torch.zeros(B, 5, dtype=I32),
        seqused_k=torch.ones(B, dtype=I32),
    )
    return fields | change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"positions_BT": torch.zeros(6, dtype=I64)}, r"positions_BT must be a \[B, T\]"),
        ({"positions_BT": torch.zeros(2, 3)}, "positions_BT must be int32/int64"),
        ({"slot_mapping": torch.zeros(5, dtype=I64)}, r"slot_mapping must be .*\[B\*T=6\]"),
        ({"slot_mapping": torch.zeros(6)}, "slot_mapping must be int32/int64"),
        ({"page_table": torch.zeros(2, 5, dtype=I64)}, "page_table must be int32"),
        ({"page_table": torch.zeros(3, 5, dtype=I32)}, r"page_table must be \[B=2"),
        ({"seqused_k": torch.ones(2, dtype=I64)}, "seqused_k must be int32"),
        ({"seqused_q": torch.ones(3, dtype=I32)}, r"seqused_q must have shape \[2\]"),
        ({"bidir_regions": torch.zeros(2, 3, dtype=I32)}, r"bidir_regions must have shape"),
        ({"causal_rows": -1}, "causal_rows must be None or an int >= 0"),
        ({"seqused_k": torch.ones(2, dtype=I32, device="meta")}, "seqused_k is on meta"),
    ],
)
def test_bad_inputs_say_what_is_wrong(change, message) -> None:
    with pytest.raises(KernelInputError, match=message):
        AttentionBatch(**_fields(**change))


def test_layouts_refuse_what_does_not_fit() -> None:
    layout = RowsLayout(1, 4, 0)
    with pytest.raises(KernelInputError, match="do not fit"):
        layout.encode([RowSpan(1, 0, 5)])  # 5 positions in a 4-position row
    with pytest.raises(KernelInputError, match="do not fit"):
        layout.encode([RowSpan(1, 0, 2, ((0, 1),))])  # a block where the layout has none
    with pytest.raises(KernelInputError, match=r"int32 \[8\]"):
        layout.views(torch.zeros(8, dtype=I64))


def test_attend_is_the_explicit_kernel_call_and_text_forward_checks_its_rows() -> None:
    g = torch.Generator().manual_seed(1)
    B, T, H, D, pages = 2, 4, 4, 8, 30
    k, v = (torch.randn(pages, 2, D, generator=g) for _ in range(2))
    q = torch.randn(B, T, H, D, generator=g)
    table = torch.arange(1, 1 + B * 12, dtype=I32).view(B, 12)
    att = AttentionBatch(
        positions_BT=torch.tensor([[6, 7, 8, 9], [2, 3, 0, 0]]),
        slot_mapping=torch.zeros(B * T, dtype=I64),
        page_table=table,
        seqused_k=torch.tensor([10, 4], dtype=I32),
        seqused_q=torch.tensor([4, 2], dtype=I32),
        bidir_regions=torch.tensor([[0, 7], [0, 0]], dtype=I32),
        backend=TORCH,
    )
    plan = kk.plan_batch(att, q.dtype)
    got = kk.attend(q, k, v, plan)
    meta = kk.AttentionMeta(table, att.seqused_k, att.seqused_q, att.bidir_regions)
    want = kk.paged_attention(q, k, v, meta, backend=TORCH)
    assert torch.equal(got, want)
    assert plan.meta.page_table is table and plan.q_len == T and plan.backend is TORCH
    from kestrel.moondream.text import text_forward

    inputs = ForwardInputs(dataclasses.replace(att, backend=TORCH))
    with pytest.raises(ValueError, match=r"attention batch is \[2, 4\]"):
        text_forward(torch.zeros(2, 5, 8), None, None, inputs, None)
