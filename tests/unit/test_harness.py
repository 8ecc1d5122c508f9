"""The benchmark harness (scripts/harness.py, scripts/harness_load.py): interleaving, the
median / spread / ratio arithmetic, and the busy check on fake load readings."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

from tests.scripts import on_path


@pytest.fixture(scope="module")
def h():
    with on_path():
        yield importlib.import_module("harness"), importlib.import_module("harness_load")


def args(h, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    h[0].add_arguments(p)
    return p.parse_args(["--max-load", "1.0", *argv])


def test_variants_run_interleaved_once_per_round(h):
    calls: list[str] = []

    def variant(name: str, value: float):
        return lambda: calls.append(name) or {"x": value + len(calls)}

    runs = h[0].interleave({"A": variant("A", 0), "B": variant("B", 10)}, 3, lambda _: None)
    assert calls == ["A", "B", "A", "B", "A", "B"]
    assert runs == {"A": [{"x": 1}, {"x": 3}, {"x": 5}], "B": [{"x": 12}, {"x": 14}, {"x": 16}]}
    with pytest.raises(ValueError):
        h[0].interleave({"A": variant("A", 0)}, 0, lambda _: None)


def test_spread_is_median_min_max(h):
    assert h[0].spread([3.0, 1.0, 2.0]) == h[0].Spread(2.0, 1.0, 3.0)
    assert h[0].spread([4.0, 1.0, 2.0, 10.0]) == h[0].Spread(3.0, 1.0, 10.0)
    with pytest.raises(ValueError):
        h[0].spread([])


def test_ratio_is_ratio_of_medians_with_per_round_range(h):
    q = h[0].ratio([10.0, 12.0, 30.0], [5.0, 4.0, 6.0])  # per round: 2, 3, 5
    assert q.median == pytest.approx(12.0 / 5.0)
    assert (q.lo, q.hi) == (2.0, 5.0)
    assert q.fmt(suffix="x") == "2.40x (2.00-5.00)"
    with pytest.raises(ValueError):
        h[0].ratio([1.0, 2.0], [1.0])


def test_busy_reasons_name_the_load_and_each_busy_process(h):
    load_cls, proc = h[1].Load, h[1].ProcUse
    idle = load_cls(0.2, 2, (proc(7, "sshd", 1.0),))
    assert h[1].busy_reasons(idle, max_load=1.0, max_proc_pct=10.0) == []
    busy = load_cls(1.7, 2, (proc(42, "python train.py", 180.0), proc(7, "sshd", 1.0)))
    reasons = h[1].busy_reasons(busy, max_load=1.0, max_proc_pct=10.0)
    assert len(reasons) == 2
    assert "1.70" in reasons[0] and "2 cores" in reasons[0]
    assert reasons[1] == "pid 42 (python train.py) uses 180% of a core"


def test_load_is_read_from_proc(h, tmp_path):
    (tmp_path / "loadavg").write_text("0.42 0.30 0.10 1/100 999\n")
    pid = tmp_path / "4242"
    pid.mkdir()
    (pid / "cmdline").write_bytes(b"python\0-m\0busy (job)\0")

    def stat(ticks: int) -> None:  # the name holds a space and a ')': fields follow the last ')'
        fields = ["S"] + ["0"] * 10 + [str(ticks), "0"] + ["0"] * 30
        (pid / "stat").write_text("4242 (busy) job) " + " ".join(fields))

    hz = os.sysconf("SC_CLK_TCK")
    stat(100)
    load = h[1].measure_load(interval=2.0, proc=tmp_path, sleep=lambda _: stat(100 + hz))
    assert load.load1 == 0.42
    assert load.procs == (h[1].ProcUse(4242, "python -m busy (job)", pytest.approx(50.0)),)
    assert h[1].measure_load(1.0, frozenset({4242}), tmp_path, lambda _: stat(500)).procs == ()


def test_busy_machine_is_refused_with_its_reasons(h):
    hog = h[1].Load(3.0, 2, (h[1].ProcUse(99, "make -j8", 150.0),))
    with pytest.raises(SystemExit, match=r"pid 99 \(make -j8\) uses 150% of a core"):
        h[0].start(args(h), "demo", read=lambda: hog)


def test_allow_busy_marks_every_line(h, capsys):
    hog = h[1].Load(3.0, 2, ())
    bench = h[0].start(args(h, "--allow-busy", "--rounds", "2"), "demo", read=lambda: hog)
    runs = {"A": [{"x": 2.0}, {"x": 4.0}], "B": [{"x": 1.0}, {"x": 1.0}]}
    bench.table(runs, {"x": "x/s"}, baseline="B")
    lines = capsys.readouterr().out.splitlines()
    assert bench.busy and lines and all(line.startswith("BUSY") for line in lines)
    assert any("| A | 3.00 (2.00-4.00) | 3.00x (2.00-4.00) |" in line for line in lines)
    assert any("2 rounds" in line for line in lines)


def test_wait_idle_polls_until_the_machine_is_idle(h):
    readings = iter([h[1].Load(2.0, 2, ()), h[1].Load(1.5, 2, ()), h[1].Load(0.1, 2, ())])
    slept: list[float] = []
    bench = h[0].start(args(h, "--wait-idle", "600"), "demo", lambda: next(readings), slept.append)
    assert not bench.busy and len(slept) == 2
    assert bench.info["load1_at_start"] == 0.1


def test_cpu_used_over_a_run_counts_new_processes_and_skips_excluded(h, tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    before = {1: 0, 2: 0, 3: 0}
    after = {1: 10 * hz, 3: 10 * hz, 4: 5 * hz}  # 2 ended; 4 started during the run
    used = h[1].cpu_used(before, after, 100.0, frozenset({3}), proc=tmp_path)
    assert [(p.pid, p.cpu_pct) for p in used] == [(1, pytest.approx(10.0)), (4, pytest.approx(5.0))]


def test_finish_reports_other_processes_busy_during_the_run(h, capsys, monkeypatch):
    bench = h[0].start(args(h), "demo", read=lambda: h[1].Load(0.1, 2, ()))
    hog = (h[1].ProcUse(77, "stress", 90.0),)
    monkeypatch.setattr(h[0], "cpu_used", lambda *a, **k: hog)
    bench.finish()
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("BUSY machine during the run: BUSY") and "pid 77 (stress)" in out[-1]
    assert bench.info["busy_during_run"] == ["pid 77 (stress) uses 90% of a core"]


def test_a_benchmarks_own_children_are_not_other_processes(h, tmp_path):
    def proc(pid: int, parent: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", str(parent)] + ["0"] * 40
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b)) " + " ".join(fields))

    for pid, parent in [(10, 1), (11, 10), (12, 11), (13, 10), (20, 1), (21, 20)]:
        proc(pid, parent)
    (tmp_path / "loadavg").write_text("0.1 0.1 0.1 1/100 999\n")  # not a process
    assert h[1].descendants(10, tmp_path) == {10, 11, 12, 13}
    assert h[1].descendants(21, tmp_path) == {21}
