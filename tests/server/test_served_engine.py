"""The written contract between the app and its engines: ``Engine`` and ``ClusterEngine`` both
have every member of :class:`kestrel.server.protocol.ServedEngine`, with the protocol's call
signatures; the app refuses an object that lacks one, naming it; and the same requests get the
same answers through either engine (the cluster here runs in-process: its one replica wraps the
fixture engine behind a stand-in for a Ray Serve handle), the official client's segment call
included: the same 501 body from both."""

from __future__ import annotations

import asyncio
import inspect
import json
import urllib.error

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")
pytest.importorskip("ray.serve", reason='needs the ray extra: pip install "kestrel[ray]"')

from starlette.testclient import TestClient

from kestrel.distributed.frontdoor import ClusterEngine, ReplicaLink
from kestrel.distributed.ring import Router
from kestrel.distributed.serve_replica import EngineReplica
from kestrel.server import create_app
from kestrel.server.protocol import MEMBERS, CallOptions, ServedEngine, missing_members
from tests.server.conftest import ADAPTER, GREEDY, SHAPES, data_url
from tests.server.test_server_compat import live

IMAGE = data_url(SHAPES)
CALLS = ("aquery", "acaption", "apoint", "adetect", "asegment", "achat")


class _Now:
    """A finished Serve response: ``result()`` at once."""

    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout_s=None):
        return self.value

    def cancel(self) -> None:
        pass


class _Gen:
    """A replica's stream as a Serve handle gives it (``__anext__`` and ``cancel``)."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __anext__(self):
        return self.agen.__anext__()

    def cancel(self) -> None:  # the test never leaves a stream early
        pass


class _Method:
    def __init__(self, remote) -> None:
        self.remote = remote


class LocalHandle:
    """A stand-in for a replica's Serve handle: the replica's methods run in this process."""

    def __init__(self, replica: EngineReplica) -> None:
        self.call = _Method(lambda *a: asyncio.ensure_future(replica.call(*a)))
        self.stream = _Method(lambda *a: _Gen(replica.stream(*a)))
        self.describe = _Method(lambda: _Now(replica.describe()))
        self.stats = _Method(lambda: _Now(replica.stats()))

    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def cluster(engine):
    """A front door over one in-process replica of the session's engine."""
    replica = EngineReplica.__new__(EngineReplica)  # its constructor would load a model
    replica.engine, replica.name = engine, "local:0"
    handle = LocalHandle(replica)
    link = ReplicaLink("r0", handle, handle.describe.remote().result())
    door = ClusterEngine([link], Router(["r0"]))
    yield door
    door.close()
    replica.engine = None  # the replica closes its engine when collected: not this shared one


@pytest.fixture(scope="module", params=["engine", "cluster"])
def served(request):
    return request.getfixturevalue(request.param)


def test_both_engines_have_every_member(served) -> None:
    assert missing_members(served) == []
    assert isinstance(served, ServedEngine)
    assert served.supports_segment is False  # neither fixture model can segment
    assert served.config.family == "moondream2" and served.max_batch_size >= 1


@pytest.mark.parametrize("name", CALLS)
def test_calls_take_the_protocol_arguments(served, name: str) -> None:
    """Each call is a coroutine function that accepts the arguments the protocol names."""
    impl = getattr(type(served), name)
    assert inspect.iscoroutinefunction(impl), name
    wanted = inspect.signature(getattr(ServedEngine, name)).parameters.values()
    args, kwargs = [], {}
    for p in list(wanted)[1:]:  # after self
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = p.default
        elif p.kind is p.VAR_KEYWORD:  # **options: the CallOptions
            kwargs.update(dict.fromkeys(CallOptions.__annotations__))
        else:
            args.append(object())
    assert {"settings", "adapter", "cache_salt"} <= kwargs.keys()
    inspect.signature(getattr(served, name)).bind(*args, **kwargs)


def test_the_app_names_what_an_engine_lacks() -> None:
    class Half:
        model_path, max_batch_size, exif_orientation = None, 1, True

    with pytest.raises(TypeError, match="Half lacks config, closed, supports_segment"):
        create_app(Half())
    assert "asegment" in MEMBERS and len(missing_members(Half())) == len(MEMBERS) - 3


@pytest.fixture(scope="module")
def clients(engine, cluster):
    with TestClient(create_app(engine)) as one, TestClient(create_app(cluster)) as door:
        yield one, door


def _stable(value):
    """A JSON body less what differs between two apps by nature (ids, times) or by order (the
    one engine serves both apps: the second request hits the cache the first one filled)."""
    if isinstance(value, dict):
        drop = {"request_id", "created", "id", "metrics", "prompt_tokens_details"}
        return {k: _stable(v) for k, v in value.items() if k not in drop}
    return [_stable(v) for v in value] if isinstance(value, list) else value


HI = [{"role": "user", "content": "Hi"}]
REQUESTS = [
    ("query", {"image_url": IMAGE, "question": "What is it?", "settings": GREEDY}),
    ("query", {"image_url": IMAGE, "question": "Why?", "reasoning": True, "settings": GREEDY}),
    ("query", {"image_url": IMAGE, "question": "Hi?", "adapter": ADAPTER, "settings": GREEDY}),
    ("caption", {"image_url": IMAGE, "length": "short", "settings": GREEDY}),
    ("point", {"image_url": IMAGE, "object": "circle", "settings": {"max_objects": 3}}),
    ("detect", {"image_url": IMAGE, "object": "circle", "settings": {"max_objects": 3}}),
    ("segment", {"image_url": IMAGE, "object": "circle"}),
    ("segment", {"image_url": IMAGE, "object": "circle", "stream": True}),
    ("chat/completions", {"model": "m", "max_tokens": 3, "temperature": 0, "messages": HI}),
    ("query", {"image_url": IMAGE, "question": " ", "settings": GREEDY}),  # 400 from the engine
    ("query", {"image_url": IMAGE, "question": "Hi?", "adapter": "nope"}),  # 404
]


@pytest.mark.parametrize(("route", "body"), REQUESTS, ids=lambda x: x if isinstance(x, str) else "")
def test_the_same_answers_through_either_engine(clients, route: str, body: dict) -> None:
    one, door = clients
    want = one.post(f"/v1/{route}", json=body)
    got = door.post(f"/v1/{route}", json=body)
    assert got.status_code == want.status_code, got.text
    assert _stable(got.json()) == _stable(want.json())


def test_streams_and_describing_routes_agree(clients) -> None:
    one, door = clients
    body = {"image_url": IMAGE, "question": "What is it?", "stream": True, "settings": GREEDY}
    streamed = [c.post("/v1/query", json=body).text for c in (one, door)]
    chunks = [[json.loads(x[6:]).get("chunk") for x in s.splitlines() if x] for s in streamed]
    assert chunks[0] == chunks[1] and len(chunks[0]) > 1
    for path in ("/v1/health", "/v1/models"):
        assert _stable(door.get(path).json()) == _stable(one.get(path).json()), path


def _client_segment(url: str) -> tuple[int, dict]:
    md = pytest.importorskip("moondream", reason="pip install --no-deps moondream==2.6.1")
    from moondream.types import Base64EncodedImage

    model = md.vl(endpoint=url)
    with pytest.raises(urllib.error.HTTPError) as caught:
        model.segment(Base64EncodedImage(image_url=IMAGE), "circle")
    return caught.value.code, json.loads(caught.value.read())


def test_the_official_clients_segment_gets_one_501_from_both(engine, cluster) -> None:
    before = engine.stats().requests_served
    bodies = []
    for served in (engine, cluster):
        with live(create_app(served, bind_host="127.0.0.1")) as url:
            bodies.append(_client_segment(url))
    (status, body), (door_status, door_body) = bodies
    assert status == door_status == 501
    assert body["error"] == door_body["error"]
    assert body["error"]["type"] == "unsupported"
    assert "Moondream 2 has no segmentation skill" in body["error"]["message"]
    assert engine.stats().requests_served == before  # refused before the scheduler
