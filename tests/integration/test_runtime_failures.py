"""Failures inside start_sequence release the temporary lock and every page taken."""

from __future__ import annotations

import pytest

import kestrel.runtime.prefill as prefill_mod
import kestrel.runtime.runtime as runtime_mod
from tests.integration.conftest import text_tokens
from tests.integration.test_runtime_cache import conserved, query_prompt


class Injected(RuntimeError):
    pass


def _raise(*_a, **_k):
    raise Injected("injected failure")


POINTS = [
    ("page_table", "map_pages"),
    ("prefix_cache", "lock"),
    ("page_table", "allocate_pages"),
    ("runtime", "encode_image"),
    ("prefill", "text_forward"),
    ("module", "lm_head"),
    ("prefix_cache", "insert"),
    ("page_table", "row_pages"),
]


def _all_unlocked(rt) -> bool:
    pc = rt.prefix_cache
    return pc.reclaimable_page_count() == pc.total_cached_pages


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "partial-hit"])
@pytest.mark.parametrize(("owner", "attr"), POINTS, ids=[p[1] for p in POINTS])
def test_failure_releases_everything(make_runtime, model, images, monkeypatch, owner, attr, hit):
    cfg = model.config
    img = images["shapes_378"]
    rt = make_runtime()
    if hit:  # populate the image prefix so the request below maps + locks cached pages
        s, _ = rt.start_sequence(query_prompt(cfg, [302]), img, max_new_tokens=2)
        rt.release_sequence(s)
    cached_before = rt.prefix_cache.total_cached_pages
    free_before = rt.page_table.pages_available
    target = {"page_table": rt.page_table, "prefix_cache": rt.prefix_cache, "runtime": rt}
    with monkeypatch.context() as m:
        if owner in ("module", "prefill"):
            m.setattr(runtime_mod if owner == "module" else prefill_mod, attr, _raise)
        else:
            m.setattr(target[owner], attr, _raise)
        if attr == "encode_image" and hit:
            # A hit never runs the vision encoder, so there is nothing to fail.
            s, _ = rt.start_sequence(query_prompt(cfg, [302, 333, 272]), img, max_new_tokens=4)
            assert not s.vision_encoded
            rt.release_sequence(s)
            conserved(rt)
            return
        with pytest.raises(Injected):
            rt.start_sequence(query_prompt(cfg, [302, 333, 272]), img, max_new_tokens=4)
    assert rt.active_sequences == []
    assert _all_unlocked(rt)
    # A failure after the insert may leave the (valid) prompt cached, unlocked; nothing else.
    after = rt.page_table.pages_available + rt.prefix_cache.total_cached_pages
    assert after == free_before + cached_before
    assert rt.prefix_cache.total_cached_pages >= cached_before
    conserved(rt)
    # The runtime is still healthy: the same request now runs and is cached.
    s, _ = rt.start_sequence(query_prompt(cfg, [302, 333, 272]), img, max_new_tokens=4)
    # (after a miss that failed past its insert, the prompt is already cached and hits)
    assert s.reused_page_count > 0 or not hit
    rt.release_sequence(s)
    conserved(rt)


def test_no_free_batch_slot_leaks_nothing(make_runtime, model):
    bos = model.config.tokenizer.bos_id
    rt = make_runtime(max_batch_size=2)
    held = [rt.start_sequence(text_tokens([bos, 7, i]), max_new_tokens=2)[0] for i in (8, 9)]
    free = rt.page_table.pages_available
    with pytest.raises(RuntimeError):
        rt.start_sequence(text_tokens([bos, 7, 10]), max_new_tokens=2)
    assert rt.page_table.pages_available == free
    for s in held:
        rt.release_sequence(s)
    conserved(rt)


def test_pool_exhausted_by_locked_pages(make_runtime, model):
    """Allocation fails cleanly when every cached page is locked by running sequences."""
    bos = model.config.tokenizer.bos_id
    rt = make_runtime(kv_cache_pages=64, max_batch_size=4)
    a, _ = rt.start_sequence(text_tokens([bos, *range(20, 40)]), max_new_tokens=20)
    with pytest.raises(RuntimeError, match="locked"):
        rt.start_sequence(text_tokens([bos, *range(50, 70)]), max_new_tokens=20)
    assert len(rt.active_sequences) == 1
    conserved(rt)
    rt.release_sequence(a)
    s, _ = rt.start_sequence(text_tokens([bos, *range(50, 70)]), max_new_tokens=20)  # evicts a
    rt.release_sequence(s)
    conserved(rt)
