"""scripts/bench_structured.py --smoke: the figures it reports hold what the run did."""

from __future__ import annotations

import importlib

import pytest

from tests.scripts import on_path

pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")


def test_smoke_reports_every_row(capsys) -> None:
    with on_path():
        bench = importlib.import_module("bench_structured")
    out = bench.main(["--smoke"])
    assert [r["constrained"] for r in out["decode"]] == [0, 2, 4]
    assert all(r["steps"] > 0 and r["step_ms"] > 0 for r in out["decode"])
    assert out["decode"][0]["mask_host_us"] == 0 and out["decode"][2]["mask_host_us"] > 0
    assert out["fill"]["tokens"] > 10 and out["fill"]["serial_us_per_row"] > 0
    c = out["compile"]
    assert c["vocab"] == 430 and c["cold_ms"] >= 0 and c["cached_ms"] >= 0
    assert "| constrained rows |" in capsys.readouterr().out
