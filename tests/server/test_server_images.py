"""Images as people have them through the server (docs/images.md): a data URL stored in any
EXIF orientation answers as its upright picture; 16-bit, transparent and animated images answer
as the pixels they are read as; ``kestrel serve --keep-exif-orientation`` keeps the stored ones."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")
pytest.importorskip("prometheus_client", reason='needs the serve extra: "kestrel[serve]"')

from starlette.testclient import TestClient

from kestrel.cli import build_parser, common
from kestrel.server import create_app
from tests.generated_images import STORED, UPRIGHT, encode, stored_png
from tests.integration.test_engine_images import first_frame, sixteen_bit, transparent
from tests.server.conftest import ENGINE_OPTIONS, GREEDY, MODEL, data_url

REGION = {"max_objects": 2}


def detect(client, data: bytes, kind: str = "png") -> dict:
    body = {"image_url": data_url(data, kind), "object": "square", "settings": REGION}
    response = client.post("/v1/detect", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_orientation_answers_as_the_upright_picture(engine) -> None:
    want = [dict(b) for b in engine.detect(UPRIGHT, "square", settings=REGION).objects]
    with TestClient(create_app(engine)) as client:
        for k in STORED:
            got = detect(client, stored_png(k))
            assert got["objects"] == want, k
            assert got["metrics"]["cached_tokens"] > 0, k  # the upright picture's cache entry
        # A phone's JPEG: the same compressed pixels with and without the orientation tag.
        phone = Image.fromarray(np.ascontiguousarray(STORED[6]))
        tagged = detect(client, encode(phone, "JPEG", 6, quality=95), "jpeg")
        untagged = encode(phone, "JPEG", quality=95)
        sideways = detect(client, untagged, "jpeg")
    turned = np.rot90(engine.prepare_image(untagged).pixels, -1)  # what orientation 6 asks
    want_tagged = engine.detect(turned, "square", settings=REGION)
    assert tagged["objects"] == [dict(b) for b in want_tagged.objects]
    assert sideways["metrics"]["cached_tokens"] == 0  # another picture: not the upright one


@pytest.mark.parametrize("case", [sixteen_bit, transparent, first_frame])
def test_image_answers_as_the_pixels_it_is_read_as(engine, case) -> None:
    data, seen = case()
    want = engine.query(seen, "What is it?", settings=GREEDY)
    body = {"image_url": data_url(data), "question": "What is it?", "settings": GREEDY}
    with TestClient(create_app(engine)) as client:
        got = client.post("/v1/query", json=body).json()
    assert got["answer"] == want.answer and got["metrics"]["cached_tokens"] > 0


def test_keep_exif_orientation_serves_the_stored_pixels() -> None:
    from kestrel import Engine

    args = build_parser().parse_args(["serve", "--keep-exif-orientation"])
    kwargs = common.engine_kwargs(args)
    assert kwargs["exif_orientation"] is False  # what `kestrel serve` builds its engine with
    with Engine(MODEL, **{**ENGINE_OPTIONS, "exif_orientation": False}) as engine:
        want = engine.detect(STORED[6], "square", settings=REGION)
        with TestClient(create_app(engine)) as client:
            got = detect(client, stored_png(6))
    assert got["objects"] == [dict(b) for b in want.objects]
    assert got["metrics"]["cached_tokens"] > 0


def test_an_image_sent_again_is_not_decoded_again(engine, monkeypatch) -> None:
    """Clients send the image with every request (OpenAI chat clients with every turn): the
    same data URL again is prepared without a decode, and still answers from the cache."""
    from kestrel.images.known import DeferredImage
    from tests.integration.test_engine_known_images import recording_prepares

    made = recording_prepares(monkeypatch)
    body = {"image_url": data_url(stored_png(1)), "question": "What is it?", "settings": GREEDY}
    with TestClient(create_app(engine)) as client:
        first = client.post("/v1/query", json=body).json()
        again = client.post("/v1/query", json=body).json()
        content = [{"type": "image_url", "image_url": {"url": data_url(stored_png(1))}},
                   {"type": "text", "text": "What is it?"}]  # fmt: skip
        chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    server_side = [m for m in made if isinstance(m, DeferredImage)]
    assert len(server_side) >= 2 and not any(m.decoded for m in server_side)
    assert again["answer"] == first["answer"] and again["metrics"]["cached_tokens"] > 0
