"""The server on Moondream 3: it reports the served family (``/v1/health``, the startup line)
and takes the ``moondream`` client's model names, answering as the Engine does."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")

from starlette.testclient import TestClient

from kestrel import Engine
from kestrel.cli import serve
from kestrel.server import create_app
from tests.conftest import FIXTURES
from tests.server.conftest import ENGINE_OPTIONS, data_url

MD3 = FIXTURES / "md3-tiny-a"
SCENE = MD3 / "images" / "scene_800x600.png"
GREEDY = {"temperature": 0, "max_tokens": 6}
CLIENT_NAMES = ["moondream3-preview", "moondream/moondream3-preview",
                "moondream/moondream3.1-9B-A2B", "any string at all"]  # fmt: skip


@pytest.fixture(scope="module")
def md3_engine():
    with Engine(MD3, **ENGINE_OPTIONS) as e:
        yield e


@pytest.fixture(scope="module")
def client(md3_engine):
    with TestClient(create_app(md3_engine)) as c:
        yield c


def test_health_reports_the_family(client, engine) -> None:
    body = client.get("/v1/health").json()
    assert (body["status"], body["model"], body["family"]) == ("ok", "md3-tiny-a", "moondream3")
    with TestClient(create_app(engine)) as md2:  # the Moondream 2 fixture's engine
        assert md2.get("/v1/health").json()["family"] == "moondream2"


@pytest.mark.parametrize("model", CLIENT_NAMES)
def test_client_model_names_are_accepted(client, md3_engine, model: str) -> None:
    question = "How many squares are in the picture?"
    body = {"image_url": data_url(SCENE.read_bytes()), "question": question,
            "settings": GREEDY, "model": model}  # fmt: skip
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    want = md3_engine.query(SCENE, question, settings={**GREEDY, "temperature": 0.0})
    assert response.json()["answer"] == want.answer
    detect = {"image_url": body["image_url"], "object": "square", "model": model,
              "settings": {"max_objects": 3}}  # fmt: skip
    response = client.post("/v1/detect", json=detect)
    assert response.status_code == 200, response.text
    want = md3_engine.detect(SCENE, "square", settings={"max_objects": 3})
    assert response.json()["objects"] == [dict(b) for b in want.objects]


def test_chat_takes_a_client_model_name(client) -> None:
    body = {"model": "moondream/moondream3-preview", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about a red car."}]}  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


def test_startup_line_names_the_family(md3_engine, capsys) -> None:
    args = argparse.Namespace(host="127.0.0.1")
    serve._announce(args, 2020, md3_engine, None)
    line = capsys.readouterr().out
    assert "md3-tiny-a (moondream3) on http://127.0.0.1:2020/v1" in line


def test_segment_names_the_missing_segmentation_weights(client, md3_engine) -> None:
    """The published Moondream 3 checkpoints stop after the box: a 501 that says so, for the
    clients' blocking and streamed calls alike, and nothing reaches the scheduler."""
    before = md3_engine.stats().requests_served
    for stream in (False, True):
        body = {"image_url": data_url(SCENE.read_bytes()), "object": "square", "stream": stream,
                "model": "moondream3-preview"}  # fmt: skip
        r = client.post("/v1/segment", json=body)
        assert r.status_code == 501, r.text
        error = r.json()["error"]
        assert error["type"] == "unsupported" and "segmentation weights" in error["message"]
        assert "stop after the box" in error["message"]
    assert md3_engine.stats().requests_served == before
