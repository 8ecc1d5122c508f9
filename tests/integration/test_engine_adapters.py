"""Adapters through the Engine: per-request LoRA, mixed batches, never mixed in the cache;
tenant salts isolate."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel import CapacityError, UnknownAdapterError
from kestrel.errors import InvalidInputError
from kestrel.moondream.lora import LoraAdapter
from kestrel.skills import prompts
from kestrel.tokens import TextToken
from tests.conftest import fixture_dir
from tests.integration.conftest import GREEDY, scheduler_paused
from tests.tolerance import assert_close, relative_error

ADAPTER_DIR = fixture_dir() / "adapter"


def _scaled_adapter(tmp_path, name: str, scale: float):
    """A copy of the fixture adapter with every B scaled (other weights, same shapes)."""
    tensors = load_file(str(ADAPTER_DIR / "adapter.safetensors"))
    out = {k: (v * scale if k.endswith(".B") else v) for k, v in tensors.items()}
    path = tmp_path / f"{name}.safetensors"
    save_file(out, str(path))
    return path


def _golden_case(case_id: str) -> dict:
    golden = json.loads((fixture_dir() / "golden.json").read_text())
    return next(c for c in golden["cases"] if c["id"] == case_id)


def test_lora_golden_case_through_the_engine(make_engine, images) -> None:
    case = _golden_case("lora_query_shapes")
    engine = make_engine()
    engine.load_adapter(case["adapter"], ADAPTER_DIR)
    settings = {"temperature": 0.0, "max_tokens": case["settings"]["max_tokens"]}
    for _ in range(2):  # miss, then a hit in the adapter's namespace
        r = engine.query(
            images[case["image"]], case["question"], settings=settings, adapter=case["adapter"]
        )
        assert list(r.tokens) == case["greedy_ids"]
    base = engine.query(images[case["image"]], case["question"], settings=settings)
    assert list(base.tokens) == _golden_case("query_shapes")["greedy_ids"]
    assert base.tokens != r.tokens


def test_base_and_adapters_interleaved_match_alone(make_engine, images, tmp_path) -> None:
    img = images["shapes_378"]
    names = [None, "a", "b"]
    paths = {"a": ADAPTER_DIR, "b": _scaled_adapter(tmp_path, "b", -0.5)}

    alone_engine = make_engine(max_batch_size=1)
    for n, p in paths.items():
        alone_engine.load_adapter(n, p)
    alone = {
        n: alone_engine.query(img, "What is it?", settings=GREEDY, adapter=n).tokens for n in names
    }
    assert len(set(alone.values())) == 3  # three different answers

    engine = make_engine(max_batch_size=8)
    for n, p in paths.items():
        engine.load_adapter(n, p)
    order = names * 4
    with scheduler_paused(engine):  # all twelve arrive in one batch
        futures = [
            engine.submit_query(img, "What is it?", settings=GREEDY, adapter=n) for n in order
        ]
    results = [f.result(timeout=120) for f in futures]
    for n, r in zip(order, results, strict=True):
        assert r.tokens == alone[n]
    # the first request of each namespace found nothing cached, whatever the others did
    prefix = engine.config.prefix_len
    firsts = {n: results[order.index(n)] for n in names}
    assert all(r.metrics.cached_tokens == 0 for r in firsts.values())
    later = results[len(names) :]
    assert all(r.metrics.cached_tokens >= prefix for r in later)
    assert engine.stats().namespaces == 3


def test_concurrent_threads_mixed_adapters(make_engine, images, tmp_path) -> None:
    engine = make_engine()
    engine.load_adapter("a", ADAPTER_DIR)
    engine.load_adapter("b", _scaled_adapter(tmp_path, "b", 2.0))
    img = images["tall_300x1000"]
    alone = {
        n: engine.query(img, "Which?", settings=GREEDY, adapter=n).tokens for n in (None, "a", "b")
    }
    got: list = []

    def worker(name):
        for _ in range(3):
            got.append((name, engine.query(img, "Which?", settings=GREEDY, adapter=name).tokens))

    threads = [threading.Thread(target=worker, args=(n,)) for n in (None, "a", "b") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 27 and all(tokens == alone[n] for n, tokens in got)


def test_reload_with_new_weights_misses_the_cache(make_engine, images, tmp_path) -> None:
    engine = make_engine()
    img = images["shapes_378"]
    first_id = engine.load_adapter("a", ADAPTER_DIR)
    first = engine.query(img, "What is it?", settings=GREEDY, adapter="a")
    hit = engine.query(img, "What is it?", settings=GREEDY, adapter="a")
    assert hit.metrics.cached_tokens > 0
    second_id = engine.load_adapter("a", _scaled_adapter(tmp_path, "a2", 3.0))
    assert first_id.split("@")[0] == second_id.split("@")[0] == "a" and first_id != second_id
    fresh = engine.query(img, "What is it?", settings=GREEDY, adapter="a")
    assert fresh.metrics.cached_tokens == 0 and fresh.tokens != first.tokens
    same_again = engine.load_adapter("a", ADAPTER_DIR)
    assert same_again == first_id  # the identity is the weights' digest
    assert engine.query(img, "What is it?", settings=GREEDY, adapter="a").tokens == first.tokens


def test_unload_while_running_and_max_adapters(make_engine) -> None:
    engine = make_engine(max_adapters=2)
    engine.load_adapter("a", ADAPTER_DIR)
    engine.load_adapter("b", ADAPTER_DIR)
    with pytest.raises(CapacityError, match="max_adapters=2"):
        engine.load_adapter("c", ADAPTER_DIR)
    engine.load_adapter("b", ADAPTER_DIR)  # replacing a loaded name is not one more
    want = engine.query(None, "story", settings={"temperature": 0, "max_tokens": 40}, adapter="a")
    stream = engine.query(
        None, "story", settings={"temperature": 0, "max_tokens": 40}, adapter="a", stream=True
    )
    chunks = iter(stream)
    next(chunks)  # running now
    engine.unload_adapter("a")
    assert engine.adapters() == ["b"]
    assert stream.result(timeout=60).tokens == want.tokens  # finished with its adapter
    with pytest.raises(UnknownAdapterError, match="'a'"):
        engine.query(None, "story", adapter="a")
    with pytest.raises(UnknownAdapterError):
        engine.unload_adapter("a")
    engine.load_adapter("c", ADAPTER_DIR)  # room again
    assert engine.adapters() == ["b", "c"]


def test_salts_isolate(make_engine, images) -> None:
    engine = make_engine()
    img = images["shapes_378"]
    plain = engine.query(img, "What is it?", settings=GREEDY)
    t1 = engine.query(img, "What is it?", settings=GREEDY, cache_salt="tenant-1")
    t2 = engine.query(img, "What is it?", settings=GREEDY, cache_salt="tenant-2")
    assert t1.metrics.cached_tokens == t2.metrics.cached_tokens == 0
    again = engine.query(img, "What is it?", settings=GREEDY, cache_salt="tenant-1")
    assert again.metrics.cached_tokens > 0
    assert plain.tokens == t1.tokens == t2.tokens == again.tokens  # same answers, own caches
    engine.load_adapter("a", ADAPTER_DIR)
    salted = engine.query(img, "What is it?", settings=GREEDY, adapter="a", cache_salt="tenant-1")
    assert salted.metrics.cached_tokens == 0
    assert engine.stats().namespaces == 4
    for bad in ("", 5, "x" * 300):
        with pytest.raises(InvalidInputError, match="cache_salt"):
            engine.query(img, "What is it?", cache_salt=bad)


def test_mixed_adapter_decode_equals_per_request(make_runtime, model, images, tmp_path) -> None:
    """One decode step with rows on adapter A, none and B equals each row decoded alone."""
    from kestrel.moondream.lora import load_adapter
    from kestrel.moondream.tokenizer import MoondreamTokenizer

    tok = MoondreamTokenizer.from_dir(fixture_dir())
    a = load_adapter(ADAPTER_DIR, model.config, name="a")
    b_tensors = load_file(str(_scaled_adapter(tmp_path, "b", -2.0)))
    b = LoraAdapter.from_tensors("b", b_tensors, model.config)
    prompt = prompts.query_prompt(model.config.tokenizer, tok.encode, "What is it?")

    def run(adapters):
        rt = make_runtime()
        states = [
            rt.start_sequence(prompt, None, adapter=ad, max_new_tokens=4)[0] for ad in adapters
        ]
        logits = [rt.decode_step(states, [TextToken(7)] * len(states)) for _ in range(3)][-1]
        for s in states:
            rt.release_sequence(s)
        return logits

    mixed = run([a, None, b, a])
    alone = torch.cat([run([ad]) for ad in (a, None, b, a)])
    assert_close(mixed, alone, rel=0.0001)
    # the adapters act: each row differs from the base row by far more than the bound above
    assert relative_error(alone[0], alone[1]) > 1e-2 and relative_error(alone[0], alone[2]) > 1e-2
