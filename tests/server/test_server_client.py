"""``kestrel serve`` in a subprocess on a free loopback port, driven by the official
``moondream`` client (2.6.1, unchanged) and by raw HTTP where the client cannot reach
(metrics, adapters, disconnects). Answers are compared with the in-process Engine's."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

md = pytest.importorskip(
    "moondream",
    reason="the moondream client is not installed: python -m pip install --no-deps "
    "moondream==2.6.1",
)
pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')

from moondream.types import Base64EncodedImage  # noqa: E402
from PIL import Image  # noqa: E402

from tests.server.conftest import (  # noqa: E402
    ADAPTER,
    ADAPTER_DIR,
    ENGINE_OPTIONS,
    GREEDY,
    MODEL,
    SHAPES,
    data_url,
    png,
    png_header,
)

BODY_LIMIT = 2 << 20
STARTUP_S = 120  # bounds on waiting, never asserted
IDLE_S = 60


@dataclass(frozen=True, slots=True)
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/v1
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.split("//")[1].split("/")[0].split(":")
        return host, int(port)


def _start(log: Path) -> Server:
    options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
    cmd = [
        sys.executable, "-m", "kestrel", "serve", "--model", str(MODEL), "--port", "0",
        *options, "--max-queue", "64", "--max-body-bytes", str(BODY_LIMIT),
        "--adapter", f"{ADAPTER}={ADAPTER_DIR}", "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text(errors="replace"))
        if found:
            server = Server(proc, found.group(0), log)
            if _get(server, "/health")["status"] == "ok":
                return server
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    pytest.fail(f"kestrel serve did not start:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def _get(server: Server, path: str) -> dict:
    with urllib.request.urlopen(server.url + path, timeout=60) as r:
        return json.loads(r.read())


def _post(server: Server, route: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}/{route}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _idle_stats(server: Server) -> dict:
    """/v1/stats once nothing is queued or running (bounded wait)."""
    deadline = time.monotonic() + IDLE_S
    while True:
        s = _get(server, "/stats")
        if (s["running"], s["queue_depth"], s["server"]["in_flight"]) == (0, 0, 0):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def _assert_pages_conserved(s: dict) -> None:
    assert s["pages_locked"] == 0 and s["pages_private"] == 0, s
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s


def _jpeg_of(client, image: Image.Image) -> bytes:
    """The bytes the client uploads for a PIL image (it re-encodes as JPEG)."""
    return base64.b64decode(client.encode_image(image).image_url.split(",", 1)[1])


def test_every_route_blocking_and_streaming_equals_the_engine(server, engine) -> None:
    client = md.vl(endpoint=server.url)
    pil = Image.open(io.BytesIO(SHAPES)).convert("RGB")
    jpeg = _jpeg_of(client, pil)  # what the server sees for `pil`

    want = engine.query(jpeg, "What is it?", settings=GREEDY)
    assert client.query(pil, "What is it?", settings=GREEDY) == {"answer": want.answer}
    streamed = client.query(pil, "What is it?", settings=GREEDY, stream=True)["answer"]
    assert "".join(streamed) == want.answer

    png_image = Base64EncodedImage(image_url=data_url(SHAPES))  # sent as is
    want = engine.query(SHAPES, "Why?", settings=GREEDY, reasoning=True)
    got = client.query(png_image, "Why?", settings=GREEDY, reasoning=True)
    assert got == {"answer": want.answer, "reasoning": want.reasoning.to_dict()}
    refs = [[0.2, 0.3], [0.1, 0.1, 0.5, 0.6]]
    want = engine.query(SHAPES, "Here?", settings=GREEDY, spatial_refs=refs)
    assert client.query(png_image, "Here?", settings=GREEDY, spatial_refs=refs)["answer"] == (
        want.answer
    )
    want = engine.query(None, "Text only?", settings=GREEDY)
    assert client.query(question="Text only?", settings=GREEDY)["answer"] == want.answer

    for length in ("short", "normal"):
        want = engine.caption(jpeg, length=length, settings=GREEDY).caption
        assert client.caption(pil, length=length, settings=GREEDY) == {"caption": want}
        got = client.caption(pil, length=length, settings=GREEDY, stream=True)["caption"]
        assert "".join(got) == want
    region = {"max_objects": 3}
    want = engine.point(jpeg, "circle", settings=region).points
    assert client.point(pil, "circle", settings=region) == {"points": [dict(p) for p in want]}
    want = engine.detect(jpeg, "circle", settings=region).objects
    assert client.detect(pil, "circle", settings=region) == {"objects": [dict(o) for o in want]}

    want = engine.query(SHAPES, "Adapter?", settings=GREEDY, adapter=ADAPTER)
    body = {"image_url": data_url(SHAPES), "question": "Adapter?", "settings": GREEDY}
    assert _post(server, "query", {**body, "adapter": ADAPTER})[1]["answer"] == want.answer


def test_second_question_about_an_image_reports_cached_tokens(server, engine) -> None:
    url = data_url(png(64, 48, (12, 34, 56)))  # an image no other test sends
    first = _post(server, "query", {"image_url": url, "question": "One?", "settings": GREEDY})
    second = _post(server, "query", {"image_url": url, "question": "Two?", "settings": GREEDY})
    assert first[0] == second[0] == 200
    assert first[1]["metrics"]["cached_tokens"] == 0
    assert second[1]["metrics"]["cached_tokens"] >= engine.config.image_tokens
    assert first[1]["request_id"] != second[1]["request_id"]


def test_32_concurrent_clients_get_the_engines_answers(server, engine) -> None:
    n = 32
    image = Base64EncodedImage(image_url=data_url(SHAPES))
    questions = [f"Question number {i}?" for i in range(n)]
    futures = [engine.submit_query(SHAPES, q, settings=GREEDY) for q in questions]
    want = [f.result().answer for f in futures]
    barrier = threading.Barrier(n)

    def ask(i: int) -> str:
        client = md.vl(endpoint=server.url)  # one client per caller, as separate users
        barrier.wait(timeout=60)
        if i % 4 == 3:
            return "".join(
                client.query(image, questions[i], settings=GREEDY, stream=True)["answer"]
            )
        return client.query(image, questions[i], settings=GREEDY)["answer"]

    with ThreadPoolExecutor(max_workers=n) as pool:
        got = list(pool.map(ask, range(n)))
    assert got == want
    _assert_pages_conserved(_idle_stats(server))


HOSTILE = [
    (b'{"question": ', 400, "invalid_json"),
    ({"image_url": data_url(b"not an image"), "question": "q"}, 400, "invalid_image"),
    ({"image_url": data_url(png_header(60_000, 60_000)), "question": "q"}, 400, "invalid_image"),
    ({"question": "q", "settings": {"temperature": "hot"}}, 400, "invalid_request"),
    ({"question": "q", "adapter": "missing"}, 404, "unknown_adapter"),
    ({"question": "q", "pad": "x" * (BODY_LIMIT + 1)}, 413, "payload_too_large"),
]


def test_hostile_inputs_get_their_status_and_the_server_keeps_serving(server) -> None:
    client = md.vl(endpoint=server.url)
    for body, status, type_ in HOSTILE:
        code, got = _post(server, "query", body)
        assert (code, got["error"]["type"]) == (status, type_), got
    with pytest.raises(urllib.error.HTTPError) as caught:  # through the client too
        client.query(Base64EncodedImage(data_url(b"junk")), "What?", settings=GREEDY)
    assert caught.value.code == 400
    for stream in (False, True):  # Moondream 2 cannot segment: a clear 501, streamed or not
        with pytest.raises(urllib.error.HTTPError) as caught:
            result = client.segment(Base64EncodedImage(data_url(SHAPES)), "circle", stream=stream)
            list(result) if stream else result
        assert caught.value.code == 501
        message = json.loads(caught.value.read())["error"]["message"]
        assert "not supported by this model" in message
    assert client.query(question="Still there?", settings=GREEDY)["answer"]
    _assert_pages_conserved(_idle_stats(server))


def _open_stream(server: Server, max_tokens: int) -> tuple[http.client.HTTPConnection, object]:
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    body = {"question": "Tell me everything.", "stream": True,
            "settings": {"temperature": 0, "max_tokens": max_tokens}}  # fmt: skip
    conn.request("POST", "/v1/query", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b'data: {"chunk"')  # the first delta is out
    return conn, response


def test_disconnect_mid_stream_cancels_and_frees_pages(server) -> None:
    before = _idle_stats(server)
    conn, response = _open_stream(server, max_tokens=1800)
    response.close()
    conn.close()  # the client leaves after one of 1800 tokens
    after = _idle_stats(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"]
    _assert_pages_conserved(after)
    # and it keeps serving
    assert _post(server, "query", {"question": "Next?", "settings": GREEDY})[0] == 200


def test_disconnect_while_waiting_for_a_blocking_answer_cancels_it(server) -> None:
    before = _idle_stats(server)
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    body = {"question": "Take your time.", "settings": {"temperature": 0, "max_tokens": 1800}}
    conn.request("POST", "/v1/query", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + IDLE_S
    while _get(server, "/stats")["running"] == 0:  # bounded wait until it is generating
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.close()
    after = _idle_stats(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    _assert_pages_conserved(after)


def test_chat_disconnect_mid_stream_cancels_and_frees_pages(server) -> None:
    before = _idle_stats(server)
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    body = {"model": "moondream3-preview", "stream": True, "temperature": 0, "max_tokens": 1800,
            "messages": [{"role": "user", "content": "Tell me everything."}]}  # fmt: skip
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # the first chunk is out
    response.close()
    conn.close()  # the client leaves long before 1800 tokens
    after = _idle_stats(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"]
    _assert_pages_conserved(after)
    status, _ = _post(server, "query", {"question": "Next?", "settings": GREEDY})
    assert status == 200  # and it keeps serving


def test_moondream_client_chat_plain_and_streamed(server, engine) -> None:
    client = md.vl(endpoint=server.url)
    user = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(SHAPES)}},
        {"type": "text", "text": "What is it?"}]}  # fmt: skip
    want = engine.chat(
        [{"role": "user", "content": [{"type": "image", "image": SHAPES},
                                      {"type": "text", "text": "What is it?"}]}],
        settings=GREEDY,
    )  # fmt: skip
    got = client.chat([user], settings=GREEDY)
    assert got == {"message": want.message, "finish_reason": want.finish_reason}
    streamed = client.chat([user], settings=GREEDY, stream=True)["message"]
    assert "".join(streamed) == want.content
    follow = [user, got["message"], {"role": "user", "content": "And the colour?"}]
    second = engine.chat(
        [{"role": "user", "content": [{"type": "image", "image": SHAPES},
                                      {"type": "text", "text": "What is it?"}]},
         want.message, {"role": "user", "content": "And the colour?"}],
        settings=GREEDY,
    )  # fmt: skip
    assert client.chat(follow, settings=GREEDY)["message"]["content"] == second.content
    _assert_pages_conserved(_idle_stats(server))


def test_openai_client_chat_completions(server, engine) -> None:
    openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    image_part = {"type": "image_url", "image_url": {"url": data_url(SHAPES)}}
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": "Hm?"}]}]
    want = engine.chat(
        [{"role": "user", "content": [{"type": "image", "image": SHAPES},
                                      {"type": "text", "text": "Hm?"}]}],
        settings=GREEDY,
    )  # fmt: skip
    options = {"model": "gpt-anything", "messages": messages, "temperature": 0, "max_tokens": 4}
    got = client.chat.completions.create(**options)
    assert got.object == "chat.completion" and got.model == MODEL.name
    assert got.choices[0].message.content == want.content
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.metrics.input_tokens
    assert got.usage.prompt_tokens_details.cached_tokens >= engine.config.image_tokens
    chunks = list(
        client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.content
    assert chunks[-1].usage.completion_tokens == want.metrics.output_tokens
    salted = client.chat.completions.create(**options, extra_body={"cache_salt": "openai-test"})
    assert salted.choices[0].message.content == want.content
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # a namespace of its own
    with pytest.raises(openai.BadRequestError, match="'n' = 2"):
        client.chat.completions.create(**options, n=2)
    _assert_pages_conserved(_idle_stats(server))


def test_sigterm_finishes_in_flight_streams_and_exits_0(server) -> None:
    """Runs last: it stops the module's server."""
    conn, response = _open_stream(server, max_tokens=1000)
    server.proc.send_signal(signal.SIGTERM)
    events = [json.loads(line[6:]) for line in response if line.startswith(b"data: ")]
    conn.close()
    assert events[-1]["completed"] is True
    assert events[-1]["metrics"]["output_tokens"] == 1000  # not cut short by the shutdown
    assert server.proc.wait(timeout=60) == 0
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
