"""``kestrel serve --ray --replicas 2`` in a subprocess (its own local Ray, two replicas of the
fixture model on Ray Serve, one CPU each), driven over HTTP on a loopback port: every route,
streaming, the API key and the app tests' hostile inputs answer as ``kestrel serve`` does;
requests go by image (each image encoded once in the cluster, a chat's turns meet their KV);
/v1/stats and /metrics show each replica; a replica killed under load fails only what was
running on it (503 + Retry-After) and comes back; SIGTERM drains. One server for the module."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve", reason='needs the ray extra: pip install "kestrel[ray]"')
pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="the app tests' module needs httpx (the test extra)")

from kestrel.distributed.ring import HashRing
from kestrel.images import prepare_image
from tests.server.conftest import ADAPTER, GREEDY, SHAPES, data_url, png
from tests.server.ray_front import (
    AUTH,
    KEY,
    NAMES,
    STARTUP_S,
    WAIT_S,
    Server,
    assert_pages_conserved,
    attached_door,
    idle_stats,
    post,
    raw,
    request,
    running_server,
    stable,
    stats,
    stream,
)
from tests.server.test_server_app import BODY_LIMIT, HOSTILE, PIXEL_LIMIT


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = ["--max-body-bytes", str(BODY_LIMIT), "--max-image-pixels", str(PIXEL_LIMIT)]
    with running_server(tmp_path_factory.mktemp("serve-ray") / "server.log", *limits) as s:
        yield s


def _owner(image: bytes) -> str:
    """The replica the front door's ring gives this image while both are live."""
    return HashRing(NAMES).owner(prepare_image(image).digest, set(NAMES))


def _image_of(owner: str, salt: int) -> bytes:
    """A small picture that the ring gives ``owner``."""
    for i in range(256):
        image = png(32 + i % 16, 24 + i // 16, ((salt * 37 + i) % 256, (i * 11) % 256, 90))
        if _owner(image) == owner:
            return image
    raise AssertionError(f"no image for {owner}")


def test_the_startup_line_names_the_replicas(server) -> None:
    line = next(ln for ln in server.log.read_text().splitlines() if "--ray" in ln)
    assert "2 replicas" in line and all(name in line for name in NAMES), line
    status, _, health = request(server, "/health", headers={})  # open without the key
    assert status == 200 and health["status"] == "ok" and health["adapters"] == [ADAPTER]


def test_other_routes_answer_as_kestrel_serve_does(server, engine) -> None:
    """The playground, the model list, health and segment: the same status and body as the
    app of plain ``kestrel serve`` over one in-process engine."""
    from starlette.testclient import TestClient

    from kestrel.server import create_app

    segment = {"image_url": data_url(SHAPES), "object": "circle"}
    calls = [("GET", "/", None), ("GET", "/v1/models", None), ("GET", "/v1/health", None),
             ("POST", "/v1/segment", segment)]  # fmt: skip
    with TestClient(create_app(engine, api_key=KEY)) as local:
        for method, path, body in calls:
            want = local.request(method, path, json=body, headers=AUTH)
            status, kind, text = raw(server, method, path, body)
            assert (status, kind) == (want.status_code, want.headers["content-type"]), path
            if kind.startswith("application/json"):
                assert stable(json.loads(text)) == stable(want.json()), path


ROUTES = [
    ("query", {"question": "What is it?"}),
    ("query-reasoning", {"question": "Why?", "reasoning": True}),
    ("query-adapter", {"question": "Adapter?", "adapter": ADAPTER}),
    ("query-text-only", {"question": "Text only?", "image_url": None}),
    ("caption", {"length": "short"}),
    ("point", {"object": "circle", "settings": {"max_objects": 3}}),
    ("detect", {"object": "circle", "settings": {"max_objects": 3}}),
]


@pytest.mark.parametrize(("case", "fields"), ROUTES, ids=[r[0] for r in ROUTES])
def test_every_route_answers_like_one_engine(server, engine, case, fields) -> None:
    route = case.split("-")[0]
    body = {"image_url": data_url(SHAPES), "settings": GREEDY, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status, got = post(server, route, body)
    assert status == 200, got
    image = SHAPES if "image_url" in body else None
    settings = body["settings"]
    if route == "query":
        extra = {k: body[k] for k in ("reasoning", "adapter") if k in body}
        want = engine.query(image, body["question"], settings=settings, **extra)
        assert got["answer"] == want.answer
        if want.reasoning is not None:
            assert got["reasoning"] == want.reasoning.to_dict()
    elif route == "caption":
        assert got["caption"] == engine.caption(image, length="short", settings=settings).caption
    else:
        want = getattr(engine, route)(image, "circle", settings=settings)
        key = "points" if route == "point" else "objects"
        assert got[key] == [dict(p) for p in getattr(want, key)]
    assert got["request_id"].startswith("req_") and got["metrics"]["input_tokens"] > 0


@pytest.mark.parametrize("route", ["query", "caption"])
def test_streams_are_the_blocking_answer(server, engine, route) -> None:
    body = {"image_url": data_url(SHAPES), "settings": GREEDY, "stream": True}
    if route == "query":
        body["question"] = "Stream?"
        want = engine.query(SHAPES, "Stream?", settings=GREEDY).answer
    else:
        want = engine.caption(SHAPES, settings=GREEDY).caption
    *chunks, last = stream(server, route, body)
    assert "".join(c["chunk"] for c in chunks) == want
    assert last["completed"] is True and last["metrics"]["cached_tokens"] > 0


def test_chat_blocking_and_streamed_and_its_second_turn_hits(server, engine) -> None:
    image = png(48, 40, (20, 160, 90))  # no other test sends it
    user = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "What is it?"}]}  # fmt: skip
    local = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    want = engine.chat(local, settings=GREEDY)
    body = {"model": "any", "messages": [user], "temperature": 0, "max_tokens": 4}
    status, got = post(server, "chat/completions", body)
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want.content
    chunks = stream(server, "chat/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.content
    turn = [user, got["choices"][0]["message"], {"role": "user", "content": "And the colour?"}]
    second = engine.chat([*local, want.message, turn[2]], settings=GREEDY)
    status, got = post(server, "chat/completions", {**body, "messages": turn})
    assert got["choices"][0]["message"]["content"] == second.content
    # the second turn met the first turn's replica: its image and first answer are cached
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > engine.config.image_tokens


@pytest.mark.parametrize(("route", "body", "status", "type_"),
                         [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])  # fmt: skip
def test_hostile_input_gets_the_same_error_and_reaches_no_replica(
    server, route, body, status, type_
) -> None:
    before = idle_stats(server)
    got_status, headers, got = request(server, f"/{route}", body)
    assert (got_status, got["error"]["type"]) == (status, type_), got
    assert set(got) == {"error", "request_id"} and got["error"]["message"]
    assert headers["x-request-id"] == got["request_id"]
    after = idle_stats(server)
    ran = ("requests_served", "requests_failed", "requests_cancelled")
    # nothing reached a scheduler (what the engine checks, it checks before submitting)
    assert [after[k] for k in ran] == [before[k] for k in ran]


def test_api_key_guards_every_route_but_health(server) -> None:
    for headers in ({}, {"X-Moondream-Auth": "wrong"}, {"Authorization": "Bearer wrong"}):
        for path, body in (("/query", {"question": "q"}), ("/stats", None)):
            status, _, got = request(server, path, body, headers=headers)
            assert (status, got["error"]["type"]) == (401, "unauthorized"), got
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert request(server, "/query", {"question": "q", "settings": GREEDY}, bearer)[0] == 200
    status, _, got = request(server, "/nope", {"object": "a"})
    assert (status, got["error"]["type"]) == (404, "not_found")


def test_routing_by_image_encodes_each_image_once(server) -> None:
    images = [_image_of(NAMES[i % 2], 100 + i) for i in range(6)]  # 3 per replica
    before = idle_stats(server)
    jobs = [(img, q) for q in ("One?", "Two?", "Three?") for img in images]
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(
            lambda job: post(server, "query", {"image_url": data_url(job[0]),
                                                "question": job[1], "settings": GREEDY}),
            jobs))  # fmt: skip
    assert all(status == 200 for status, _ in results), results
    after = idle_stats(server)
    assert after["vision_encodes"] - before["vision_encodes"] == len(images)
    for b, a in zip(before["replicas"], after["replicas"], strict=True):
        assert a["routed"] - b["routed"] == 9  # its three images' nine questions
        assert a["vision_encodes"] - b["vision_encodes"] == 3
    assert_pages_conserved(after)


def test_a_second_front_door_attaches_to_the_same_replicas(server, tmp_path) -> None:
    """Same names, same ring: an image meets the same replica through either front door; the
    attached door's SIGTERM leaves the replicas running."""
    line = next(ln for ln in server.log.read_text().splitlines() if "--ray" in ln)
    address = re.search(r"Ray at ([^;]+);", line).group(1)
    image = _image_of(NAMES[1], 500)
    body = {"image_url": data_url(image), "question": "Which door?", "settings": GREEDY}
    before = idle_stats(server)
    with attached_door(tmp_path / "door2.log", address) as door:
        assert all(name in door.log.read_text() for name in NAMES)
        status, got = post(door, "query", body)
        assert status == 200 and got["metrics"]["cached_tokens"] == 0
        door.proc.send_signal(signal.SIGTERM)
        assert door.proc.wait(timeout=WAIT_S) == 0
    status, again = post(server, "query", {**body, "question": "And this door?"})
    assert status == 200 and again["metrics"]["cached_tokens"] > 0  # the same replica's KV
    after = idle_stats(server)
    served = [a["requests_served"] - b["requests_served"]
              for a, b in zip(after["replicas"], before["replicas"], strict=True)]  # fmt: skip
    assert served == [0, 2]
    assert_pages_conserved(after)


def test_stats_and_metrics_show_each_replica_and_the_sum(server) -> None:
    for name in NAMES:  # traffic on every replica, whichever tests ran before (or none)
        body = {"image_url": data_url(_image_of(name, 900)), "question": "Sum?", "settings": GREEDY}
        assert post(server, "query", body)[0] == 200
    s = idle_stats(server)
    assert all(r["requests_served"] > 0 for r in s["replicas"])
    assert [r["replica"] for r in s["replicas"]] == NAMES
    for key in ("requests_served", "vision_encodes_skipped", "pages_cached"):
        assert s[key] == sum(r[key] for r in s["replicas"]), key
    prompt = sum(r["prompt_tokens"] for r in s["replicas"])
    cached = sum(r["cached_tokens"] for r in s["replicas"])
    assert s["hit_rate"] == pytest.approx(cached / prompt, rel=1e-9)
    req = urllib.request.Request(server.url.removesuffix("/v1") + "/metrics", headers=AUTH)
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        text = r.read().decode()
    for name in NAMES:
        assert f'kestrel_replica_up{{replica="{name}"}} 1.0' in text
        assert f'kestrel_replica_requests_served_total{{replica="{name}"}}' in text
    assert "kestrel_prefix_hit_rate " in text and "kestrel_http_requests_total" in text


@pytest.mark.parametrize("streamed", [True, False], ids=["mid-stream", "blocking"])
def test_a_client_that_leaves_cancels_its_request_on_the_replica(server, streamed) -> None:
    before = idle_stats(server)
    conn = http.client.HTTPConnection(*server.address, timeout=WAIT_S)
    body = {"question": "Tell me everything.", "stream": streamed,
            "settings": {"temperature": 0, "max_tokens": 1800}}  # fmt: skip
    conn.request("POST", "/v1/query", json.dumps(body),
                 {"Content-Type": "application/json", **AUTH})  # fmt: skip
    if streamed:
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b'data: {"chunk"')
        response.close()
    else:
        deadline = time.monotonic() + WAIT_S
        while stats(server)["running"] == 0:  # bounded wait until it is generating
            assert time.monotonic() < deadline
            time.sleep(0.01)
    conn.close()  # the client leaves long before 1800 tokens
    after = idle_stats(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"]
    assert_pages_conserved(after)


def _long_query(server: Server, image: bytes, out: list) -> threading.Thread:
    """A blocking query that runs for a long while, in a thread; its outcome goes to ``out``."""
    body = {"image_url": data_url(image), "question": "Tell me everything.",
            "settings": {"temperature": 0, "max_tokens": 1800}}  # fmt: skip
    thread = threading.Thread(target=lambda: out.append(request(server, "/query", body)))
    thread.start()
    return thread


def _replica(stats: dict, name: str) -> dict:
    return next(r for r in stats["replicas"] if r["replica"] == name)


def _wait_until(server: Server, ok, what: str) -> dict:
    deadline = time.monotonic() + STARTUP_S
    while True:
        s = stats(server)
        if ok(s):
            return s
        assert time.monotonic() < deadline, f"{what}: {s['replicas']}"
        time.sleep(0.1)


def test_a_replica_killed_under_load_fails_only_its_requests_and_comes_back(server) -> None:
    victim, survivor = NAMES
    mine = [_image_of(victim, 300 + i) for i in range(3)]
    theirs = [_image_of(survivor, 400 + i) for i in range(3)]
    old_pid = int(_replica(idle_stats(server), victim)["process"].split(":")[1])
    doomed: list = []
    long_one = _long_query(server, mine[0], doomed)  # surely running on the victim
    _wait_until(server, lambda s: _replica(s, victim)["running"] >= 1, "the long query runs")

    stop = threading.Event()

    def load(image: bytes) -> list:  # a client asking about the survivor's images meanwhile
        got = []
        while not stop.is_set() and len(got) < 40:  # bounded in count
            body = {"image_url": data_url(image), "question": "Again?", "settings": GREEDY}
            got.append(post(server, "query", body))
        return got

    with ThreadPoolExecutor(max_workers=2) as pool:
        loads = [pool.submit(load, image) for image in theirs[:2]]
        os.kill(old_pid, signal.SIGKILL)
        long_one.join(timeout=WAIT_S)
        # the victim's keys go to the next replica at once: its image is answered there
        body = {"image_url": data_url(mine[1]), "question": "Moved?", "settings": GREEDY}
        status, moved = post(server, "query", body)
        stop.set()
        other = [r for f in loads for r in f.result(timeout=WAIT_S)]
    assert doomed, "the long query never returned"
    code, headers, body = doomed[0]
    assert (code, body["error"]["type"]) == (503, "replica_unavailable"), body
    assert headers["retry-after"] == "1"
    assert status == 200, moved
    assert other and all(code == 200 for code, _ in other), other  # nobody else failed

    back = _wait_until(
        server,
        lambda s: (
            _replica(s, victim)["live"]
            and _replica(s, victim)["process"] is not None
            and int(_replica(s, victim)["process"].split(":")[1]) != old_pid
        ),
        "the victim is restarted and back on the ring",
    )
    served = _replica(back, victim)["requests_served"]  # a fresh engine
    body = {"image_url": data_url(mine[2]), "question": "Back?", "settings": GREEDY}
    status, again = post(server, "query", body)
    assert status == 200, again
    after = idle_stats(server)
    assert _replica(after, victim)["requests_served"] == served + 1  # its keys came back
    assert_pages_conserved(after)


def test_sigterm_finishes_in_flight_streams_and_exits_0(server) -> None:
    """Runs last: it stops the module's server."""
    conn = http.client.HTTPConnection(*server.address, timeout=WAIT_S)
    body = {"question": "Tell me everything.", "stream": True,
            "settings": {"temperature": 0, "max_tokens": 600}}  # fmt: skip
    conn.request("POST", "/v1/query", json.dumps(body),
                 {"Content-Type": "application/json", **AUTH})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b'data: {"chunk"')
    server.proc.send_signal(signal.SIGTERM)
    events = [json.loads(line[6:]) for line in response if line.startswith(b"data: ")]
    conn.close()
    assert events[-1]["completed"] is True
    assert events[-1]["metrics"]["output_tokens"] == 600  # not cut short by the shutdown
    assert server.proc.wait(timeout=WAIT_S) == 0
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log


def test_ray_options_without_ray_are_refused(capsys) -> None:
    from kestrel.cli import main

    assert main(["serve", "--replicas", "2", "--routing", "random", "--port", "0"]) == 2
    assert "--replicas, --routing only apply with --ray" in capsys.readouterr().err
