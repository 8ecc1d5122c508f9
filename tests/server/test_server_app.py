"""The server app in-process (Starlette's TestClient): every hostile input gets its status and
error body and never reaches the scheduler; auth, the admission limit, bodies, metrics."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")
pytest.importorskip("prometheus_client", reason='needs the serve extra: "kestrel[serve]"')

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kestrel.results import RequestMetrics
from kestrel.server import create_app
from kestrel.server.limits import DEFAULT_MAX_QUEUE
from tests.integration.conftest import assert_idle, scheduler_paused
from tests.server.conftest import (
    ADAPTER,
    GREEDY,
    SHAPES,
    data_url,
    png,
    png_header,
)

KEY = "s3cret-key"
BODY_LIMIT = 1 << 20
PIXEL_LIMIT = 1_000_000
IMAGE = data_url(SHAPES)
METRIC_KEYS = {"input_tokens", "cached_tokens", "output_tokens", "ttft_ms", "prefill_ms",
               "decode_ms", "queue_ms", "cache_tier", "reasoning_tokens"}  # fmt: skip


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, max_body_bytes=BODY_LIMIT, max_image_pixels=PIXEL_LIMIT)
    with TestClient(app) as c:
        yield c


def _q(**fields) -> dict:
    return {"image_url": IMAGE, "question": "What is it?", "settings": GREEDY, **fields}


def _bad_settings(settings) -> dict:
    return _q(settings=settings)


# (id, route, body: dict -> JSON, or bytes as sent, status, error type)
HOSTILE = [
    ("truncated-json", "query", b'{"question": "a', 400, "invalid_json"),
    ("json-array", "query", b"[1, 2]", 400, "invalid_json"),
    ("empty-body", "query", b"", 400, "invalid_json"),
    ("nan-constant", "query", b'{"question": "a", "settings": {"temperature": NaN}}', 400,
     "invalid_json"),
    ("deep-nesting", "query", b"[" * 200_000 + b"]" * 200_000, 400, "invalid_json"),
    ("not-utf8", "query", b'{"question": "\xff\xfe"}', 400, "invalid_json"),
    ("missing-question", "query", {"image_url": IMAGE}, 400, "invalid_request"),
    ("missing-image", "caption", {"length": "short"}, 400, "invalid_request"),
    ("missing-object", "point", {"image_url": IMAGE}, 400, "invalid_request"),
    ("question-not-str", "query", _q(question=5), 400, "invalid_request"),
    ("empty-question", "query", _q(question="   "), 400, "invalid_request"),
    ("unknown-field", "query", _q(temperature=0), 400, "invalid_request"),
    ("stream-not-bool", "query", _q(stream="yes"), 400, "invalid_request"),
    ("point-stream", "point", {"image_url": IMAGE, "object": "a", "stream": True}, 400,
     "invalid_request"),
    ("bad-length", "caption", {"image_url": IMAGE, "length": "epic"}, 400, "invalid_request"),
    ("bad-spatial-refs", "query", _q(spatial_refs=[[0.1, 0.2, 0.3]]), 400, "invalid_request"),
    ("spatial-ref-range", "query", _q(spatial_refs=[[1.5, 0.2]]), 400, "invalid_request"),
    ("prompt-too-long", "query", _q(question="word " * 3000), 400, "prompt_too_long"),
    ("remote-url", "query", _q(image_url="https://example.com/a.png"), 400, "invalid_image"),
    ("not-data-url", "caption", {"image_url": "data:text/plain;base64,aGk="}, 400,
     "invalid_image"),
    ("bad-base64", "query", _q(image_url="data:image/png;base64,@@@"), 400, "invalid_image"),
    ("not-an-image", "query", _q(image_url=data_url(b"hello, not an image")), 400,
     "invalid_image"),
    ("truncated-image", "query", _q(image_url=data_url(SHAPES[:200])), 400, "invalid_image"),
    ("bomb-header", "query", _q(image_url=data_url(png_header(100_000, 100_000))), 400,
     "invalid_image"),
    ("over-pixel-limit", "detect", {"image_url": data_url(png_header(1001, 1000)),
     "object": "a"}, 400, "invalid_image"),
    ("settings-not-object", "query", _bad_settings("hot"), 400, "invalid_request"),
    ("negative-temperature", "query", _bad_settings({"temperature": -1}), 400,
     "invalid_request"),
    ("zero-max-tokens", "query", _bad_settings({"max_tokens": 0}), 400, "invalid_request"),
    ("unknown-setting", "query", _bad_settings({"beam_width": 4}), 400, "invalid_request"),
    ("unknown-adapter", "query", _q(adapter="nope"), 404, "unknown_adapter"),
    ("over-body-limit", "query", _q(pad="x" * BODY_LIMIT), 413, "payload_too_large"),
]  # fmt: skip


def _post(client, route: str, body, **kw):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return client.post(f"/v1/{route}", content=body, headers=headers, **kw)


def _check_error(response, status: int, type_: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "request_id"}
    assert body["error"]["type"] == type_
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert response.headers["x-request-id"] == body["request_id"]
    return body


@pytest.mark.parametrize(("route", "body", "status", "type_"),
                         [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])  # fmt: skip
def test_hostile_input_is_refused_before_the_scheduler(client, engine, route, body, status, type_):
    before = engine.stats()
    _check_error(_post(client, route, body), status, type_)
    after = engine.stats()
    assert after.requests_served + after.requests_failed + after.requests_cancelled == (
        before.requests_served + before.requests_failed + before.requests_cancelled
    )  # nothing was submitted
    ok = _post(client, "query", _q())  # and the server keeps serving
    assert ok.status_code == 200, ok.text


def test_each_route_answers_like_the_engine(client, engine) -> None:
    """Blocking bodies carry the result fields, finish_reason, request_id and metrics."""
    image = png(40, 30)
    url = data_url(image)
    want = engine.query(image, "Why?", settings=GREEDY, adapter=ADAPTER)
    got = _post(client, "query", {"image_url": url, "question": "Why?", "settings": GREEDY,
                                  "adapter": ADAPTER}).json()  # fmt: skip
    assert got["answer"] == want.answer and got["finish_reason"] == want.finish_reason
    assert set(got["metrics"]) == METRIC_KEYS and got["metrics"]["cached_tokens"] > 0
    assert got["request_id"].startswith("req_") and "reasoning" not in got

    want = engine.caption(image, length="short", settings=GREEDY)
    got = _post(client, "caption", {"image_url": url, "length": "short", "settings": GREEDY})
    assert got.json()["caption"] == want.caption
    for route in ("point", "detect"):
        want = getattr(engine, route)(image, "dot", settings={"max_objects": 3})
        got = _post(client, route, {"image_url": url, "object": "dot", "model": "moondream-2",
                                    "settings": {"max_objects": 3}}).json()  # fmt: skip
        key = "points" if route == "point" else "objects"
        assert got[key] == [dict(p) for p in getattr(want, key)]
        assert set(got["metrics"]) == METRIC_KEYS

    want = engine.query(None, "Hi?", settings=GREEDY, reasoning=True)
    got = _post(client, "query", {"question": "Hi?", "settings": GREEDY, "reasoning": True})
    assert got.json()["reasoning"] == want.reasoning.to_dict()
    assert got.json()["answer"] == want.answer
    # the thinking is counted apart from the answer, and within its own max_tokens
    assert 0 < want.metrics.reasoning_tokens <= GREEDY["max_tokens"]
    assert got.json()["metrics"]["reasoning_tokens"] == want.metrics.reasoning_tokens


def _events(response) -> list[dict]:
    lines = [ln for ln in response.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [json.loads(ln[6:]) for ln in lines]


def test_stream_is_server_sent_events(client, engine) -> None:
    want = engine.query(SHAPES, "Stream?", settings=GREEDY)
    response = _post(client, "query", _q(question="Stream?", stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, last = _events(response)
    assert "".join(c["chunk"] for c in chunks) == want.answer
    assert last["completed"] is True and last["finish_reason"] == want.finish_reason
    assert last["request_id"] == response.headers["x-request-id"]
    assert RequestMetrics(**last["metrics"]).cached_tokens > 0


def test_stream_refused_by_the_engine_is_a_json_error(engine) -> None:
    """A request that can never fit the KV pool fails before its first token: with the status
    line still unsent, the client gets a real 503, streaming or not."""
    from kestrel import Engine
    from tests.server.conftest import ENGINE_OPTIONS, MODEL

    with Engine(MODEL, **{**ENGINE_OPTIONS, "kv_cache_pages": 600}) as small:
        with TestClient(create_app(small)) as c:
            for stream in (False, True):
                _check_error(_post(c, "query", _q(stream=stream)), 503, "capacity")
            assert _post(c, "query", {"question": "Short?", "settings": GREEDY}).status_code == 200
        assert_idle(small)


def test_api_key(engine) -> None:
    with TestClient(create_app(engine, api_key=KEY)) as c:
        for headers in ({}, {"X-Moondream-Auth": "wrong"}, {"Authorization": "Bearer wrong"},
                        {"X-Moondream-Auth": KEY[:-1]}):  # fmt: skip
            response = _post(c, "query", _q(), headers=headers)
            _check_error(response, 401, "unauthorized")
            _check_error(c.get("/v1/stats", headers=headers), 401, "unauthorized")
            _check_error(c.get("/metrics", headers=headers), 401, "unauthorized")
        assert _post(c, "query", _q(), headers={"X-Moondream-Auth": KEY}).status_code == 200
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/stats", headers=bearer).status_code == 200
        assert c.get("/v1/health").json()["status"] == "ok"  # open: for load balancers
    with pytest.raises(ValueError, match="API key"):
        create_app(engine, api_key="has space")


def test_full_queue_is_503_with_retry_after(engine) -> None:
    app = create_app(engine, max_queue=1)
    gate = app.state.kestrel.gate
    with TestClient(app) as c:
        held: list = []
        with scheduler_paused(engine):
            first = threading.Thread(target=lambda: held.append(_post(c, "query", _q())))
            first.start()
            for _ in range(500):  # bounded: the first request takes the one slot
                if gate.in_flight == 1:
                    break
                time.sleep(0.01)
            assert gate.in_flight == 1
            response = _post(c, "query", _q())
            _check_error(response, 503, "overloaded")
            assert response.headers["retry-after"] == "1"
        first.join(timeout=60)
        assert held and held[0].status_code == 200
        assert gate.in_flight == 0
        assert _post(c, "query", _q()).status_code == 200


def test_unknown_route_and_method(client) -> None:
    _check_error(_post(client, "nope", {"object": "a"}), 404, "not_found")
    response = client.get("/v1/query")
    _check_error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["allow"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_stats_and_prometheus_metrics(client, engine) -> None:
    _check_error(_post(client, "query", b"{"), 400, "invalid_json")
    for _ in range(2):  # the second hits the cache, whichever tests ran before (or none)
        assert _post(client, "query", _q(question="Metrics?")).status_code == 200
    stats = client.get("/v1/stats").json()
    queue = max(DEFAULT_MAX_QUEUE, 4 * engine.max_batch_size)
    assert stats["server"] == {
        "in_flight": 0,
        "max_queue": queue,
        "image_decodes_skipped": stats["server"]["image_decodes_skipped"],
    }
    assert stats["pages_total"] == engine.stats().pages_total
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    m = _samples(response.text)
    assert m[("kestrel_http_requests_total", (("route", "query"), ("status", "400")))] >= 1
    assert m[("kestrel_http_requests_total", (("route", "query"), ("status", "200")))] >= 1
    count = ("kestrel_http_request_duration_seconds_count", (("route", "query"), ("status", "200")))
    assert m[count] >= 1
    assert m[("kestrel_ttft_seconds_count", (("route", "query"),))] >= 1
    assert m[("kestrel_tokens_total", (("kind", "cached"), ("route", "query")))] > 0
    s = engine.stats()  # idle: the page figures cannot have moved since the scrape
    for state in ("total", "free", "cached", "locked"):
        assert m[("kestrel_kv_pages", (("state", state),))] == getattr(s, f"pages_{state}")
    assert m[("kestrel_queue_depth", ())] == 0
    assert 0 < m[("kestrel_prefix_hit_rate", ())] <= 1
    assert m[("kestrel_in_flight_requests", ())] == 0
    assert_idle(engine)


def test_cache_tiers_in_stats_and_metrics(client, engine) -> None:
    """/v1/stats and /metrics carry the embedding tier's figures and requests by tier."""
    body = {"image_url": data_url(png(90, 70, (10, 200, 40))), "question": "Tiers?",
            "settings": GREEDY}  # fmt: skip
    got = client.post("/v1/query", json=body).json()
    assert got["metrics"]["cache_tier"] == "none"  # a new image: encoded
    again = client.post("/v1/query", json={**body, "question": "Tiers again?"}).json()
    assert again["metrics"]["cache_tier"] == "kv"
    stats = client.get("/v1/stats").json()
    assert stats["embedding_budget_bytes"] > 0 and stats["embedding_misses"] >= 1
    assert 0 < stats["embedding_bytes"] <= stats["embedding_budget_bytes"]
    assert stats["vision_encodes"] >= 1 and stats["host_kv_bytes"] == 0
    skipped = stats["server"]["image_decodes_skipped"]  # the same data URL again: no decode
    assert skipped >= 1
    m = _samples(client.get("/metrics").text)
    # the metric counts the app's and the engine's own (callers of the engine directly)
    engine_own = stats["image_decodes_skipped"]
    assert m[("kestrel_image_decodes_skipped_total", ())] == skipped + engine_own
    s = engine.stats()  # idle: nothing moved since the scrape
    lookups = "kestrel_embedding_cache_lookups_total"
    assert m[(lookups, (("result", "miss"),))] == s.embedding_misses
    assert m[(lookups, (("result", "hit"),))] == s.embedding_hits
    used = ("kestrel_cache_tier_bytes", (("kind", "used"), ("tier", "embedding")))
    assert m[used] == s.embedding_bytes
    assert m[("kestrel_vision_encodes_total", ())] == s.vision_encodes
    by_tier = "kestrel_requests_by_cache_tier_total"
    assert m[(by_tier, (("route", "query"), ("tier", "kv")))] >= 1
    assert m[(by_tier, (("route", "query"), ("tier", "none")))] >= 1


def test_cache_salt_isolates_tenants(client) -> None:
    """Same image and question: a salted request never hits what another salt (or none) cached."""
    body = {"image_url": IMAGE, "question": "What is it?", "settings": GREEDY}
    first = client.post("/v1/query", json=body).json()
    plain = client.post("/v1/query", json=body).json()
    assert plain["metrics"]["cached_tokens"] > 0
    salted = client.post("/v1/query", json={**body, "cache_salt": "tenant-a"}).json()
    assert salted["metrics"]["cached_tokens"] == 0
    again = client.post("/v1/query", json={**body, "cache_salt": "tenant-a"}).json()
    assert again["metrics"]["cached_tokens"] > 0
    assert first["metrics"]["input_tokens"] == salted["metrics"]["input_tokens"]
    bad = client.post("/v1/query", json={**body, "cache_salt": 7})
    assert bad.status_code == 400
