"""The ``kestrel`` command line on the fixture model: each subcommand's output against the
Engine's own result for the same call, and the one-line error convention."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from kestrel import Engine
from kestrel.cli import COMMANDS, build_parser, main
from kestrel.cli.common import engine_kwargs
from kestrel.results import RequestMetrics
from tests.conftest import fixture_dir

MODEL = fixture_dir()
IMAGE = str(MODEL / "images" / "scene_800x600.png")
ENGINE_OPTS = [
    "--model", str(MODEL), "--device", "cpu", "--dtype", "float32",
    "--kv-cache-pages", "6000", "--max-batch-size", "4",
]  # fmt: skip
MAX_TOKENS = 4
GEN = {"max_tokens": MAX_TOKENS, "temperature": 0.0}  # greedy: the CLI and the engine agree
GREEDY = ("--max-tokens", str(MAX_TOKENS), "--temperature", "0")
METRIC_KEYS = {f.name for f in fields(RequestMetrics)}


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL, device="cpu", dtype="float32", kv_cache_pages=6000, max_batch_size=4) as e:
        yield e


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, *ENGINE_OPTS])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys, *argv: str) -> dict:
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    assert out.count("\n") == 1  # exactly one JSON object
    obj = json.loads(out)
    assert set(obj["metrics"]) == METRIC_KEYS
    return obj


def check_metrics(metrics: dict, result) -> None:
    """Token counts are the same call's; timings differ run to run and are only sanity-checked.
    Each CLI call has its own engine, so its cache starts cold."""
    assert metrics["input_tokens"] == result.metrics.input_tokens
    assert metrics["output_tokens"] == result.metrics.output_tokens
    assert metrics["cached_tokens"] == 0
    assert metrics["ttft_ms"] >= 0 and metrics["decode_ms"] >= 0


# ---------------------------------------------------------------------------- query / caption
def test_query_json_matches_engine(capsys, engine):
    obj = cli_json(capsys, "query", IMAGE, "What is in the picture?", *GREEDY)
    want = engine.query(IMAGE, "What is in the picture?", settings=GEN)
    assert obj["answer"] == want.answer
    assert obj["tokens"] == list(want.tokens)
    assert len(obj["tokens"]) == MAX_TOKENS  # the fixture never picks eos
    assert obj["finish_reason"] == want.finish_reason == "length"
    assert obj["reasoning"] is None
    check_metrics(obj["metrics"], want)


def test_query_plain_and_streamed_print_the_answer(capsys, engine):
    want = engine.query(IMAGE, "Describe it.", settings=GEN).answer
    code, out, err = cli(capsys, "query", IMAGE, "Describe it.", *GREEDY)
    assert (code, out, err) == (0, want + "\n", "")
    code, out, err = cli(capsys, "query", IMAGE, "Describe it.", *GREEDY, "--stream")
    assert (code, out, err) == (0, want + "\n", "")


def test_query_reasoning_json(capsys, engine):
    obj = cli_json(capsys, "query", IMAGE, "Count them.", "--reasoning", *GREEDY)
    want = engine.query(IMAGE, "Count them.", reasoning=True, settings=GEN)
    assert obj["answer"] == want.answer
    assert obj["reasoning"] == want.reasoning.to_dict()
    assert obj["tokens"] == list(want.tokens)


def test_query_reads_the_image_from_stdin(capsys, engine, monkeypatch):
    class Stdin:
        buffer = open(IMAGE, "rb")  # noqa: SIM115 - closed below

    monkeypatch.setattr(sys, "stdin", Stdin)
    try:
        code, out, _ = cli(capsys, "query", "-", "What is this?", *GREEDY)
    finally:
        Stdin.buffer.close()
    assert code == 0
    assert out == engine.query(IMAGE, "What is this?", settings=GEN).answer + "\n"


@pytest.mark.parametrize("length", ["short", "long"])
def test_caption_json_matches_engine(capsys, engine, length):
    obj = cli_json(capsys, "caption", IMAGE, "--length", length, *GREEDY)
    want = engine.caption(IMAGE, length=length, settings=GEN)
    assert obj["caption"] == want.caption
    assert obj["tokens"] == list(want.tokens)
    assert obj["finish_reason"] == want.finish_reason
    check_metrics(obj["metrics"], want)


def test_adapter_file_is_loaded_and_applied(capsys, engine):
    adapter = MODEL / "adapter"
    engine.load_adapter("fixture-adapter", adapter)
    obj = cli_json(capsys, "query", IMAGE, "What is this?", *GREEDY, "--adapter", str(adapter))
    want = engine.query(IMAGE, "What is this?", settings=GEN, adapter="fixture-adapter")
    plain = engine.query(IMAGE, "What is this?", settings=GEN)
    assert obj["tokens"] == list(want.tokens)
    assert want.tokens != plain.tokens  # the adapter changes this answer, so the check means it
    code, out, err = cli(capsys, "caption", IMAGE, "--adapter", str(MODEL / "no-such-adapter"))
    assert_one_line_error(code, out, err, "no-such-adapter")


# ---------------------------------------------------------------------------- point / detect
def test_point_matches_engine(capsys, engine):
    want = engine.point(IMAGE, "face", settings={"max_objects": 2})
    obj = cli_json(capsys, "point", IMAGE, "face", "--max-objects", "2")
    assert obj["points"] == [dict(p) for p in want.points]
    assert obj["tokens"] == list(want.tokens)
    assert obj["finish_reason"] == want.finish_reason
    check_metrics(obj["metrics"], want)
    code, out, _ = cli(capsys, "point", IMAGE, "face", "--max-objects", "2")
    assert code == 0
    assert out.splitlines() == [f"x={p['x']:.4f} y={p['y']:.4f}" for p in want.points]


def test_detect_matches_engine(capsys, engine):
    want = engine.detect(IMAGE, "car", settings={"max_objects": 2})
    obj = cli_json(capsys, "detect", IMAGE, "car", "--max-objects", "2")
    assert obj["objects"] == [dict(b) for b in want.objects]
    assert obj["tokens"] == list(want.tokens)
    check_metrics(obj["metrics"], want)
    code, out, _ = cli(capsys, "detect", IMAGE, "car", "--max-objects", "2")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(want.objects)
    for line, box in zip(lines, want.objects, strict=True):
        assert line == " ".join(f"{k}={box[k]:.4f}" for k in ("x_min", "y_min", "x_max", "y_max"))


# ---------------------------------------------------------------------------- errors
def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code in (1, 2)
    assert out == ""
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_missing_model_dir(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code = main(["query", IMAGE, "hi", *ENGINE_OPTS, "--model", str(missing)])  # last wins
    out, err = capsys.readouterr()
    assert_one_line_error(code, out, err, str(missing))


def test_missing_image_file(capsys, tmp_path):
    missing = str(tmp_path / "nope.png")
    code, out, err = cli(capsys, "caption", missing)
    assert_one_line_error(code, out, err, "nope.png")
    assert code == 2


def test_corrupt_image_and_empty_question(capsys, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png")
    code, out, err = cli(capsys, "query", str(bad), "What is this?")
    assert_one_line_error(code, out, err, "bad.png")
    assert code == 2
    code, out, err = cli(capsys, "query", IMAGE, "   ")
    assert_one_line_error(code, out, err)
    assert code == 2


def test_bad_settings_fail_cleanly(capsys):
    code, out, err = cli(capsys, "query", IMAGE, "hi", "--temperature", "-1")
    assert_one_line_error(code, out, err, "temperature")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["query", IMAGE])  # no question
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["point", IMAGE, "face", "--max-objects", "0"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_python_m_kestrel_help():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "kestrel", "--help"],
        capture_output=True, text=True, cwd=root, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: kestrel")
    for name in COMMANDS:
        assert name in proc.stdout


def test_cache_tier_options(capsys, engine):
    """--embedding-cache-mb sizes the tier (0 turns it off); hostile values and --host-kv-gb on
    a CPU device are refused."""
    obj = cli_json(capsys, "query", IMAGE, "What is this?", *GREEDY, "--embedding-cache-mb", "0")
    assert obj["metrics"]["cache_tier"] == "none"
    assert obj["answer"] == engine.query(IMAGE, "What is this?", settings=GEN).answer
    for bad in ("-1", "nan", "lots", "inf"):
        with pytest.raises(SystemExit) as exc:
            main(["query", IMAGE, "hi", "--embedding-cache-mb", bad, *ENGINE_OPTS])
        assert exc.value.code == 2
    capsys.readouterr()
    code, out, err = cli(capsys, "query", IMAGE, "hi", "--host-kv-gb", "1")
    assert_one_line_error(code, out, err, "host memory")


def test_host_crops_keeps_every_images_crops_on_the_host(capsys, engine):
    """``--host-crops`` is ``Engine(device_crops=False)``; on a CPU the crops are the host's
    anyway, and the answer is the engine's."""
    args = build_parser().parse_args(["query", IMAGE, "hi", "--host-crops"])
    assert engine_kwargs(args)["device_crops"] is False
    assert "device_crops" not in engine_kwargs(build_parser().parse_args(["query", IMAGE, "hi"]))
    obj = cli_json(capsys, "query", IMAGE, "What is this?", *GREEDY, "--host-crops")
    assert obj["answer"] == engine.query(IMAGE, "What is this?", settings=GEN).answer
