"""Moondream 3 through the front doors: ``kestrel query`` / ``detect`` / ``batch`` on md3-tiny-a
give the first-party reference's greedy answers (the fixture's) and the Engine's own."""

from __future__ import annotations

import json
import shutil

import pytest

from kestrel import Engine
from kestrel.cli import main
from tests.conformance.golden import load_golden
from tests.conftest import FIXTURES

MD3 = FIXTURES / "md3-tiny-a"
CASES = {c["id"]: c for c in load_golden(MD3).meta["cases"]}
SCENE = str(MD3 / "images" / "scene_800x600.png")  # RGB: the Engine decodes it as the reference
ENGINE_OPTS = [
    "--model", str(MD3), "--device", "cpu", "--dtype", "float32",
    "--kv-cache-pages", "6000", "--max-batch-size", "4",
]  # fmt: skip
SETTINGS = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine():
    with Engine(MD3, device="cpu", dtype="float32", kv_cache_pages=6000, max_batch_size=4) as e:
        yield e


def cli_json(capsys, *argv: str) -> dict:
    code = main([*argv, *ENGINE_OPTS, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_cli_query_is_the_reference_answer(capsys, engine) -> None:
    case = CASES["query_scene"]
    obj = cli_json(capsys, "query", SCENE, case["question"], "--max-tokens", "8",
                   "--temperature", "0")  # fmt: skip
    assert obj["tokens"] == case["greedy_ids"]
    assert obj["answer"] == engine.query(SCENE, case["question"], settings=SETTINGS).answer


def test_cli_detect_is_the_reference_answer(capsys, engine) -> None:
    case = CASES["detect_scene_square"]
    obj = cli_json(capsys, "detect", SCENE, case["object"], "--max-objects", "3")
    keys = ("x_min", "y_min", "x_max", "y_max")
    want = [{k: min(max(o[k], 0.0), 1.0) for k in keys} for o in case["reference_output"]]
    assert obj["objects"] == [pytest.approx(w, abs=1e-7) for w in want]
    got = engine.detect(SCENE, case["object"], settings={"max_objects": 3})
    assert obj["objects"] == [dict(b) for b in got.objects]


def test_batch_on_md3(tmp_path, capsys, engine) -> None:
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("scene_800x600.png", "shapes_378.png"):
        shutil.copy(MD3 / "images" / name, images / name)
    questions = [CASES["query_scene"]["question"], CASES["query_shapes"]["question"]]
    (tmp_path / "q.txt").write_text("\n".join(questions) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--images", str(images), "--questions", str(tmp_path / "q.txt"),
            "--out", str(out), "--json", "--no-progress", "--max-tokens", "8",
            "--temperature", "0", *ENGINE_OPTS]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and summary["errors"] == 0
    for line in lines:
        want = engine.query(images / line["image"], line["question"], settings=SETTINGS)
        assert line["answer"] == want.answer, line
    tokens = engine.runtime.tokenizer
    scene = next(x for x in lines if x["image"] == "scene_800x600.png"
                 and x["question"] == questions[0])  # fmt: skip
    assert scene["answer"] == tokens.decode(CASES["query_scene"]["greedy_ids"])
