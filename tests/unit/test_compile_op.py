"""``kestrel::paged_attention``: the attention contract as one opaque op under ``torch.compile``.

Outside compile nothing changes; inside, dynamo sees one op per call whose eager implementation
runs the backend -- the torch reference here, and the FlashAttention path through the recording
fake binding of ``test_fa_contract`` (the CUDA code path, on CPU).
"""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

import kestrel_kernels as kk
from kestrel_kernels import compile_op, fa_backend, plan
from kestrel_kernels.backends import FLASH, TORCH
from tests.attention_args import with_meta
from tests.tolerance import assert_close
from tests.unit.test_fa_contract import RecordingBinding, make_inputs

OPS = (torch.ops.kestrel.paged_attention, torch.ops.kestrel.paged_attention.default)


class Recorder:
    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_nodes(self) -> list[torch.fx.Node]:
        return [n for g in self.graphs for n in g.graph.nodes if n.target in OPS]


def untraceable_probe(device=None) -> fa_backend.FaProbe:
    """Like the real probe on CUDA, dynamo cannot trace it (fullgraph would fail): the backend
    must be resolved by running it, not by tracing it."""
    torch._dynamo.graph_break()
    return fa_backend.FaProbe(True, "fake")


@pytest.fixture
def fake(monkeypatch) -> RecordingBinding:
    binding = RecordingBinding()
    monkeypatch.setattr(fa_backend, "probe", untraceable_probe)
    monkeypatch.setattr(fa_backend, "load_binding", lambda: binding)
    monkeypatch.delenv("KESTREL_FA_PAGED", raising=False)
    return binding


def _op_args(a: dict, backend: str) -> tuple:
    d = a["q"].shape[-1]
    return (a["q"], a["k_cache"], a["v_cache"], a["page_table"], a["seqused_k"], a["seqused_q"],
            a["bidir_regions"], True, d**-0.5, backend, 0, None, None, None, None, None, None,
            None, None)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [dict(k_lens=[7, 3], q_len=1),  # decode
     dict(k_lens=[9, 6], q_len=5, q_lens=[5, 2], regions=[[0, 4], [0, 0]])],  # padded prefill
)  # fmt: skip
def test_op_schema_fake_and_eager_agree(case) -> None:
    """torch.library.opcheck: the schema, the fake implementation's shape and dtype, and the
    dispatcher paths agree with the eager implementation, which equals ``paged_attention``."""
    a = make_inputs(**case)
    torch.library.opcheck(torch.ops.kestrel.paged_attention.default, _op_args(a, "torch"))
    want = kk.paged_attention(**with_meta(a), backend=TORCH)
    assert torch.equal(torch.ops.kestrel.paged_attention(*_op_args(a, "torch")), want)


def test_eager_calls_never_use_the_op(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the op is for traced code only")

    monkeypatch.setattr(compile_op, "attention_op", refuse)
    a = make_inputs([5, 2], 1)
    assert kk.paged_attention(**with_meta(a), backend=TORCH).shape == a["q"].shape


def _two_layers(a: dict, backend: kk.AttentionBackend | None):
    """A forward's attention: one plan, two layers' calls (each reads the same pages);
    ``backend`` None: "auto", resolved while tracing."""

    def forward(q, k, v, page_table, seqused_k, seqused_q, regions):
        meta = kk.AttentionMeta(page_table, seqused_k, seqused_q, regions)
        plan = kk.plan_attention(meta, q.shape[1], dtype=q.dtype, backend=backend)
        out = q
        for _ in range(2):
            out = kk.attend(out, k, v, plan)
        return out

    args = (a["q"], a["k_cache"], a["v_cache"], a["page_table"], a["seqused_k"], a["seqused_q"],
            a["bidir_regions"])  # fmt: skip
    return forward, args


@pytest.mark.parametrize("regions", [None, [[0, 40], [0, 0]]])
def test_fa_path_under_compile_passes_the_forwards_plan(fake, regions) -> None:
    """The backend resolves to ``fa`` while tracing; the segment plan is built once in the
    graph and handed to each layer's op; the fake kernel runs once per causal / non-causal
    pass of each layer (70 queries: the two-call plan), and the result equals the torch
    reference."""
    a = make_inputs([80, 50], 70, q_lens=[70, 30], regions=regions)
    forward, args = _two_layers(a, None)  # "auto": fa, resolved while tracing
    want, _ = _two_layers(a, TORCH)
    recorder = Recorder()
    kk.prepare_compile()
    got = torch.compile(forward, backend=recorder, fullgraph=True, dynamic=False)(*args)
    nodes = recorder.op_nodes()
    assert len(recorder.graphs) == 1 and len(nodes) == 2
    for node in nodes:
        assert node.args[9] == "fa" and node.args[11] is not None, "backend and plan passed in"
    assert len(fake.calls) == 2 * (1 if regions is None else 2)
    assert_close(got.float(), want(*args).float(), rel=0.05)


def test_import_does_not_load_dynamo() -> None:
    """Registering the op costs nothing at import; marking the resolver (``prepare_compile``)
    imports dynamo, so it waits until something compiles."""
    code = "import sys, kestrel, kestrel.runtime.compiled; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_unregistered_backend_object_reaches_the_op_whole() -> None:
    """A backend object that is not the registered one of its name (a stand-in binding, a
    measured decode route) goes through the op under a key of its own, and the op runs that
    object, not the registered one; the key dies with the object."""
    calls = []

    def stand_in(q, k, v, **kw):
        calls.append(q.shape[0])
        return torch.zeros_like(q), None

    backend = kk.FlashBackend(binding=stand_in)
    key = backend.key
    assert key.startswith("fa@") and plan.backend_of(key) is backend
    assert FLASH.key == kk.FlashBackend().key == "fa" and plan.backend_of("fa") is FLASH
    assert TORCH.key == "torch" and plan.backend_of("torch") is TORCH
    a = make_inputs([7, 3], 1)  # bfloat16, as FlashAttention takes
    forward, args = _two_layers(a, backend)
    recorder = Recorder()
    got = torch.compile(forward, backend=recorder, fullgraph=True, dynamic=False)(*args)
    assert [n.args[9] for n in recorder.op_nodes()] == [key, key]
    assert len(calls) == 2 and not got.any()  # the stand-in ran, once a layer
    del backend, forward, recorder
    torch._dynamo.reset()
    gc.collect()
    with pytest.raises(KeyError, match="no live attention backend"):
        plan.backend_of(key)
