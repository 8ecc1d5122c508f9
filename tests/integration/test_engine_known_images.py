"""Through the Engine: the same encoded image asked about again is not decoded again. A cache
hit never decodes it; a request that needs its crops (another tenant's salt: nothing cached)
decodes it then, on the crop pool's thread, and answers as a first sight does. Conversations,
which send their image with every turn, take the same path."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from kestrel.images.known import DeferredImage, KnownImages
from tests.integration.conftest import GREEDY

IMAGE_TOKENS = 729


def _png() -> bytes:
    pixels = np.random.default_rng(11).integers(0, 256, (120, 160, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def recording_prepares(monkeypatch) -> list:
    """Every image ``KnownImages.prepare`` returns from now on, in order."""
    made: list = []
    prepare = KnownImages.prepare

    def recording(self, image):
        made.append(prepare(self, image))
        return made[-1]

    monkeypatch.setattr(KnownImages, "prepare", recording)
    return made


def test_a_repeated_image_is_decoded_only_when_its_crops_are_needed(make_engine, monkeypatch):
    made = recording_prepares(monkeypatch)
    engine, png = make_engine(), _png()
    first = engine.query(png, "What is in the picture?", settings=GREEDY)
    again = engine.query(png, "What colour is it?", settings=GREEDY)
    deferred = made[-1]
    assert isinstance(deferred, DeferredImage) and deferred.digest == made[0].digest
    assert again.metrics.cached_tokens >= IMAGE_TOKENS and not deferred.decoded  # a hit
    salted = engine.query(png, "What is in the picture?", settings=GREEDY, cache_salt="t2")
    assert isinstance(made[-1], DeferredImage) and made[-1].decoded  # its crops were made
    assert salted.metrics.cached_tokens == 0 and salted.answer == first.answer
    assert engine.stats().image_decodes_skipped == 2  # the second and the salted query
    fresh = make_engine()  # a first sight on another engine: the same answer
    assert fresh.query(png, "What colour is it?", settings=GREEDY).answer == again.answer


def test_a_conversation_sends_its_image_each_turn_and_decodes_it_once(make_engine, monkeypatch):
    made = recording_prepares(monkeypatch)
    engine, png = make_engine(), _png()
    turn = {"role": "user", "content": [{"type": "image", "image": png},
                                        {"type": "text", "text": "What is it?"}]}  # fmt: skip
    first = engine.chat([turn], settings=GREEDY)
    reply = first.message
    second = engine.chat([turn, reply, {"role": "user", "content": "And then?"}], settings=GREEDY)
    assert isinstance(made[-1], DeferredImage) and not made[-1].decoded
    assert second.metrics.cached_tokens >= IMAGE_TOKENS
