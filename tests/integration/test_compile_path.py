"""The opt-in ``torch.compile`` path (``kestrel.runtime.compiled``) on CPU, on the fixture model.

The compiled decode step stands in for ``decode_static`` inside ``DecodeGraphs`` (which is what
the runtime's ``compile=True`` does) and must give the eager step's logits; the compiled prefill
stands in for ``prefill_batch``. Structure checks use a recording dynamo backend: one graph, no
break, one opaque attention op per layer.
"""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch
from torch._dynamo.utils import counters

import kestrel.runtime.cuda_graphs as graphs_mod
import kestrel.runtime.runtime as runtime_mod
from kestrel import Engine
from kestrel.cli import common
from kestrel.engine import setup
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import coord_token, size_token
from kestrel.runtime.compiled import (
    CompiledDecode,
    CompiledPrefill,
    CompileUnavailableError,
    check_compile,
    compile_unavailable_reason,
)
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.decode import LANES, decode_static
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from kestrel_kernels.backends import TORCH
from tests.conftest import FIXTURES, fixture_dir
from tests.integration.conftest import scheduler_paused
from tests.integration.test_batched_prefill import _batched, _greedy, _requests
from tests.integration.test_runtime_cache import query_prompt
from tests.tolerance import assert_close
from tests.unit.test_compile_op import untraceable_probe
from tests.unit.test_fa_contract import RecordingBinding

ATTENTION_OP = (torch.ops.kestrel.paged_attention, torch.ops.kestrel.paged_attention.default)
pytestmark = [  # torch's own notices while dynamo and inductor load
    pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    """Equal up to summation order: a bound that scales with the values' magnitude."""
    assert_close(got, want, rel=rel)


class Recorder:
    """A dynamo backend that keeps each FX graph and runs it as traced (no codegen)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(gm)
        return gm.forward

    def count(self, targets) -> int:
        return sum(n.target in targets for g in self.graphs for n in g.graph.nodes)


def _prompts(model: MoondreamModel, lengths=(5, 8, 3)) -> list[list[TextToken]]:
    g = torch.Generator().manual_seed(5)
    bos = TextToken(model.config.tokenizer.bos_id)
    top = min(model.config.text.vocab_size, 700)
    return [[bos, *(TextToken(int(i)) for i in torch.randint(10, top, (n,), generator=g))]
            for n in lengths]  # fmt: skip


def _decode_run(rt, model, feeds) -> list[torch.Tensor]:
    """Three sequences (a 4-row bucket with one padding row), one step per feed."""
    rt.decode_graphs = DecodeGraphs(
        model, rt.kv, rt.page_table.page_table, max_batch_size=4, backend=TORCH, capture=False
    )
    states = [rt.start_sequence(p, max_new_tokens=len(feeds) + 1)[0] for p in _prompts(model)]
    out = [rt.decode_step(states, f) for f in feeds]
    assert torch.count_nonzero(rt.kv.k[0][0]) == 0, "padding rows must not write page 0"
    for s in states:
        rt.release_sequence(s)
    return out


def test_compiled_decode_equals_eager(make_runtime, model, monkeypatch) -> None:
    """Inductor's decode step gives the eager step's logits (coordinate / size override rows
    and a padding row included), and new lengths reuse the bucket's graph (no recompile)."""
    region = model.config.region
    feeds = [[TextToken(11), TextToken(12), TextToken(13)],
             [coord_token(300, region), TextToken(14), size_token(500, 600, region)],
             [TextToken(15), TextToken(16), TextToken(17)]]  # fmt: skip
    # The runtime's shapes are the compiled engine's below (6000 pages, 8 rows): inductor builds
    # this bucket's graph once for both tests (its cache keys on shapes, not on objects).
    make = lambda: make_runtime(attention_backend="torch")  # noqa: E731
    eager = _decode_run(make(), model, feeds)
    step = CompiledDecode()
    monkeypatch.setattr(graphs_mod, "decode_static", step)  # what DecodeGraphs(compile=True) does
    before = counters["stats"]["unique_graphs"]
    compiled = _decode_run(make(), model, feeds)
    assert counters["stats"]["unique_graphs"] - before == 1, "one graph for three steps"
    assert step.buckets == (4,)
    for got, want in zip(compiled, eager, strict=True):
        close(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fixture", ["md2-tiny-a", "md3-tiny-a"])
def test_decode_step_is_one_graph_with_one_attention_op_per_layer(fixture, make_runtime) -> None:
    """fullgraph=True: any graph break raises. Moondream 3's MoE layers trace (float32: the
    experts as per-row gathers); the KV write stays in the graph and reaches the pages."""
    model = MoondreamModel.from_pretrained(FIXTURES / fixture, device="cpu", dtype=torch.float32)
    rt = runtime_mod.MoondreamRuntime(
        model, kv_cache_pages=300, max_batch_size=2, attention_backend="torch"
    )
    states = [rt.start_sequence(p, max_new_tokens=3)[0] for p in _prompts(model, (4, 6))]
    rows = torch.tensor([s.batch_idx for s in states])
    lengths = torch.tensor([s.length for s in states])
    inputs = rt.attention_backend.decode_graph_inputs(2, rt.device, lanes=LANES)
    inputs.load(inputs.host(rows.tolist(), lengths.tolist(), [11, 12], [0, 0]))  # ids, flags
    override = torch.zeros(2, model.config.text.dim)
    args = (model, rt.kv, rt.page_table.page_table, inputs, override)
    slots = rt.page_table.page_table[rows, lengths].long()
    recorder = Recorder()
    with torch.inference_mode():
        got = CompiledDecode(compiler=recorder)(*args)
        written = rt.kv.k[0][slots].clone()
        rt.kv.k[0][slots] = 0
        want = decode_static(*args)
    assert len(recorder.graphs) == 1
    assert recorder.count(ATTENTION_OP) == model.config.text.n_layers
    close(got[1], want[1])
    close(written, rt.kv.k[0][slots])
    assert bool(written.abs().sum() > 0), "the compiled step wrote the new keys"
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()


@pytest.mark.slow  # ~25 s: three prefill buckets compiled by inductor
def test_compiled_prefill_equals_eager(make_runtime, model, images, monkeypatch) -> None:
    """Misses (two images and a text prompt) then hits, through the runtime, with
    ``CompiledPrefill`` in place of ``prefill_batch``: the same logits and the same greedy
    continuations."""
    first, hits = _requests(model.config, images)
    runs = {}
    for how in ("eager", "compiled"):
        rt = make_runtime(attention_backend="torch")
        if how == "compiled":
            prefill = CompiledPrefill()
            monkeypatch.setattr(runtime_mod, "prefill_batch", prefill.prefill_batch)
        states, miss = _batched(rt, first)
        for s in states:
            rt.release_sequence(s)
        states, hit = _batched(rt, hits)
        runs[how] = (miss, hit, _greedy(rt, states, hit, 2))
        for s in states:
            rt.release_sequence(s)
    (miss, hit, tokens), (miss_c, hit_c, tokens_c) = runs["eager"], runs["compiled"]
    close(miss_c, miss)
    close(hit_c, hit)
    assert tokens_c == tokens
    # positions padded to multiples of 64, rows to a power of two; misses carry image regions
    assert all(t % 64 == 0 and b in (1, 2, 4) for b, t, _ in prefill.buckets)
    assert any(r >= 2 for *_, r in prefill.buckets) and any(r == -1 for *_, r in prefill.buckets)


def test_compile_is_opt_in(make_runtime, model) -> None:
    """By default nothing is compiled: a runtime decodes and prefills eagerly, the Engine's and
    the command line's compile option default to off, and ``--compile`` turns it on."""
    before = counters["stats"]["unique_graphs"]
    rt = make_runtime(kv_cache_pages=300, max_batch_size=2)
    state, logits = rt.start_sequence(_prompts(model, (4,))[0], max_new_tokens=3)
    rt.decode_step([state], [TextToken(int(logits.argmax()))])
    rt.release_sequence(state)
    assert counters["stats"]["unique_graphs"] == before
    assert inspect.signature(Engine).parameters["compile"].default is False
    assert inspect.signature(setup.load_runtime).parameters["compile"].default is False
    parser = argparse.ArgumentParser()
    common.add_engine_options(parser)
    assert common.engine_kwargs(parser.parse_args([]))["compile"] is False
    assert common.engine_kwargs(parser.parse_args(["--compile"]))["compile"] is True


def test_compile_refused_with_its_reason(monkeypatch) -> None:
    assert compile_unavailable_reason("cpu") is None  # this machine has a C++ compiler
    with pytest.raises(CompileUnavailableError, match="cpu and cuda devices, not meta"):
        check_compile("meta")

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(CompileUnavailableError, match="needs a C\\+\\+ compiler"):
        check_compile("cpu")
    options = dict(device="cpu", dtype=None, kv_cache_pages=None, max_batch_size=1,
                   enable_prefix_cache=True, attention_backend="torch")  # fmt: skip
    with pytest.raises(setup.InvalidInputError, match="C\\+\\+ compiler"):
        setup.load_runtime(None, **options, compile=True)  # refused before any loading
    with pytest.raises(setup.InvalidInputError, match="True or False"):
        setup.load_runtime(None, **options, compile="yes")


@pytest.mark.slow  # a decode and three prefill buckets: the graphs the tests above compiled
def test_engine_compile_answers_as_eager(make_engine, images) -> None:
    """``Engine(compile=True)`` end to end: the runtime decodes through ``CompiledDecode`` and
    prefills through ``CompiledPrefill``, and the answers equal the eager engine's. Two waves of
    three requests admitted together (two images and a text-only question; the second wave's
    image questions hit the first's cached prefixes): the shapes of the runtime tests above, so
    the graphs they compiled serve this engine from inductor's cache."""
    shapes, tall = images["shapes_378"], images["tall_300x1000"]
    # the long text-only question prefills apart from the two short hits (group_by_length)
    farewell = "Say goodbye to everyone in the room, politely and at length."
    waves = [[(shapes, "what is this?"), (tall, "which colour?"), (None, "Say hello.")],
             [(shapes, "which colour?"), (tall, "what is this?"), (None, farewell)]]  # fmt: skip
    settings = {"temperature": 0.0, "max_tokens": 6}
    answers = {}
    for compile_ in (False, True):
        engine = make_engine(compile=compile_)
        rt = engine.runtime
        assert isinstance(getattr(rt.decode_graphs, "compiled", None), CompiledDecode) is compile_
        assert isinstance(rt.compiled_prefill, CompiledPrefill) is compile_
        answers[compile_] = []
        for wave in waves:
            with scheduler_paused(engine):
                futures = [engine.submit_query(img, q, settings=settings) for img, q in wave]
            answers[compile_] += [f.result(timeout=300).answer for f in futures]
        assert engine.stats().vision_encodes_skipped == 2  # the second wave's images hit
    assert answers[True] == answers[False]


def test_fa_prefill_under_compile_takes_the_single_call_plan(monkeypatch, images) -> None:
    """The CUDA prefill path on CPU: the ``fa`` backend through the recording fake binding
    (bf16), traced by dynamo. A miss with an image and a short question makes one attention
    call per layer, like the eager prefill, with the same logits."""
    binding = RecordingBinding()
    monkeypatch.setattr(fa_backend, "probe", untraceable_probe)
    monkeypatch.setattr(fa_backend, "load_binding", lambda: binding)
    monkeypatch.delenv("KESTREL_FA_SINGLE_CALL_ROWS", raising=False)  # the default bound
    model = MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.bfloat16)
    request = [(query_prompt(model.config, [302, 303]), images["shapes_378"])]
    runs = {}
    for how in ("eager", "compiled"):
        rt = runtime_mod.MoondreamRuntime(
            model, kv_cache_pages=2000, max_batch_size=2, attention_backend="fa"
        )
        if how == "compiled":
            recorder = Recorder()
            prefill = CompiledPrefill(compiler=recorder)
            monkeypatch.setattr(runtime_mod, "prefill_batch", prefill.prefill_batch)
        binding.calls.clear()
        states, logits = _batched(rt, request)
        runs[how] = (logits.float(), [c.causal for c in binding.calls])
        for s in states:
            rt.release_sequence(s)
        rt.check_integrity()
    (want, eager_calls), (got, compiled_calls) = runs["eager"], runs["compiled"]
    assert compiled_calls == eager_calls == [False] * model.config.text.n_layers
    assert len(recorder.graphs) == 1 and recorder.count(ATTENTION_OP) == model.config.text.n_layers
    assert_close(got, want, rel=7e-2)  # bfloat16 logits, eager against compiled
