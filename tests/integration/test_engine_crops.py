"""An Engine query's image crops are made off the scheduler thread: on the crop pool's threads
(which hand them to a worker process), started at submission; nothing on the scheduler thread
crops or normalizes pixels on the host."""

from __future__ import annotations

import threading

from kestrel import Engine
from kestrel.crops import maker as crop_maker
from kestrel.crops import overlap as crops
from kestrel.crops import staging as crop_staging
from kestrel.moondream import vision
from tests.integration.conftest import FIXTURE_MODEL, GREEDY, assert_idle


def test_crops_never_run_on_the_scheduler_thread(images, monkeypatch) -> None:
    seen: dict[str, list[str]] = {"crop": [], "host": [], "prefill": []}

    def recording(kind, fn):
        def wrapper(*args, **kwargs):
            seen[kind].append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(crop_maker.Cropper, "crop", recording("crop", crop_maker.Cropper.crop))
    for module, name in [(crops, "overlap_crops"), (crops, "write_crops"),
                         (vision, "normalize_pixels"), (crop_maker, "write_crops"),
                         (crop_staging, "normalize_pixels")]:  # fmt: skip
        monkeypatch.setattr(module, name, recording("host", getattr(module, name)))
    with Engine(FIXTURE_MODEL, device="cpu", dtype="float32") as engine:
        rt = engine.runtime
        monkeypatch.setattr(rt, "prefill_sequences", recording("prefill", rt.prefill_sequences))
        first = engine.query(images["scene_800x600"], "What is this?", settings=GREEDY)
        again = engine.query(images["scene_800x600"], "What is here?", settings=GREEDY)
        other = engine.submit_query(images["tall_300x1000"], "And this?", settings=GREEDY)
        other.result()
        assert_idle(engine)
        stats = engine.stats()
    scheduler = set(seen["prefill"])
    assert scheduler == {"kestrel-scheduler"}, seen
    # two new images: each cropped once, on the pool's threads; the repeat was a cache hit
    assert len(seen["crop"]) == 2 and all(t.startswith("kestrel-crops") for t in seen["crop"])
    assert not scheduler & set(seen["host"]), seen
    assert again.metrics.cached_tokens > 0 and first.answer and stats.vision_encodes_skipped == 1
