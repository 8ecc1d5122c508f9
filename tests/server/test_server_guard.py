"""The attacks a web page can make on a local server, driven in-process: a form POST, a
text/plain POST, a rebound Host header, a foreign Origin; and what stays open: the JSON
clients, the playground's own origin, origins listed with ``--allow-origin`` (CORS)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")

from starlette.testclient import TestClient

from kestrel.server import create_app
from tests.server.conftest import GREEDY, SHAPES, data_url

QUERY = {"image_url": data_url(SHAPES), "question": "What is it?", "settings": GREEDY}
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
SITE = "https://app.example"
BASE = "http://127.0.0.1:2020"


def _submitted(engine) -> int:
    s = engine.stats()
    return s.requests_served + s.requests_failed + s.requests_cancelled


@pytest.fixture(scope="module")
def local(engine):
    """The app as ``kestrel serve`` makes it on loopback, with one allowed origin."""
    app = create_app(engine, bind_host="127.0.0.1", allow_origins=[SITE])
    with TestClient(app, base_url=BASE) as c:
        yield c


# (content type, body): what a page can send cross-origin without a CORS preflight
SIMPLE = [
    ("application/x-www-form-urlencoded", "question=hi&image_url=x"),
    ("text/plain", json.dumps(QUERY)),
    ("multipart/form-data; boundary=b", "--b\r\n\r\n{}\r\n--b--"),
    (None, json.dumps(QUERY)),
]


@pytest.mark.parametrize(("kind", "body"), SIMPLE, ids=["form", "text", "multipart", "none"])
@pytest.mark.parametrize("route", ["query", "chat/completions", "segment"])
def test_json_routes_refuse_bodies_not_labelled_json(local, engine, route, kind, body) -> None:
    before = _submitted(engine)
    headers = {} if kind is None else {"Content-Type": kind}
    r = local.post(f"/v1/{route}", content=body.encode(), headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["type"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]
    assert _submitted(engine) == before


def test_json_with_a_charset_is_served(local) -> None:
    headers = {"Content-Type": "application/json; charset=utf-8"}
    r = local.post("/v1/query", content=json.dumps(QUERY).encode(), headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example:2020", "evil.example", "10.0.0.8:2020",
                                  "127.0.0.1.evil.example"])  # fmt: skip
def test_a_rebound_host_is_refused_on_every_route(local, engine, host) -> None:
    before = _submitted(engine)
    post = local.post("/v1/query", json=QUERY, headers={"Host": host})
    assert post.status_code == 403 and post.json()["error"]["type"] == "forbidden_host"
    for path in ("/v1/health", "/v1/stats", "/v1/models", "/"):
        assert local.get(path, headers={"Host": host}).status_code == 403, path
    assert _submitted(engine) == before


@pytest.mark.parametrize("host", ["127.0.0.1:2020", "localhost:2020", "[::1]:2020",
                                  "127.0.0.2", "app.example"])  # fmt: skip
def test_loopback_hosts_and_an_allowed_sites_host_are_served(local, host) -> None:
    assert local.get("/v1/health", headers={"Host": host}).status_code == 200


def test_a_server_not_on_loopback_does_not_check_host(engine) -> None:
    with TestClient(create_app(engine, bind_host="0.0.0.0")) as c:
        assert c.get("/v1/health", headers={"Host": "gpu-box.lan:2020"}).status_code == 200


@pytest.mark.parametrize("origin", ["https://evil.example", "http://127.0.0.1:9999", "null",
                                    "http://localhost:2020"])  # fmt: skip
def test_a_foreign_origin_is_refused(local, engine, origin) -> None:
    """Another site, another local port, a sandboxed page: each is a different origin."""
    before = _submitted(engine)
    r = local.post("/v1/query", json=QUERY, headers={"Origin": origin})
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden_origin"
    assert "--allow-origin" in r.json()["error"]["message"]
    chat = local.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    assert chat.status_code == 403
    assert _submitted(engine) == before


def test_the_playground_page_own_origin_is_served(local) -> None:
    page = local.get("/")
    assert page.status_code == 200
    r = local.post("/v1/query", json=QUERY, headers={"Origin": BASE})
    assert r.status_code == 200, r.text
    assert "access-control-allow-origin" not in r.headers  # same origin: no CORS needed


def test_an_allowed_origin_gets_cors(local) -> None:
    pre = local.options(
        "/v1/query",
        headers={"Origin": SITE, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, x-moondream-auth"},
    )  # fmt: skip
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == SITE
    assert "x-moondream-auth" in pre.headers["access-control-allow-headers"].lower()
    r = local.post("/v1/query", json=QUERY, headers={"Origin": SITE})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == SITE
    evil = local.options(
        "/v1/query",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert evil.status_code == 403


def test_any_origin_when_asked(engine) -> None:
    app = create_app(engine, bind_host="127.0.0.1", allow_origins=["*"])
    with TestClient(app, base_url=BASE) as c:
        r = c.post("/v1/health".replace("health", "query"), json=QUERY,
                   headers={"Origin": "https://anything.example"})  # fmt: skip
        assert r.status_code == 200


def test_bad_origins_are_refused_when_the_app_is_made(engine) -> None:
    for bad in ("app.example", "ftp://app.example", "https://app.example/path"):
        with pytest.raises(ValueError, match="origin"):
            create_app(engine, allow_origins=[bad])
