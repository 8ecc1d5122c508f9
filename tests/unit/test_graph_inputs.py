"""The fixed buffers a CUDA graph's attention reads (``kestrel_kernels/graph_inputs.py``), made
by the backend: a replay's refill is one counted non-blocking upload, and the batch read from
the buffers equals the one the eager path builds from host lists."""

from __future__ import annotations

import pytest
import torch

from kestrel_kernels.backends import FLASH, TORCH, TorchBackend, TritonDecode
from kestrel_kernels.batch import AttentionBatch, RowSpan
from kestrel_kernels.contract import KernelInputError
from kestrel_kernels.counting import LaunchCounter
from kestrel_kernels.decode_route import DecodeRoute
from kestrel_kernels.graph_inputs import DecodeGraphInputs, PrefillGraphInputs

CPU = torch.device("cpu")


def _table(rows: int = 5, width: int = 12) -> torch.Tensor:
    return (torch.arange(rows * width, dtype=torch.int32).view(rows, width) * 3 + 1) % 97


def test_decode_inputs_read_as_the_eager_batch_and_pad_the_rest() -> None:
    backend = TritonDecode(FLASH, DecodeRoute({4: "triton"}))
    inputs = backend.decode_graph_inputs(4, CPU, lanes=2)
    assert isinstance(inputs, DecodeGraphInputs) and inputs.size == 4
    with LaunchCounter() as c:
        inputs.load(inputs.host([2, 3], [5, 7], [11, 12], [0, 1]))
    assert (c.uploads_nonblocking, c.uploads_blocking) == (1, 0)
    assert inputs.lane(0).tolist() == [11, 12, 0, 0] and inputs.lane(1).tolist() == [0, 1, 0, 0]
    table = _table()
    got = inputs.batch(table)
    want = AttentionBatch.decode_host(table, [2, 3], [5, 7])
    assert got.backend is backend  # the step plans on the backend that made the buffers
    assert torch.equal(got.positions_BT[:2], want.positions_BT)
    assert torch.equal(got.slot_mapping[:2], want.slot_mapping)
    assert torch.equal(got.seqused_k[:2], want.seqused_k)
    assert got.slot_mapping[2:].tolist() == [-1, -1]  # padding rows write nothing
    assert got.seqused_k[2:].tolist() == [1, 1] and got.page_table.shape == (4, 12)


def test_decode_inputs_refuse_what_does_not_fit() -> None:
    inputs = TORCH.decode_graph_inputs(2, CPU, lanes=1)
    with pytest.raises(KernelInputError, match="3 rows and 1 lanes"):
        inputs.host([1, 2, 3], [1, 1, 1], [0, 0, 0])
    with pytest.raises(KernelInputError, match="2 rows and 0 lanes"):
        inputs.host([1, 2], [1, 1])
    with pytest.raises(KernelInputError, match=">= 1 row"):
        TORCH.decode_graph_inputs(0, CPU)


def test_prefill_inputs_hold_their_shape_and_bound() -> None:
    inputs = TORCH.prefill_graph_inputs(2, 8, CPU, regions=True, causal_rows=4)
    assert isinstance(inputs, PrefillGraphInputs) and inputs.backend is TORCH
    spans = [RowSpan(3, 0, 6, ((0, 2),))]
    with LaunchCounter() as c:
        inputs.load(inputs.host(spans))
    assert c.uploads_nonblocking == 1
    got = inputs.batch(_table())
    assert got.causal_rows == 4 and got.zero_padding is False
    assert got.bidir_regions.tolist() == [[0, 2], [0, 0]]
    assert got.seqused_k.tolist() == [6, 1] and got.seqused_q.tolist() == [6, 1]
    assert got.slot_mapping[6:].eq(-1).all()  # the row's padding positions and the pad row
    plain = TORCH.prefill_graph_inputs(1, 8, CPU, regions=False, causal_rows=None)
    with pytest.raises(KernelInputError, match="no bidirectional block"):
        plain.host(spans)
    plain.load(plain.host([RowSpan(3, 2, 5)]))
    assert plain.batch(_table()).bidir_regions is None


class _Recording(TorchBackend):
    """The torch backend, noting each graph buffer it is asked for and each plan."""

    def __init__(self) -> None:
        self.made: list[tuple] = []
        self.plans = 0

    def plan(self, meta, q_len, **kw):
        self.plans += 1
        return super().plan(meta, q_len, **kw)

    def decode_graph_inputs(self, size, device, lanes=0):
        self.made.append(("decode", size, lanes))
        return super().decode_graph_inputs(size, device, lanes)

    def prefill_graph_inputs(self, rows, tokens, device, *, regions, causal_rows):
        self.made.append(("prefill", rows, tokens, regions, causal_rows))
        return super().prefill_graph_inputs(rows, tokens, device, regions=regions,
                                            causal_rows=causal_rows)  # fmt: skip


def test_the_graph_sets_take_their_buffers_from_the_backend() -> None:
    """Every decode bucket and every prefill bucket reads buffers its backend made, and a
    step run from them plans on that backend."""
    from kestrel.moondream.model import MoondreamModel
    from kestrel.runtime.cuda_graphs import DecodeGraphs
    from kestrel.runtime.prefill_graphs import PrefillGraphs
    from kestrel.runtime.runtime import MoondreamRuntime
    from tests.conftest import FIXTURES

    model = MoondreamModel.from_pretrained(FIXTURES / "md2-tiny-a")
    backend = _Recording()
    rt = MoondreamRuntime(model, kv_cache_pages=64, max_batch_size=4, attention_backend=backend)
    assert rt.attention_backend is backend  # an object is served on as it is
    table = rt.page_table.page_table
    decode = DecodeGraphs(model, rt.kv, table, max_batch_size=4, backend=backend, capture=False)
    decode.capture_all()  # uncaptured: the buckets' buffers only
    assert [m for m in backend.made if m[0] == "decode"] == [("decode", s, 2) for s in (1, 2, 4)]
    prefill = PrefillGraphs(model, rt.kv, table, max_batch_size=4, backend=backend, capture=False)
    made = [m[1:] for m in backend.made if m[0] == "prefill"]
    assert made == list(prefill.shapes) and len(made) > 1
    before = backend.plans
    with torch.inference_mode():
        hidden, _ = decode.run([0], [0], None, torch.zeros(1, dtype=torch.int64))  # padding row
    assert backend.plans == before + 1 and hidden.shape == (1, model.config.text.dim)
