"""The playground's routes in-process: ``GET /`` and its files are served without a key and
load nothing from elsewhere; the API routes beside them are unchanged (the browser test,
``test_playground_browser.py``, drives the page itself)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")

from starlette.testclient import TestClient

from kestrel.server import create_app
from kestrel.server.playground import ASSETS, STATIC

KEY = "k-123"
ROOT = Path(__file__).resolve().parents[2]
_REFERENCE = re.compile(r'(?:src|href)="([^"]+)"')  # in the HTML
_IMPORT = re.compile(r'^import .* from "([^"]+)";', re.MULTILINE)  # in the scripts


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, api_key=KEY)) as c:
        yield c


def test_the_page_needs_no_key_and_says_where_it_may_load_from(client) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    assert "<title>Kestrel playground</title>" in page.text
    assert client.head("/").status_code == 200


def test_every_file_the_page_loads_is_served_from_here(client) -> None:
    """Follow the HTML's references and the scripts' imports: each is a local file that the
    server serves with its type; nothing names another host (the page works offline)."""
    html = client.get("/").text
    todo = [ref for ref in _REFERENCE.findall(html) if not ref.startswith("#")]
    assert sorted(todo) == [f"{ASSETS}/app.js", f"{ASSETS}/style.css"]
    seen = set()
    while todo:
        ref = todo.pop()
        assert ref.startswith(f"{ASSETS}/"), ref  # no http://, no CDN
        if ref in seen:
            continue
        seen.add(ref)
        response = client.get(ref)
        assert response.status_code == 200, ref
        kind = "text/css" if ref.endswith(".css") else "javascript"
        assert kind in response.headers["content-type"], (ref, response.headers)
        for spec in _IMPORT.findall(response.text):
            assert spec.startswith("./"), (ref, spec)
            todo.append(f"{ASSETS}/{spec[2:]}")
    assert seen == {f"{ASSETS}/{p.name}" for p in STATIC.iterdir() if p.suffix != ".html"}


def test_the_api_routes_are_unchanged(client) -> None:
    assert client.get("/v1/health").json()["status"] == "ok"  # open, as before
    refused = client.get("/v1/stats")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
    assert client.get("/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for path, status, kind in [
        ("/playground/__init__.py", 404, "not_found"),  # only the static folder is served
        ("/playground/nope.js", 404, "not_found"),
        ("/index.html", 404, "not_found"),
    ]:
        response = client.get(path)
        assert response.status_code == status and response.json()["error"]["type"] == kind
    posted = client.post("/", content=b"{}")
    assert posted.status_code == 405 and posted.json()["error"]["type"] == "method_not_allowed"


def test_the_page_ships_in_the_package() -> None:
    """Every file of the page matches the package-data globs, so a wheel carries it."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["kestrel.server.playground"]
    base = STATIC.parent
    for path in STATIC.iterdir():
        name = path.relative_to(base).as_posix()
        assert any(fnmatch.fnmatch(name, g) for g in globs), name
