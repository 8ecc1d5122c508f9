"""POST /v1/chat/completions in-process: the OpenAI shapes (blocking, streamed, usage), equal
to Engine.chat, and a hostile matrix that gets 4xx JSON errors while the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")

from starlette.testclient import TestClient

from kestrel.engine.chat import MAX_IMAGES
from kestrel.server import create_app
from tests.integration.conftest import assert_idle
from tests.server.conftest import SHAPES, data_url, png, png_header

KEY = "chat-key"
PIXEL_LIMIT = 1_000_000
ROUTE = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _user(text: str, url: str | None = None) -> dict:
    if url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [_image_part(url), {"type": "text", "text": text}]}


MESSAGES = [{"role": "system", "content": "Be brief."}, _user("What is it?", data_url(SHAPES))]
BODY = {"model": "anything", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, api_key=KEY, max_image_pixels=PIXEL_LIMIT)
    with TestClient(app) as c:
        yield c


def _events(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_object_equals_engine_chat(client, engine) -> None:
    want = engine.chat(
        [MESSAGES[0], _user("What is it?", None) | {"content": [
            {"type": "image", "image": SHAPES}, {"type": "text", "text": "What is it?"}]}],
        settings={"max_tokens": 4, "temperature": 0},
    )  # fmt: skip
    r = client.post(ROUTE, json=BODY, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == Path(engine.model_path).name  # whatever the client named
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.content}
    assert choice["finish_reason"] == want.finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == want.metrics.input_tokens > engine.config.image_tokens
    assert usage["completion_tokens"] == want.metrics.output_tokens
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= engine.config.image_tokens


def test_stream_equals_blocking_and_reports_usage(client) -> None:
    blocking = client.post(ROUTE, json=BODY, headers=AUTH).json()
    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    r = client.post(ROUTE, json=streamed, headers={"X-Moondream-Auth": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    text = "".join(d.get("content", "") for d in deltas)
    assert text == blocking["choices"][0]["message"]["content"]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finals[-1] == blocking["choices"][0]["finish_reason"]
    assert all(f is None for f in finals[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens"] == blocking["usage"]["prompt_tokens"]
    no_usage = _events(client.post(ROUTE, json={**BODY, "stream": True}, headers=AUTH).text)
    assert all(e["choices"] for e in no_usage)


def test_reasoning_and_a_second_turn(client) -> None:
    first = client.post(ROUTE, json={**BODY, "reasoning": True}, headers=AUTH).json()
    message = first["choices"][0]["message"]
    assert set(message) == {"role", "content", "reasoning"}
    usage, metrics = first["usage"], first["metrics"]
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    assert thought == metrics["reasoning_tokens"] > 0  # it thought before it answered
    assert usage["completion_tokens"] == metrics["output_tokens"] + thought
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    follow = {"messages": [*MESSAGES, message, _user("And?")], "max_completion_tokens": 3}
    second = client.post(ROUTE, json=follow, headers=AUTH).json()
    assert second["usage"]["completion_tokens"] <= 3
    # turn 1 was prompted [answer, thinking], its history block ends [answer, answer]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        first["usage"]["prompt_tokens"] - 1
    )


BOMB = data_url(png_header(40_000, 40_000))
HOSTILE = [
    ("not-json", b"{nope", 400, "invalid_json"),
    ("array", b"[]", 400, "invalid_json"),
    ("no-messages", {"model": "m"}, 400, "invalid_request"),
    ("empty-messages", {"messages": []}, 400, "invalid_request"),
    ("messages-not-list", {"messages": "hi"}, 400, "invalid_request"),
    ("unknown-role", {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request"),
    ("content-number", {"messages": [{"role": "user", "content": 3}]}, 400, "invalid_request"),
    ("ends-with-assistant", {"messages": [_user("a"), {"role": "assistant", "content": "b"}]},
     400, "invalid_request"),
    ("n-2", {**BODY, "n": 2}, 400, "invalid_request"),
    ("tools", {**BODY, "tools": [{"type": "function"}]}, 400, "invalid_request"),
    ("response-format-type", {**BODY, "response_format": {"type": "yaml"}}, 400,
     "invalid_request"),
    ("response-format-regex", {**BODY, "response_format": {"type": "regex", "regex": "("}},
     400, "invalid_request"),
    ("top-logprobs-alone", {**BODY, "top_logprobs": 2}, 400, "invalid_request"),
    ("top-logprobs-21", {**BODY, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request"),
    ("stop-number", {**BODY, "stop": 3}, 400, "invalid_request"),
    ("bad-temperature", {**BODY, "temperature": -1}, 400, "invalid_request"),
    ("temperature-string", {**BODY, "temperature": "hot"}, 400, "invalid_request"),
    ("max-tokens-disagree", {**BODY, "max_tokens": 2, "max_completion_tokens": 3}, 400,
     "invalid_request"),
    ("stream-options", {**BODY, "stream_options": {"continuous_usage_stats": True}}, 400,
     "invalid_request"),
    ("image-in-assistant", {"messages": [_user("a"), {"role": "assistant",
     "content": [_image_part(data_url(SHAPES))]}, _user("b")]}, 400, "invalid_request"),
    ("path-as-image", {"messages": [{"role": "user", "content": [
     {"type": "image", "image": "/etc/passwd"}, {"type": "text", "text": "q"}]}]}, 400,
     "invalid_request"),
    ("too-many-images", {"messages": [{"role": "user", "content": [_image_part(data_url(SHAPES))]
     * (MAX_IMAGES + 1) + [{"type": "text", "text": "q"}]}]}, 400, "invalid_request"),
    ("images-over-context", {"messages": [{"role": "user", "content": [_image_part(
     data_url(SHAPES))] * 3 + [{"type": "text", "text": "q"}]}]}, 400, "prompt_too_long"),
    ("remote-url", {"messages": [_user("q", "https://example.com/a.png")]}, 400, "invalid_image"),
    ("bad-base64", {"messages": [_user("q", "data:image/png;base64,@@@")]}, 400, "invalid_image"),
    ("not-an-image", {"messages": [_user("q", data_url(b"hello"))]}, 400, "invalid_image"),
    ("bomb", {"messages": [_user("q", BOMB)]}, 400, "invalid_image"),
    ("too-long", {"messages": [_user("word " * 3000)]}, 400, "prompt_too_long"),
    ("unknown-adapter", {**BODY, "adapter": "nope"}, 404, "unknown_adapter"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "kind"), [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])  # fmt: skip
def test_hostile_input_gets_a_json_error(client, engine, body, status, kind) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(ROUTE, content=data, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == kind


def test_auth_is_required_and_the_server_keeps_serving(client, engine) -> None:
    assert client.post(ROUTE, json=BODY).status_code == 401
    small = {**BODY, "messages": [_user("Still there?", data_url(png(20, 20)))]}
    assert client.post(ROUTE, json=small, headers=AUTH).status_code == 200
    assert_idle(engine)
