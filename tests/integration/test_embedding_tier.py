"""The image-embedding tier on the md2-tiny-a fixture (float32, CPU): an image whose KV was
evicted is not encoded again, its answers do not change, salts isolate, budgets hold."""

from __future__ import annotations

import pytest

from kestrel.errors import InvalidInputError
from kestrel.images import prepare_image
from tests.integration.conftest import GREEDY
from tests.integration.test_runtime_cache import greedy, query_prompt
from tests.tolerance import assert_close

MIB = 1 << 20


def _pool_for_one_image(cfg) -> int:
    """Room for one image prompt and its answer: the next image evicts the previous one."""
    return cfg.prefix_len + 40


class _CountingCrops:
    """Counts the images the runtime asks the crop pool for (held or taken)."""

    def __init__(self, crops) -> None:
        self.crops, self.held, self.taken = crops, [], []
        self.real_hold, self.real_pixels = crops.hold, crops.pixels
        crops.hold = self.hold
        crops.pixels = self.pixels

    def hold(self, images, **kw):
        images = list(images)
        self.held += [im.digest for im in images]
        return self.real_hold(images, **kw)

    def pixels(self, image):
        self.taken.append(image.digest)
        return self.real_pixels(image)


def _rounds(rt, cfg, imgs, rounds: int, salt=None):
    """Ask about each image in turn, ``rounds`` times; each answer and the state's tier."""
    prompt = query_prompt(cfg, [302, 333, 272, 271])
    out = []
    for _ in range(rounds):
        for img in imgs:
            s, lg = rt.start_sequence(prompt, img, max_new_tokens=6, cache_salt=salt)
            out.append((greedy(rt, s, lg, 6), s.cache_tier, s.reused_page_count))
            rt.release_sequence(s)
            rt.check_integrity()
    return out


def test_evicted_image_is_served_from_the_tier_with_the_same_answer(make_runtime, model, images):
    cfg = model.config
    imgs = [prepare_image(images[n]) for n in ("shapes_378", "scene_800x600", "tall_300x1000")]
    pages = _pool_for_one_image(cfg)
    off = make_runtime(kv_cache_pages=pages, embedding_cache_bytes=0)
    on = make_runtime(kv_cache_pages=pages, embedding_cache_bytes=8 * MIB)
    crops = _CountingCrops(on.crops)
    ref = _rounds(off, cfg, imgs, 2)
    got = _rounds(on, cfg, imgs, 2)
    assert [a for a, _, _ in got] == [a for a, _, _ in ref]  # same greedy answers
    assert off.counters.encoder_runs == 2 * len(imgs)  # every revisit was a KV miss
    assert on.counters.encoder_runs == len(imgs)  # ... and the tier encoded each image once
    assert [t for _, t, _ in got] == ["none"] * 3 + ["embedding"] * 3
    assert all(reused == 0 for _, _, reused in got)  # the KV really was evicted
    assert on.counters.embedding_hits == len(imgs)
    # no crops were asked for an image served by the tier
    assert sorted(crops.taken) == sorted(im.digest for im in imgs)
    assert sorted(crops.held) == sorted(im.digest for im in imgs)
    stats = on.embeddings.cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (3, 3, 3)


def test_kv_hit_still_wins_and_is_labelled_kv(make_runtime, model, images):
    cfg = model.config
    rt = make_runtime(embedding_cache_bytes=8 * MIB)
    img = prepare_image(images["shapes_378"])
    got = _rounds(rt, cfg, [img], 2)
    assert [t for _, t, _ in got] == ["none", "kv"]
    assert rt.counters.encoder_runs == 1 and rt.counters.embedding_hits == 0


def test_salts_isolate_the_tier(make_runtime, model, images):
    cfg = model.config
    rt = make_runtime(kv_cache_pages=_pool_for_one_image(cfg), embedding_cache_bytes=8 * MIB)
    a, b = (prepare_image(images[n]) for n in ("shapes_378", "scene_800x600"))
    _rounds(rt, cfg, [a, b], 1, salt="tenant-1")
    assert rt.counters.encoder_runs == 2
    tiers = [t for _, t, _ in _rounds(rt, cfg, [a, b], 1, salt="tenant-2")]
    assert tiers == ["none", "none"] and rt.counters.encoder_runs == 4  # never shared
    assert not rt.embeddings.cached(a, None) and rt.embeddings.cached(a, "tenant-1")
    tiers = [t for _, t, _ in _rounds(rt, cfg, [a], 1, salt="tenant-1")]
    assert tiers == ["embedding"] and rt.counters.encoder_runs == 4


def test_budget_holds_under_many_images(make_runtime, model, images):
    cfg = model.config
    one = cfg.image_tokens * cfg.vision.proj_out_dim * 4  # float32 bytes of one embedding
    rt = make_runtime(kv_cache_pages=_pool_for_one_image(cfg), embedding_cache_bytes=2 * one)
    imgs = [prepare_image(images[n]) for n in sorted(images)]
    assert len(imgs) >= 3
    _rounds(rt, cfg, imgs, 2)
    s = rt.embeddings.cache.stats()
    assert s.bytes <= 2 * one and s.entries == 2 and s.evictions > 0
    # round-robin over more images than the tier holds: LRU never hits
    assert rt.counters.encoder_runs == 2 * len(imgs)


def test_default_budget_is_sized_from_the_pool(make_runtime, model):
    cfg = model.config
    pages = 6000
    rt = make_runtime(kv_cache_pages=pages)
    budget = rt.embeddings.cache.budget
    pool_bytes = pages * rt.kv.bytes_per_page(
        cfg.text.n_layers, cfg.text.n_kv_heads, cfg.text.head_dim, rt.dtype
    )
    assert 0 < budget <= pool_bytes // 4
    assert make_runtime(enable_prefix_cache=False).embeddings.cache is None
    assert make_runtime(embedding_cache_bytes=0).embeddings.cache is None


def test_engine_tier_metrics_and_crops(make_engine, images):
    engine = make_engine(kv_cache_pages=800, embedding_cache_mb=8)
    imgs = [engine.prepare_image(images[n]) for n in ("shapes_378", "scene_800x600")]
    crops = _CountingCrops(engine.runtime.crops)
    first = [engine.query(im, "What is this?", settings=GREEDY) for im in imgs]
    held = list(crops.held)
    again = [engine.query(im, "What is this?", settings=GREEDY) for im in imgs]
    assert [r.answer for r in again] == [r.answer for r in first]
    assert [r.metrics.cache_tier for r in first] == ["none", "none"]
    assert [r.metrics.cache_tier for r in again] == ["embedding", "embedding"]
    assert sorted(crops.taken) == sorted(im.digest for im in imgs)  # crops once per image
    assert set(held) == {im.digest for im in imgs} and crops.held == held  # not held again
    s = engine.stats()
    assert (s.embedding_hits, s.embedding_misses, s.vision_encodes) == (2, 2, 2)
    assert 0 < s.embedding_bytes <= s.embedding_budget_bytes == 8 * MIB
    assert s.embedding_entries == 2


@pytest.mark.parametrize("bad", [-1, "lots", True, float("nan"), float("inf"), 10**12])
def test_engine_refuses_hostile_budgets(bad):
    from kestrel import Engine

    with pytest.raises(InvalidInputError, match="embedding_cache_mb"):
        Engine(device="cpu", embedding_cache_mb=bad)


def test_engine_host_kv_tier_is_refused_on_cpu_with_the_reason():
    from kestrel import Engine

    with pytest.raises(InvalidInputError, match="already lives in host memory"):
        Engine(device="cpu", host_kv_gb=1)
    for bad in (-1, "x", True, 10**9):
        with pytest.raises(InvalidInputError, match="host_kv_gb"):
            Engine(device="cpu", host_kv_gb=bad)


def test_engine_host_kv_zero_is_off(make_engine):
    engine = make_engine(host_kv_gb=0)
    assert engine.runtime.prefix_cache.host is None
    s = engine.stats()
    assert (s.host_kv_hits, s.host_kv_bytes, s.host_kv_budget_bytes) == (0, 0, 0)


def test_one_batched_prefill_mixes_tier_hits_and_encodes(make_runtime, model, images):
    """A wave of three prompts: one image from the tier, the same image under another salt and
    a third image encoded; logits equal a cache-off runtime's, no pin outlives the prefill."""

    from tests.integration.test_runtime_cache import REL

    cfg = model.config
    pages = 3 * _pool_for_one_image(cfg) + 1
    rt = make_runtime(kv_cache_pages=pages, embedding_cache_bytes=8 * MIB)
    a, b, c, d = (prepare_image(images[n]) for n in sorted(images))
    prompt = query_prompt(cfg, [302, 333, 272, 271])
    _rounds(rt, cfg, [a], 1, salt="s1")
    _rounds(rt, cfg, [b, c, d], 1)  # a/s1's KV is evicted, its embedding stays
    runs = rt.counters.encoder_runs
    wave = [(a, "s1"), (a, "s2"), (c, "s2")]
    states = [rt.prepare_sequence(prompt, im, max_new_tokens=6, cache_salt=salt)
              for im, salt in wave]  # fmt: skip
    assert [s.reused_page_count for s in states] == [0, 0, 0]
    _hidden, logits = rt.prefill_sequences(states)
    assert rt.embeddings.cache.stats().pinned == 0
    for s, h in zip(states, _hidden, strict=True):
        rt.commit_sequence(s, h)
    assert [s.cache_tier for s in states] == ["embedding", "none", "none"]
    assert rt.counters.encoder_runs - runs == 2
    off = make_runtime(enable_prefix_cache=False)
    for (im, _), lg in zip(wave, logits, strict=True):
        s_off, lg_off = off.start_sequence(prompt, im, max_new_tokens=6)
        assert_close(lg, lg_off, rel=REL)
        off.release_sequence(s_off)
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()
