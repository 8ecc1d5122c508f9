"""The start-up choice of decode kernel per batch size (``kestrel_kernels/decode_tune.py``):
the decision, the measurement over a pool's pages (the Triton kernel under the interpreter
against the torch reference, a stand-in timer), the decode route it makes (held by the
``TritonDecode`` backend the runtime serves on), and the runtime's gating and failure path."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import kestrel_kernels as kk
from kestrel.moondream.model import MoondreamModel
from kestrel.runtime import graph_set
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel_kernels import decode_route, decode_tune, triton_decode
from kestrel_kernels.backends import FLASH, TORCH, TritonDecode
from kestrel_kernels.contract import KernelInputError, KvScales
from kestrel_kernels.decode_route import NO_ROUTE, DecodeRoute
from kestrel_kernels.decode_tune import (
    DecodeTrial,
    check_fp8,
    compare,
    decode_case,
    route_of,
    tune_pool,
)
from kestrel_kernels.triton_decode import DecodeConfig
from tests.conftest import FIXTURES


@pytest.fixture(autouse=True)
def _restore():
    kernel = decode_route.get_decode_kernel()
    yield
    decode_route.set_decode_kernel(kernel)


def _const(value: torch.Tensor):
    return lambda: value


A, B = DecodeConfig(), DecodeConfig(block_n=8)


def test_the_fastest_agreeing_configuration_must_beat_fa() -> None:
    want = torch.tensor([1.0, -2.0, 0.5])
    timed: list[object] = []
    fa = _const(want)
    close, far = _const(want + 0.01), _const(want + 0.1)  # 0.5% and 5% of the largest

    def timer(ms: dict):
        def run(fn) -> float:
            timed.append(fn)
            return ms[fn]

        return run

    def trial(triton: dict, ms: dict):
        timed.clear()
        return compare(4, fa, triton, timer(ms))

    t = trial({A: close, B: close}, {fa: 1.0, close: 0.9})
    assert (t.choice, t.reason, t.fa_ms, t.triton_ms) == ("triton", "faster", 1.0, 0.9)
    assert t.max_diff == pytest.approx(0.005) and len(timed) == 3
    slow, quick = _const(want + 0.01), _const(want - 0.01)
    t = trial({A: slow, B: quick}, {fa: 1.0, slow: 0.97, quick: 0.8})
    assert (t.choice, t.config, t.triton_ms) == ("triton", B, 0.8)  # the faster configuration
    t = trial({A: close, B: far}, {fa: 1.0, close: 0.97, far: 0.1})  # B disagrees: not timed
    assert (t.choice, t.reason, t.config) == ("fa", "triton not faster", A)
    assert far not in timed
    t = trial({A: far, B: _const(torch.full((3,), float("nan")))}, {fa: 1.0})
    assert t.choice == "fa" and t.reason.startswith("triton differs") and timed == []


def test_a_case_uses_distinct_pages_and_spares_the_scratch_page() -> None:
    k = torch.zeros(300, 2, 8)
    v = torch.zeros(300, 2, 8)
    c = decode_case(k, v, batch=4, width=90, heads=4)
    lens = c.seqused_k.tolist()
    assert all(0 < n <= 90 for n in lens) and len(set(lens)) > 1
    pages = torch.cat([c.page_table[b, :n] for b, n in enumerate(lens)])
    assert pages.min() >= 1 and pages.max() < 300 and len(set(pages.tolist())) == sum(lens)
    assert bool((k[0] == 0).all()) and bool((k[1:].abs().sum(dim=(1, 2)) > 0).all())
    assert c.q.shape == (4, 1, 4, 8) and c.q.dtype == k.dtype


def test_the_pool_measurement_runs_both_kernels(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = torch.zeros(400, 2, 16)
    v = torch.zeros(400, 2, 16)
    timed = []

    def timer(fn) -> float:  # stand-in: at batch 1 only, Triton with block_n 8 is faster
        config = fn.args[0] if isinstance(fn, functools.partial) else None
        timed.append(config)
        batch = len([c for c in timed if c is None])
        return 1.0 if config is None else (0.5 if batch == 1 and config == B else 1.5)

    trials = tune_pool(
        k, v, (1, 2), width=64, heads=4, baseline=TORCH, timer=timer, candidates=(A, B)
    )  # fmt: skip (softmax scale: the default, 16**-0.5)
    assert [(t.batch, t.choice, t.config) for t in trials] == [(1, "triton", B), (2, "fa", A)]
    assert timed == [None, A, B] * 2  # fa, then each configuration, per batch size
    assert all(t.max_diff < 1e-4 for t in trials)  # fp32: the kernel equals the reference
    assert decode_route.get_decode_kernel() == "auto"  # the baseline's forcing was undone


def test_the_route_sends_chosen_sizes_to_triton_on_cuda() -> None:
    decode_route.set_decode_kernel("auto")
    route = DecodeRoute({1: "triton", 8: "fa"})
    cuda = SimpleNamespace(type="cuda")

    def q(batch: int, device=cuda):
        return SimpleNamespace(device=device, shape=(batch, 1, 4, 16))

    assert route.wanted(q(1), scaled=False) and not route.wanted(q(8), scaled=False)
    assert not route.wanted(q(2), scaled=False)  # not measured: fa
    assert not route.wanted(q(2), scaled=True)  # FP8 pages: only once checked (below)
    assert not route.wanted(q(1, SimpleNamespace(type="cpu")), scaled=False)
    assert not NO_ROUTE.wanted(q(1), scaled=False)  # a plain backend's: nothing under auto
    with decode_route.decode_kernel_forced("fa"):
        assert not route.wanted(q(1), scaled=False)
    assert route.wanted(q(1), scaled=False)
    with pytest.raises(KernelInputError, match="'fa' or 'triton'"):
        DecodeRoute({4: "flash"})
    with pytest.raises(KernelInputError, match="DecodeConfig"):
        DecodeRoute({1: "triton"}, configs={1: "block_n=8"})
    table = {1: "triton"}
    held = DecodeRoute(table)
    table[2] = "triton"
    assert held.table == {1: "triton"}  # the route keeps its own copy


def test_a_measured_backend_is_its_base_on_a_route() -> None:
    route = route_of([DecodeTrial(1, 1.0, 0.5, 0.0, "triton", "faster", B),
                      DecodeTrial(2, 1.0, 1.5, 0.0, "fa", "triton not faster", A)])  # fmt: skip
    assert route == DecodeRoute({1: "triton", 2: "fa"}, configs={1: B, 2: A})
    assert route_of([DecodeTrial(1, None, None, 0.0, "triton", "agrees")], fp8=True).fp8
    assert not route_of([DecodeTrial(1, None, None, 0.0, "fa", "differs")], fp8=True).fp8
    assert not route_of([], fp8=True).fp8
    tuned = TritonDecode(FLASH, route)
    assert (tuned.name, tuned.captures_decode, tuned.swaps_decode) == ("fa", True, True)
    assert FLASH.decode_route is NO_ROUTE and tuned.decode_route is route
    assert kk.resolve_backend(tuned) is tuned  # an object is taken as it is
    table = torch.zeros(2, 4, dtype=torch.int32)
    plan = tuned.plan(kk.AttentionMeta(table, torch.ones(2, dtype=torch.int32)), 1)
    assert plan.backend is tuned and plan.segments is not None  # fa's plan, read on the route


def test_the_measured_configuration_reaches_the_kernel(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def recorder(q, *args, config=None, **kwargs):
        seen.append(config)
        return torch.zeros_like(q)

    monkeypatch.setattr(triton_decode, "paged_decode", recorder)
    decode_route.set_decode_kernel("triton")
    backend = TritonDecode(TORCH, DecodeRoute(configs={2: B}))
    scales = KvScales(torch.tensor([0.05]), torch.tensor([0.05]))
    k = torch.randn(20, 2, 16).to(torch.float8_e4m3fn)  # FP8 pages: the kernel's other case
    for batch in (2, 3):
        table = torch.arange(1, 1 + 4 * batch, dtype=torch.int32).view(batch, 4) % 20
        meta = kk.AttentionMeta(table, torch.full((batch,), 4, dtype=torch.int32))
        kk.paged_attention(torch.randn(batch, 1, 2, 16), k, k, meta, backend=backend,
                           kv_scales=scales)  # fmt: skip
    assert seen == [B, None]  # batch 3 was not measured: the default launch


def test_fp8_pages_go_to_triton_only_once_checked() -> None:
    decode_route.set_decode_kernel("auto")
    cuda = torch.device("cuda")
    fp8_q = SimpleNamespace(device=SimpleNamespace(type="cuda"), shape=(2, 1, 4, 16))
    unchecked, checked = DecodeRoute(), DecodeRoute(fp8=True)
    assert not unchecked.serves_fp8(cuda) and not unchecked.wanted(fp8_q, scaled=True)
    assert checked.serves_fp8(cuda) and checked.wanted(fp8_q, scaled=True)
    assert not checked.serves_fp8(torch.device("cpu"))
    decode_route.set_decode_kernel("fa")
    assert not checked.serves_fp8(cuda)
    decode_route.set_decode_kernel("triton")
    assert unchecked.serves_fp8(torch.device("cpu"))  # forced: the interpreter tests


def test_the_fp8_check_compares_with_the_scaled_reference(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = torch.zeros(300, 2, 16, dtype=torch.float8_e4m3fn)
    v = torch.zeros_like(k)
    scales = KvScales(torch.tensor([0.05]), torch.tensor([0.04]))
    trials = check_fp8(k, v, scales, (1, 3), width=64, heads=4, softmax_scale=0.25,
                       q_dtype=torch.float32)  # fmt: skip
    assert [(t.batch, t.choice, t.reason) for t in trials] == [(1, "triton", "agrees"),
                                                               (3, "triton", "agrees")]  # fmt: skip
    assert all(t.max_diff < 1e-4 for t in trials)
    bits = k.view(torch.uint8)[1:]
    assert bool((bits & 0x7F).max() < 0x70) and bool((bits >= 0x80).any())  # finite, both signs
    assert torch.isfinite(k[1:].float()).all() and bool((k[0].float() == 0).all())


def _runtime(fixture: str = "md2-tiny-a", **kw):
    model = MoondreamModel.from_pretrained(FIXTURES / fixture)
    return model, MoondreamRuntime(model, kv_cache_pages=64, max_batch_size=4, **kw)


def _choose(monkeypatch, model, rt, **kw):
    monkeypatch.setattr(graph_set, "graphs_supported", lambda model, backend: True)
    monkeypatch.setattr(graph_set, "triton_available", lambda: True)
    options = dict(max_batch_size=4, backend=FLASH, capture=True, compile=False) | kw
    return graph_set.choose_decode_kernels(model, rt.kv, rt.page_table.page_table, **options)


def test_the_runtime_measures_each_bucket_and_serves_on_the_route(monkeypatch) -> None:
    model, rt = _runtime()
    seen = {}

    def fake(k, v, batches, width, heads):  # at the default scale, 1/sqrt(head_dim)
        seen.update(batches=batches, width=width, heads=heads, head_dim=k.shape[-1],
                    layer0=k is rt.kv.k[0])  # fmt: skip
        return [DecodeTrial(b, 1.0, 0.5 if b == 1 else 2.0, 0.0, "triton" if b == 1 else "fa",
                            "", B if b == 1 else A) for b in batches]  # fmt: skip

    monkeypatch.setattr(graph_set, "tune_pool", fake)
    monkeypatch.setattr(graph_set, "_MEASURED", {})
    decode_route.set_decode_kernel("auto")
    trials, backend = _choose(monkeypatch, model, rt)
    cfg = model.config.text
    assert seen == dict(batches=(1, 2, 4), width=rt.page_table.page_table.shape[1],
                        heads=cfg.n_heads, head_dim=cfg.head_dim, layer0=True)  # fmt: skip
    assert isinstance(backend, TritonDecode) and backend.base is FLASH and len(trials) == 3
    assert backend.decode_route == DecodeRoute({1: "triton", 2: "fa", 4: "fa"},
                                               configs={1: B, 2: A, 4: A})  # fmt: skip
    seen.clear()
    again, backend = _choose(monkeypatch, model, rt)
    assert again == trials and seen == {}  # same shapes: not again
    assert backend.decode_route.table == {1: "triton", 2: "fa", 4: "fa"}
    assert len(_choose(monkeypatch, model, rt, max_batch_size=2)[0]) == 2  # other buckets: timed
    assert seen["batches"] == (1, 2)
    for forced in ({"compile": True}, {"capture": False}):  # nothing captured: nothing measured
        assert _choose(monkeypatch, model, rt, **forced) == ([], FLASH)
    decode_route.set_decode_kernel("fa")  # forced: nothing measured, the backend as resolved
    assert _choose(monkeypatch, model, rt) == ([], FLASH)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(graph_set, "tune_pool", broken)
    monkeypatch.setattr(graph_set, "_MEASURED", {})
    decode_route.set_decode_kernel("auto")
    assert _choose(monkeypatch, model, rt) == ([], FLASH)


@pytest.mark.parametrize("agrees", [True, False])
def test_fp8_pages_are_checked_not_timed(monkeypatch, agrees: bool) -> None:
    layers = MoondreamModel.from_pretrained(FIXTURES / "md3-tiny-a-fp8").config.text.n_layers
    scales = [KvScales(torch.tensor([0.5]), torch.tensor([0.3])) for _ in range(layers)]
    model, rt = _runtime("md3-tiny-a-fp8", kv_scales=scales)
    seen = {}

    def fake(k, v, layer_scales, batches, width, heads, *, softmax_scale, q_dtype):
        first = (layer_scales.k.item(), layer_scales.v.item())
        seen.update(batches=batches, scales=first == pytest.approx((0.5, 0.3)), q_dtype=q_dtype)
        return [DecodeTrial(b, None, None, 0.0, "triton" if agrees else "fa", "") for b in batches]

    monkeypatch.setattr(graph_set, "check_fp8", fake)
    monkeypatch.setattr(graph_set, "tune_pool", lambda *a, **k: pytest.fail("timed FP8 pages"))
    decode_route.set_decode_kernel("auto")
    trials, backend = _choose(monkeypatch, model, rt)
    assert seen == dict(batches=(1, 4), scales=True, q_dtype=model.dtype) and len(trials) == 2
    assert backend.decode_route == DecodeRoute(fp8=agrees)


def test_nothing_is_measured_without_captured_graphs() -> None:
    _, rt = _runtime()
    assert rt.decode_trials == [] and rt.decode_graphs is None  # a CPU runtime
    assert rt.attention_backend is TORCH  # served on as resolved
    assert decode_tune.MARGIN > 0 and decode_tune.TOLERANCE < 0.1
