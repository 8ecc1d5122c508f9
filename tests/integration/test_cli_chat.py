"""``kestrel chat`` on the fixture model: the typed conversation and the ``--json`` script mode
answer what ``Engine.chat`` answers for the same messages; images join their turn; errors."""

from __future__ import annotations

import io
import json

import pytest

from kestrel import Engine
from kestrel.cli.chat import cached_share
from kestrel.results import RequestMetrics
from tests.integration.test_cli import GEN, GREEDY, IMAGE, MODEL, cli

SHAPES = str(MODEL / "images" / "shapes_378.png")


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL, device="cpu", dtype="float32", kv_cache_pages=6000, max_batch_size=4) as e:
        yield e


def _stdin(monkeypatch, text: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(text))


def _image(path: str) -> dict:
    return {"type": "image", "image": path}


def test_typed_conversation_streams_answers_with_images_and_cached_shares(
    capsys, engine, monkeypatch
):
    _stdin(monkeypatch, "What is it?\n\n/image /no/such.png\n/image " + SHAPES + "\nAnd this?\n")
    code, out, err = cli(capsys, "chat", IMAGE, "--system", "Be brief.", *GREEDY)
    assert code == 0, err
    first = {"role": "user", "content": [_image(IMAGE), {"type": "text", "text": "What is it?"}]}
    messages = [{"role": "system", "content": "Be brief."}, first]
    a = engine.chat(messages, settings=GEN, cache_salt="cli-typed")
    messages += [a.message, {"role": "user", "content": [_image(SHAPES), {"type": "text",
                 "text": "And this?"}]}]  # fmt: skip
    b = engine.chat(messages, settings=GEN, cache_salt="cli-typed")
    assert out == f"{a.content}\n{b.content}\n"
    shares = [line for line in err.splitlines() if line.startswith("[cached")]
    assert shares[0] == f"[cached 0 of {a.metrics.input_tokens} positions: 0%]"
    cached = a.metrics.input_tokens + len(a.tokens)  # the first turn and its answer
    assert shares[1].startswith(f"[cached {cached} of {b.metrics.input_tokens} positions")
    assert "no such image file: /no/such.png" in err and "\x1b[" not in err


def test_json_mode_answers_each_user_line(capsys, engine, monkeypatch):
    lines = [
        {"role": "user", "content": "What is it?"},
        # history given as is (ends with an assistant message: nothing answered)
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": " hi"}],
        {"role": "user", "content": [{"type": "text", "text": "Which colour?"}]},
    ]
    _stdin(monkeypatch, "\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = cli(capsys, "chat", SHAPES, "--json", *GREEDY)
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert len(got) == 2
    first = {"role": "user", "content": [_image(SHAPES), {"type": "text", "text": "What is it?"}]}
    a = engine.chat([first], settings=GEN)
    second = [first, a.message, *lines[1], lines[2]]
    b = engine.chat(second, settings=GEN)
    assert [g["message"] for g in got] == [a.message, b.message]
    assert [g["finish_reason"] for g in got] == [a.finish_reason, b.finish_reason]
    assert got[0]["metrics"]["input_tokens"] == a.metrics.input_tokens
    assert got[1]["metrics"]["cached_tokens"] >= got[0]["metrics"]["input_tokens"]


def test_json_mode_bad_line_and_missing_image_exit_2(capsys, monkeypatch, tmp_path):
    _stdin(monkeypatch, "{not json\n")
    code, out, err = cli(capsys, "chat", "--json", *GREEDY)
    assert code == 2 and out == "" and "stdin line 1 is not JSON" in err
    code, _, err = cli(capsys, "chat", str(tmp_path / "nope.png"))
    assert code == 2 and "no such image file" in err


@pytest.mark.parametrize("dim", [False, True])
def test_cached_share_is_dim_on_a_terminal(dim: bool) -> None:
    m = RequestMetrics(input_tokens=750, cached_tokens=744, output_tokens=5,
                       ttft_ms=1.0, prefill_ms=1.0, decode_ms=1.0, queue_ms=0.0)  # fmt: skip
    text = cached_share(m, dim=dim)
    assert "[cached 744 of 750 positions: 99%]" in text
    assert text.startswith("\x1b[2m") == dim
