"""scripts/bench_tiers.py in its smoke mode: the JSON it prints holds what the run did (every
revisit served by the tier, one encode per image with it, two without, same answers)."""

from __future__ import annotations

import importlib
import json

import pytest

from tests.scripts import on_path


@pytest.fixture(scope="module")
def bench_tiers():
    with on_path():
        yield importlib.import_module("bench_tiers")


def test_smoke_json_reports_the_tier(bench_tiers, capsys) -> None:
    assert bench_tiers.main(["--smoke", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["same_answers"] is True
    assert out["encodes_per_image_on"] == 1.0 and out["encodes_per_image_off"] == 2.0
    assert out["revisit_ttft_ratio"] > 0 and out["rps_ratio"] > 0
    assert out["figures"]["tier on"]["tier_share"]["median"] == 1.0
    assert out["figures"]["tier off"]["tier_share"]["median"] == 0.0


def test_different_answers_are_caught(bench_tiers) -> None:
    bench_tiers.check_same_answers({"tier on": [["a", "b"]], "tier off": [["a", "b"]]})
    with pytest.raises(AssertionError, match="request 1"):
        bench_tiers.check_same_answers({"tier on": [["a", "b"]], "tier off": [["a", "c"]]})


def test_questions_are_12_to_20_words(bench_tiers) -> None:
    qs = bench_tiers.questions(50)
    assert len(set(qs)) == 50 and all(12 <= len(q.split()) <= 20 for q in qs)
    with pytest.raises(SystemExit, match="larger than the pool"):
        bench_tiers.main(["--images", "4", "--pool-images", "4"])
