"""The cached runtime against the eager, uncached reference path (float32, within 1e-4 of
the logits' largest magnitude, tests/tolerance.py).

Every path a prompt can take through the cache (miss, partial hit, full-prompt hit) must give
the eager path's logits at every step and the same greedy tokens; so must adapters, spatial
references and point/detect, whose coordinates and sizes are fed back through decode_step.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream.lora import load_adapter
from kestrel.moondream.region import (
    coord_token,
    decode_coordinate,
    decode_size,
    size_token,
    spatial_ref_tokens,
)
from kestrel.moondream.sampling import suppress
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.reference.eager import EagerMoondream
from kestrel.runtime.sequence import cacheable_prefix
from kestrel.skills import prompts
from kestrel.skills.text import answer_suppressed_ids
from kestrel.tokens import TextToken
from tests.conftest import fixture_dir
from tests.tolerance import assert_close, relative_error

REL = 1e-4
STEPS = 6


@pytest.fixture(scope="module")
def tokenizer() -> MoondreamTokenizer:
    return MoondreamTokenizer.from_dir(fixture_dir())


@pytest.fixture(scope="module")
def eager(model, tokenizer) -> EagerMoondream:
    return EagerMoondream(model, tokenizer)


@pytest.fixture(scope="module")
def adapter(model):
    return load_adapter(fixture_dir() / "adapter" / "adapter.safetensors", model.config)


def run_query(rt, tokens, image, adapter=None):
    """Greedy answer through the runtime with the reference's masking; raw logits per step."""
    state, logits = rt.start_sequence(tokens, image, adapter=adapter, max_new_tokens=STEPS)
    banned = answer_suppressed_ids(rt.config.tokenizer)
    rows, ids = [logits], [int(logits.argmax())]
    for _ in range(STEPS - 1):
        logits = rt.decode_step([state], [TextToken(ids[-1])])[0]
        rows.append(logits)
        ids.append(int(suppress(logits[None], banned)[0].argmax()))
    reused = state.reused_page_count
    rt.release_sequence(state)
    return torch.stack(rows), ids, reused


def eager_query(eager, image, question, **kw):
    res = eager.query(image, question, max_tokens=STEPS, record=True, **kw)
    return res.phase.step_logits[:STEPS], list(res.token_ids)


CASES = [
    ("image", "shapes_378", "What color is the circle?", None),
    ("text-only", None, "Tell me about a red car.", None),
    ("spatial", "scene_800x600", "What is in this region?", [[0.25, 0.5], [0.1, 0.2, 0.6, 0.7]]),
]


@pytest.mark.parametrize(
    ("kind", "image_name", "question", "refs"), CASES, ids=[c[0] for c in CASES]
)
def test_query_parity_on_every_cache_path(
    make_runtime, model, eager, tokenizer, images, kind, image_name, question, refs
):
    cfg = model.config
    image = images[image_name] if image_name else None
    ref_logits, ref_ids = eager_query(eager, image, question, spatial_refs=refs)
    spatial = spatial_ref_tokens(refs or (), cfg.region)
    tokens = prompts.query_prompt(cfg.tokenizer, tokenizer.encode, question, spatial=spatial)
    # A sibling prompt that shares everything but the last question token.
    sibling = [*tokens[:-3], TextToken(tokens[-3].token_id ^ 1), *tokens[-2:]]
    rt = make_runtime()
    reused = []
    for toks in (sibling, tokens, tokens):  # prime a partial hit, then partial, then full
        logits, ids, r = run_query(rt, toks, image)
        reused.append(r)
        if toks is tokens:
            assert_close(logits, ref_logits, rel=REL)
            assert ids == ref_ids
    n_cacheable = cacheable_prefix(tokens, cfg.region.coord_bins, cfg.region.size_bins)
    image_kv = cfg.image_tokens if image is not None else 0
    if not refs:
        assert reused == [0, image_kv + len(tokens) - 3, image_kv + len(tokens) - 1]
    else:  # only the prefix before the first off-grid reference (the box here) is shared
        assert 1 + len(cfg.tokenizer.templates["query"]["prefix"]) < n_cacheable < len(tokens)
        assert reused == [0, image_kv + n_cacheable, image_kv + n_cacheable]
    rt.check_integrity()


def test_adapter_parity_and_namespaces(make_runtime, model, eager, tokenizer, images, adapter):
    cfg = model.config
    img = images["shapes_378"]
    question = "What color is the circle?"
    ref_logits, ref_ids = eager_query(eager, img, question, adapter=adapter)
    base_logits, _ = eager_query(eager, img, question)
    tokens = prompts.query_prompt(cfg.tokenizer, tokenizer.encode, question)
    rt = make_runtime()
    _, _, reused = run_query(rt, tokens, img)  # base model first
    assert reused == 0
    logits, ids, reused = run_query(rt, tokens, img, adapter)  # same prompt, other namespace
    assert reused == 0, "an adapter must never reuse base-model KV"
    assert_close(logits, ref_logits, rel=REL)
    assert ids == ref_ids
    assert relative_error(logits[0], base_logits[0]) > 1e-3  # the adapter changes the logits
    logits, ids, reused = run_query(rt, tokens, img, adapter)  # now it hits its own tree
    assert reused == len(tokens) + cfg.image_tokens - 1
    assert_close(logits, ref_logits, rel=REL)
    assert rt.prefix_cache.namespace_count == 2
    # A mixed batch: base and adapter rows decode together, each with its own weights.
    s_base, l_base = rt.start_sequence(tokens, img, max_new_tokens=2)
    s_lora, l_lora = rt.start_sequence(tokens, img, adapter=adapter, max_new_tokens=2)
    assert_close(l_lora, ref_logits[0], rel=REL)
    assert_close(l_base, base_logits[0], rel=REL)
    both = rt.decode_step([s_base, s_lora], [TextToken(ref_ids[0]), TextToken(ref_ids[0])])
    assert_close(both[1], ref_logits[1], rel=REL)
    rt.release_sequence(s_base)
    rt.release_sequence(s_lora)


def run_regions(rt, tokens, image, max_objects, with_size):
    """The reference's point/detect loop through the runtime (coord/size fed by decode_step)."""
    rc, rw = rt.config.region, rt.model.region
    state, logits = rt.start_sequence(tokens, image, max_new_tokens=3 * max_objects)
    bins, decisions = [], [int(logits.argmax())]
    while decisions[-1] != rt.config.tokenizer.eos_id and len(bins) < max_objects:
        xt = coord_token(int(decode_coordinate(state.last_hidden, rw).argmax()), rc)
        rt.decode_step([state], [xt])
        yt = coord_token(int(decode_coordinate(state.last_hidden, rw).argmax()), rc)
        logits = rt.decode_step([state], [yt])[0]
        obj = [xt.bin, yt.bin]
        if with_size:
            size_logits = decode_size(state.last_hidden, rw)
            wb, hb = (int(b) for b in size_logits.argmax(-1))
            logits = rt.decode_step([state], [size_token(wb, hb, rc)])[0]
            obj += [wb, hb]
        bins.append(tuple(obj))
        decisions.append(int(logits.argmax()))
    rt.release_sequence(state)
    return bins, decisions


@pytest.mark.parametrize("skill", ["point", "detect"])
def test_point_detect_parity(make_runtime, model, eager, tokenizer, images, skill):
    cfg = model.config
    img = images["scene_800x600"] if skill == "detect" else images["shapes_378"]
    obj = "square" if skill == "detect" else "circle"
    ref = getattr(eager, skill)(img, obj, max_objects=3)
    build = prompts.detect_prompt if skill == "detect" else prompts.point_prompt
    tokens = build(cfg.tokenizer, tokenizer.encode, obj)
    rt = make_runtime()
    for _ in range(2):  # miss, then full-prompt hit
        bins, decisions = run_regions(rt, tokens, img, 3, skill == "detect")
        if skill == "detect":
            expected = [(o.x_bin, o.y_bin, o.w_bin, o.h_bin) for o in ref.objects]
        else:
            expected = [(o.x_bin, o.y_bin) for o in ref.objects]
        assert bins == expected
        assert decisions == list(ref.decisions)
    rt.check_integrity()
