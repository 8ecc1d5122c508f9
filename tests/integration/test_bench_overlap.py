"""scripts/bench_overlap.py on the CPU (its --smoke proof): every variant issues exactly the
encodes and decode steps it names, interleaved for two streams; the side stream's encode equals
the main one's; the figures come out for ``bench_gpu_runtime.py --overlap``."""

from __future__ import annotations

import importlib
import math

import pytest

from tests.scripts import on_path


@pytest.fixture(scope="module")
def overlap():
    with on_path():
        yield importlib.import_module("bench_overlap")


def test_each_variant_issues_what_it_names(overlap) -> None:
    rt = overlap.build(smoke=True, batch=2)
    o = overlap.Overlap(rt, batch=2, steps=3)
    calls: list[str] = []
    encode, decode = o.encode, o.decode
    o.encode = lambda: calls.append("e") or encode()
    o.decode = lambda: calls.append("d") or decode()
    try:
        o.run(2, 3, streams=1)
        assert calls == ["e", "e", "d", "d", "d"]
        calls.clear()
        o.run(2, 3, streams=2)  # each encode followed by its share of the steps
        assert calls == ["e", "d", "d", "e", "d"]
        calls.clear()
        o.run(0, 3, streams=1)
        assert calls == ["d", "d", "d"]
        lengths = [s.length for s in o.states]
    finally:
        o.release()
    assert lengths == [lengths[0]] * 2  # every row fed each step
    rt.check_integrity()


def test_measure_gives_every_variant_and_the_hidden_share(overlap) -> None:
    rt = overlap.build(smoke=True, batch=2)
    got = overlap.measure(rt, batch=2, encodes=1, steps=2, rounds=1)
    assert set(got) == {"encoder", "decode", "one stream", "two streams", "hidden"}
    assert all(got[k] > 0 for k in ("encoder", "decode", "one stream", "two streams"))
    assert math.isfinite(got["hidden"])
    assert not rt.active_sequences  # the rows were released
    rt.check_integrity()


def test_main_prints_the_table(overlap, capsys) -> None:
    overlap.main(["--smoke", "--allow-busy", "--rounds", "1", "--batch", "2", "--steps", "2",
                  "--encodes", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| two streams |" in out and "| one stream |" in out and "hidden:" in out


def test_the_default_measurement_fits_moondream_2s_context(overlap) -> None:
    """``bench_gpu_runtime.py --overlap`` (64 steps, 3 rounds) once asked each row for 2064
    new tokens, past the 2048-position context, and crashed on the H200: the budget is what the
    rounds take, and a run that cannot fit says so before it starts."""
    from kestrel.moondream.config import MoondreamConfig

    cfg = MoondreamConfig()
    room = cfg.text.max_context - cfg.prefix_len - 2
    assert overlap.step_budget(64, 3) <= room < overlap.step_budget(64, 8)
    rt = overlap.build(smoke=True, batch=1)
    with pytest.raises(SystemExit, match="use fewer"):
        overlap.Overlap(rt, batch=1, steps=64, rounds=8)
    assert not rt.active_sequences


def test_the_rows_hold_every_step_the_rounds_take(overlap) -> None:
    """The rows' token budget covers every round (here two rounds of 3 steps, warm-ups too)."""
    rt = overlap.build(smoke=True, batch=2)
    got = overlap.measure(rt, batch=2, encodes=1, steps=3, rounds=2)
    assert got["decode"] > 0 and not rt.active_sequences
