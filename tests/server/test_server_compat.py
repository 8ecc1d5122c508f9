"""What the clients people already use send: the official Python client's segment (blocking and
streamed, over a synthetic path stream) and its burst of 100 calls, the Node client's
``variant``, the ``openai`` client's ``models.list()`` and nulls, Moondream Station's spellings
(``/health``, ``obj``, bare base64, ``count``), and the requests that must stay errors."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")

from starlette.testclient import TestClient

from kestrel.results import RequestMetrics
from kestrel.server import bind, create_app
from kestrel.server.info import model_adapter
from kestrel.skills import SegmentSkill
from tests.server.conftest import ADAPTER, GREEDY, SHAPES, data_url
from tests.unit.test_segment_skill import COORD_ID, EOS, PathScript, words

IMAGE = data_url(SHAPES)
PATH_WORDS = [COORD_ID, *words("M", "0", "0", "L", "960", "480", "Z"), EOS]
PATH = "M 0 0 L 1 0.5 Z"
BOX = {"x_min": 0.25, "y_min": 0.125, "x_max": 0.75, "y_max": 0.375}


@dataclass(frozen=True, slots=True)
class _Segmented:
    path: str
    bbox: dict | None
    finish_reason: str
    metrics: RequestMetrics


class _PathStream:
    """An engine stream of a segment request: the box (a dict), then path text."""

    def __init__(self, deltas: list, result: _Segmented) -> None:
        self.deltas, self._result, self.cancelled = deltas, result, False

    async def __aiter__(self):
        for d in self.deltas:
            yield d

    async def result(self) -> _Segmented:
        return self._result

    def cancel(self) -> None:
        self.cancelled = True


class SegmentingEngine:
    """The fixture engine plus an ``asegment`` that drives the real SegmentSkill over a
    synthetic token stream (no model can segment: see the module docstring of the skill)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list[dict] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def asegment(self, image, obj, *, stream, **options):
        self.calls.append({"object": obj, "image": image, **options})
        skill = SegmentSkill(PathScript(PATH_WORDS), obj, max_path_tokens=32)
        deltas: list = []
        while skill.advance("logits", "hidden", 64) is not None:
            if skill.bbox is not None and not deltas:
                deltas.append(skill.bbox)
            if text := skill.take_text():
                deltas.append(text)
        parts = skill.result()
        metrics = RequestMetrics(10, 0, len(skill.output_tokens()), 1.0, 1.0, 1.0, 0.0)
        result = _Segmented(parts.path, parts.bbox, skill.finish_reason, metrics)
        return _PathStream(deltas, result) if stream else result


@contextlib.contextmanager
def live(app) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port, in a thread; yields the /v1 URL."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    sock.listen(512)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):  # bounded wait for startup
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def segmenting(engine):
    return SegmentingEngine(engine)


@pytest.fixture(scope="module")
def url(segmenting):
    with live(create_app(segmenting, bind_host="127.0.0.1")) as u:
        yield u


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


def _md():
    return pytest.importorskip("moondream", reason="pip install --no-deps moondream==2.6.1")


def test_python_client_segment_blocking_and_streamed(url, segmenting) -> None:
    md = _md()
    from moondream.types import Base64EncodedImage

    model = md.vl(endpoint=url)
    image = Base64EncodedImage(image_url=IMAGE)
    assert model.segment(image, "red circle") == {"path": PATH, "bbox": BOX}
    assert segmenting.calls[-1]["object"] == "red circle"
    events = list(model.segment(image, "red circle", stream=True, spatial_refs=[[0.5, 0.5]]))
    assert events[0] == {"bbox": BOX}
    chunks = [e["chunk"] for e in events[1:-1]]
    assert "".join(chunks) == PATH and len(chunks) > 1
    assert events[-1] == {"path": PATH, "bbox": BOX, "completed": True}
    assert segmenting.calls[-1]["spatial_refs"] == [[0.5, 0.5]]


def test_segment_stream_events_in_order(segmenting) -> None:
    with TestClient(create_app(segmenting)) as c:
        body = {"image_url": IMAGE, "object": "car", "stream": True}
        r = c.post("/v1/segment", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "bbox" and kinds[-1] == "final" and set(kinds[1:-1]) == {"path_delta"}
    assert all(e["completed"] is False for e in events[1:-1])
    final = events[-1]
    assert (final["path"], final["bbox"], final["completed"]) == (PATH, BOX, True)
    assert final["finish_reason"] == "stop" and "metrics" in final and "request_id" in final


def test_segment_on_moondream_2_is_not_supported(client, engine) -> None:
    before = engine.stats().requests_served
    r = client.post("/v1/segment", json={"image_url": IMAGE, "object": "circle"})
    assert r.status_code == 501, r.text
    assert r.json()["error"]["type"] == "unsupported"
    assert "not supported by this model" in r.json()["error"]["message"]
    assert engine.stats().requests_served == before


def test_a_burst_of_100_client_calls_is_served(url) -> None:
    """Neither official client retries a 503: the default queue must hold a burst."""
    md = _md()
    from moondream.types import Base64EncodedImage

    model = md.vl(endpoint=url)
    image = Base64EncodedImage(image_url=IMAGE)
    settings = {"temperature": 0, "max_tokens": 1}
    with ThreadPoolExecutor(100) as pool:
        answers = list(pool.map(lambda _: model.query(image, "Color?", settings=settings),
                                range(100)))  # fmt: skip
    assert len({a["answer"] for a in answers}) == 1


def test_openai_models_list_and_model_at_adapter(client, engine) -> None:
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    ids = [m.id for m in oa.models.list().data]
    name = client.get("/v1/health").json()["model"]
    assert ids == [name, f"{name}@{ADAPTER}"]
    q = {"image_url": IMAGE, "question": "What is it?", "settings": GREEDY}
    by_model = client.post("/v1/query", json={**q, "model": f"{name}@{ADAPTER}"}).json()
    by_adapter = client.post("/v1/query", json={**q, "adapter": ADAPTER}).json()
    assert by_model["answer"] == by_adapter["answer"]
    clash = client.post("/v1/query", json={**q, "model": f"{name}@{ADAPTER}", "adapter": "x"})
    assert clash.status_code == 400
    assert model_adapter("other@fr", name, [ADAPTER]) is None  # any other model: ignored


def test_openai_models_retrieve(client) -> None:
    """``models.retrieve`` (GET /v1/models/{id}): each listed model by its id, as listed; an
    id the list does not hold is the client's NotFoundError."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    listed = oa.models.list().data
    for m in listed:
        got = oa.models.retrieve(m.id)
        assert (got.id, got.object, got.created, got.owned_by) == (
            m.id, "model", m.created, "kestrel",
        )  # fmt: skip
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("gpt-4o")
    assert err.value.status_code == 404 and "gpt-4o" in str(err.value)


def test_variant_is_the_adapter(client) -> None:
    q = {"image_url": IMAGE, "question": "What is it?", "settings": GREEDY}
    variant = client.post("/v1/query", json={**q, "variant": ADAPTER}).json()
    adapter = client.post("/v1/query", json={**q, "adapter": ADAPTER}).json()
    assert variant["answer"] == adapter["answer"]
    for route, body in (("query", q), ("detect", {"image_url": IMAGE, "object": "a"})):
        r = client.post(f"/v1/{route}", json={**body, "variant": "ft-unknown@5"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_adapter"
    both = client.post("/v1/query", json={**q, "variant": ADAPTER, "adapter": "other"})
    assert both.status_code == 400
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = client.post("/v1/chat/completions", json={**chat, "variant": "nope"})
    assert r.status_code == 404


def test_openai_nulls_mean_not_set_and_stream_options_need_a_stream(client) -> None:
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    nulls = dict.fromkeys(("top_logprobs", "response_format", "tools", "logit_bias",
                           "metadata", "service_tier", "reasoning_effort"))  # fmt: skip
    r = client.post("/v1/chat/completions", json={**chat, **nulls})
    assert r.status_code == 200, r.text
    for key in nulls:  # a value is still refused, naming the field
        r = client.post("/v1/chat/completions", json={**chat, key: {"x": 1}})
        assert r.status_code == 400 and key in r.json()["error"]["message"]
    bad = client.post("/v1/chat/completions",
                      json={**chat, "stream_options": {"include_usage": True}})  # fmt: skip
    assert bad.status_code == 400 and "stream_options" in bad.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json={**chat, "stream": False,
                                                    "stream_options": None})  # fmt: skip
    assert ok.status_code == 200
    skill_nulls = {"settings": None, "adapter": None, "spatial_refs": None, "stream": None}
    r = client.post("/v1/query", json={"image_url": IMAGE, "question": "Hi?", **skill_nulls})
    assert r.status_code == 200, r.text


def test_query_strings_on_post_routes_are_an_error(client, engine) -> None:
    before = engine.stats().requests_served
    r = client.post("/v1/caption?length=short", json={"image_url": IMAGE})
    assert r.status_code == 400 and "length" in r.json()["error"]["message"]
    assert engine.stats().requests_served == before


def test_station_spellings(client) -> None:
    health, v1 = client.get("/health").json(), client.get("/v1/health").json()
    assert health == v1 and health["status"] == "ok"
    base = {"image_url": IMAGE, "object": "circle", "settings": {"max_objects": 4}}
    obj = {**base, "obj": base["object"]}
    del obj["object"]
    for route, key in (("point", "points"), ("detect", "objects")):
        want = client.post(f"/v1/{route}", json=base).json()
        got = client.post(f"/v1/{route}", json=obj).json()
        assert got[key] == want[key] and got["count"] == len(want[key])
    bare = {**base, "image_url": base64.b64encode(SHAPES).decode()}
    assert client.post("/v1/detect", json=bare).json()["objects"] == want["objects"]
    clash = client.post("/v1/point", json={**base, "obj": "square"})
    assert clash.status_code == 400
    stream = client.post("/v1/point", json={**base, "stream": True})
    assert stream.status_code == 400 and "does not stream" in stream.json()["error"]["message"]
