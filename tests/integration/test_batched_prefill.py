"""Batched prefill (``prefill_sequences``) equals one sequence at a time, on misses and hits."""

from __future__ import annotations

import random

import pytest
import torch

import kestrel.runtime.prefill as prefill_mod
from kestrel.runtime.prefill import MAX_PADDING, group_by_length
from tests.integration.conftest import GREEDY, assert_idle, scheduler_paused, text_tokens
from tests.integration.test_runtime_cache import conserved, query_prompt
from tests.tolerance import assert_close


def test_group_by_length_bounds_padding() -> None:
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.choice([1, 5, 17, 20, 200, 740, 760]) for _ in range(rng.randint(1, 12))]
        groups = group_by_length(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            padded = len(g) * max(lengths[i] for i in g)
            assert padded <= (1 + MAX_PADDING) * sum(lengths[i] for i in g)
    # a miss and the hits that follow it are not padded together; similar hits are
    assert group_by_length([750, 20, 18, 745, 19]) == [[0, 3], [1, 4, 2]]


def _requests(cfg, images):
    a, b = images["shapes_378"], images["tall_300x1000"]
    text = text_tokens([cfg.tokenizer.bos_id, 300, 301, 302, 303, 304])
    first = [(query_prompt(cfg, [302]), a), (text, None), (query_prompt(cfg, [305, 306]), b)]
    hits = [
        (query_prompt(cfg, [302, 333, 272]), a),  # hits a's image prefix (and its template)
        (query_prompt(cfg, [400]), a),
        (query_prompt(cfg, [401, 402, 403, 404, 405]), b),
    ]
    return first, hits


def _greedy(rt, states, logits_BV, steps: int) -> list[list[int]]:
    out = [[int(t)] for t in logits_BV.argmax(-1)]
    for _ in range(steps):
        tokens = text_tokens([o[-1] for o in out])
        logits_BV = rt.decode_step(states, tokens)
        for o, t in zip(out, logits_BV.argmax(-1), strict=True):
            o.append(int(t))
    return out


def _one_by_one(rt, requests):
    states, logits = [], []
    for tokens, image in requests:
        s, lg = rt.start_sequence(tokens, image, max_new_tokens=6)
        states.append(s)
        logits.append(lg)
    return states, torch.stack(logits)


def _batched(rt, requests):
    states = [rt.prepare_sequence(t, img, max_new_tokens=6) for t, img in requests]
    hidden_BC, logits_BV = rt.prefill_sequences(states)
    for s, h in zip(states, hidden_BC, strict=True):
        rt.commit_sequence(s, h)
    return states, logits_BV


@pytest.mark.parametrize("phase", ["misses", "misses-one-forward", "hits"])
def test_batched_prefill_matches_one_by_one(make_runtime, model, images, monkeypatch, phase):
    cfg = model.config
    if phase == "misses-one-forward":  # image and text rows padded together in one forward
        monkeypatch.setattr(prefill_mod, "group_by_length", lambda n: [list(range(len(n)))])
    first, hits = _requests(cfg, images)
    runs = {}
    for how, start in (("single", _one_by_one), ("batched", _batched)):
        rt = make_runtime()
        states, logits = start(rt, first)
        if phase == "hits":
            for s in states:
                rt.release_sequence(s)
            states, logits = start(rt, hits)
            assert all(s.reused_page_count > 0 and not s.vision_encoded for s in states[:2])
        conserved(rt)
        runs[how] = (logits, _greedy(rt, states, logits, 4))
        assert [s.length for s in states] == [s.prompt_length + 4 for s in states]
        for s in states:
            rt.release_sequence(s)
        conserved(rt)
    (single, single_tokens), (batched, batched_tokens) = runs["single"], runs["batched"]
    assert_close(batched, single, rel=0.0001)
    assert batched_tokens == single_tokens


def test_prefill_sequences_rejects_bad_input(make_runtime, model, images) -> None:
    cfg = model.config
    rt = make_runtime()
    s = rt.prepare_sequence(query_prompt(cfg, [302]), images["shapes_378"], max_new_tokens=2)
    with pytest.raises(ValueError, match="twice"):
        rt.prefill_sequences([s, s])
    hidden_BC, _ = rt.prefill_sequences([s])
    rt.commit_sequence(s, hidden_BC[0])
    with pytest.raises(ValueError, match="not prepared"):
        rt.prefill_sequences([s])  # running, no longer prepared
    rt.release_sequence(s)
    conserved(rt)


def test_engine_admits_a_wave_and_encodes_each_image_once(make_engine, images) -> None:
    """Questions about the same images submitted together: each image is encoded once (the
    other questions wait one wave and hit), and the answers equal those served one by one."""
    imgs = [images["shapes_378"], images["tall_300x1000"], images["scene_800x600"]]
    questions = ["what is this?", "how many?", "which colour?", "where is it?"]
    pairs = [(img, q) for q in questions for img in imgs]  # images interleaved
    alone = make_engine()
    expected = [alone.query(img, q, settings=GREEDY).answer for img, q in pairs]
    engine = make_engine()
    with scheduler_paused(engine):
        futures = [engine.submit_query(img, q, settings=GREEDY) for img, q in pairs]
    assert [f.result(timeout=120).answer for f in futures] == expected
    stats = engine.stats()
    assert stats.vision_encodes_skipped == len(pairs) - len(imgs)
    assert stats.requests_served == len(pairs)
    assert_idle(engine)
