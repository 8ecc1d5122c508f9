"""A batch job held to one JSON schema (``run_batch(response_format=)``, ``kestrel batch
--json-schema``): every line carries its answer's parsed value, which validates; a schema that
cannot compile fails the run before a line is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kestrel import Engine, InvalidInputError
from kestrel.batch import requests_from_folder, run_batch
from kestrel.cli import main
from kestrel.tiny import DEMO_DIR

pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="in the test extra")

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "round": {"type": "boolean"},
    },
    "required": ["colour", "count", "round"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}
SETTINGS = {"temperature": 0.0, "max_tokens": 48}
ENGINE_OPTS = ["--device", "cpu", "--dtype", "float32", "--max-batch-size", "4",
               "--max-tokens", "48", "--temperature", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batch")
    (root / "imgs").mkdir()
    for name in ("scene_0.png", "scene_1.png"):
        shutil.copy(DEMO_DIR / name, root / "imgs" / name)
    (root / "questions.txt").write_text("what is in the picture?\nhow many shapes?\n")
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    return root


@pytest.fixture(scope="module")
def engine():
    with Engine(None, device="cpu", dtype="float32", max_batch_size=4) as e:
        yield e


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_line_carries_a_valid_parsed_value(data, engine, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    summary = run_batch(engine, requests, out, settings=SETTINGS, progress=False,
                        response_format=FORMAT)  # fmt: skip
    lines = _lines(out)
    assert summary.errors == 0 and len(lines) == len(requests) == 4
    for line in lines:
        assert line["finish_reason"] == "stop", line
        assert line["parsed"] == json.loads(line["answer"])
        jsonschema.validate(line["parsed"], SCHEMA)
    alone = engine.query(DEMO_DIR / "scene_0.png", requests[0].question, settings=SETTINGS,
                         response_format=FORMAT)  # fmt: skip
    assert lines[0]["parsed"] == alone.parsed
    free = tmp_path / "free.jsonl"
    run_batch(engine, requests[:1], free, settings=SETTINGS, progress=False)
    assert "parsed" not in _lines(free)[0]  # a free job's lines are as they were


def test_a_schema_that_cannot_compile_fails_the_run(data, engine, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    with pytest.raises(InvalidInputError, match="response_format"):
        run_batch(engine, requests, out, settings=SETTINGS, progress=False, response_format=bad)
    assert not out.exists() or _lines(out) == []


def test_cli_json_schema(data, tmp_path, capsys) -> None:
    out = tmp_path / "cli.jsonl"
    argv = ["batch", "--images", str(data / "imgs"), "--questions", str(data / "questions.txt"),
            "--out", str(out), "--json", "--no-progress", *ENGINE_OPTS]  # fmt: skip
    assert main([*argv, "--json-schema", str(data / "schema.json")]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 4
    for line in _lines(out):
        jsonschema.validate(line["parsed"], SCHEMA)
    (tmp_path / "broken.json").write_text("{not json")
    again = tmp_path / "again.jsonl"
    argv[argv.index(str(out))] = str(again)
    assert main([*argv, "--json-schema", str(tmp_path / "broken.json")]) == 2
    assert "--json-schema" in capsys.readouterr().err and not again.exists()


def test_ray_rows_carry_parsed_values() -> None:
    """A schema job's output rows (``kestrel.distributed``): ``parsed`` as JSON text in the
    Arrow table, the value again in the record, null kept for an answer cut short, absent on
    an error line and in a job without a schema."""
    pytest.importorskip("pyarrow")
    from kestrel.distributed.rows import record_of, table_of_records

    answered = {"id": "a", "image": "x.png", "question": "q", "answer": '{"count":3}',
                "parsed": {"count": 3}, "finish_reason": "stop", "replica": "r"}  # fmt: skip
    cut = {**answered, "id": "b", "answer": '{"cou', "parsed": None, "finish_reason": "length"}
    failed = {"id": "c", "image": "y.png", "question": "q", "error": "bad",
              "error_type": "InvalidInputError", "replica": "r"}  # fmt: skip
    table = table_of_records([answered, cut, failed], parsed=True)
    assert table.column("parsed").to_pylist() == ['{"count": 3}', None, None]
    rows = [record_of(r) for r in table.to_pylist()]
    assert rows[0]["parsed"] == {"count": 3} and list(rows[0])[:5] == [
        "id", "image", "question", "answer", "parsed"]  # fmt: skip
    assert "parsed" in rows[1] and rows[1]["parsed"] is None
    assert "parsed" not in rows[2] and rows[2]["error"] == "bad"
    free = table_of_records([{k: v for k, v in answered.items() if k != "parsed"}])
    assert "parsed" not in free.column_names and "parsed" not in record_of(free.to_pylist()[0])
