"""scripts/bench_chat.py's workload on the fixture model, tiny: the figures it reports hold
what the run did (every turn answered, later turns hit through the answers)."""

from __future__ import annotations

import importlib

import pytest

from tests.scripts import on_path


@pytest.fixture(scope="module")
def bench_chat():
    with on_path():
        yield importlib.import_module("bench_chat")


def test_w4_in_small_counts_each_turn_and_hits_through_answers(bench_chat) -> None:
    from kestrel import Engine

    with Engine(bench_chat.FIXTURE, device="cpu", dtype="float32", kv_cache_pages=8000) as e:
        w = bench_chat.converse(e, bench_chat.images(2), n_conv=3, turns=3)
        e.check_integrity()
    assert w["requests"] == 9 and [len(t) for t in w["ttft"]] == [3, 3, 3]
    assert all(x > 0 for t in w["ttft"] for x in t) and w["wall_s"] > 0
    # turns 2 and 3 reuse everything but their new message: most of all prompts is cached
    assert 0.6 < w["hit"] < 1
    with pytest.raises(SystemExit, match="at least 2 turns"):
        bench_chat.main(["--turns", "1"])
