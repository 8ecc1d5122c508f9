"""The cached runtime on the md2-tiny-a fixture model (float32, CPU): parity, sharing, ownership.

Seed test-plan items 8, 9, 12, 14, 15 with the real runtime, plus namespaces and concurrency.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.images import prepare_image
from kestrel.runtime.runtime import MoondreamRuntime, SequenceError
from kestrel.tokens import TextToken
from tests.integration.conftest import text_tokens
from tests.tolerance import assert_close

REL = 1e-4  # float32; cached and uncached paths differ only in reduction order


def query_prompt(cfg, q_ids) -> list[TextToken]:
    t = cfg.tokenizer
    prefix = t.templates["query"]["prefix"]
    return text_tokens([t.bos_id, *prefix, *q_ids, t.answer_id, t.answer_id])


def greedy(rt: MoondreamRuntime, state, logits: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        if len(out) == n:
            break
        logits = rt.decode_step([state], [TextToken(tok)])[0]
    return out


def conserved(rt: MoondreamRuntime) -> None:
    pt = rt.page_table
    private = sum(
        len(pt.page_table_cpu[s.batch_idx]) - s.cache_owned_page_count for s in rt.active_sequences
    )
    assert pt.pages_available + rt.prefix_cache.total_cached_pages + private == pt.n_pages - 1
    rt.check_integrity()


def test_full_prompt_match_computes_last_token_privately(make_runtime, model):
    """Seed item 8/10: skip = prompt_len - 1, logits valid, no write into shared pages."""
    rt = make_runtime()
    tokens = query_prompt(model.config, [300, 301, 302])
    s1, logits1 = rt.start_sequence(tokens, max_new_tokens=4)
    rt.release_sequence(s1)
    match = rt.prefix_cache.match_prefix(tokens)
    shared = list(match.matched_pages)
    k_before = [rt.kv.k[layer][shared].clone() for layer in range(len(rt.kv.k))]

    s2, logits2 = rt.start_sequence(tokens, max_new_tokens=4)
    assert s2.reused_page_count == len(tokens) - 1
    assert s2.cache_owned_page_count == len(tokens) - 1
    last = rt.page_table.get_pages(s2.batch_idx, len(tokens) - 1, len(tokens))[0]
    assert last not in shared
    assert logits2.shape == (model.config.text.vocab_size,)
    assert_close(logits2, logits1, rel=REL)
    greedy(rt, s2, logits2, 4)
    for layer in range(len(rt.kv.k)):
        assert torch.equal(rt.kv.k[layer][shared], k_before[layer]), "shared page written"
    free_before = rt.page_table.pages_available
    rt.release_sequence(s2)
    assert rt.page_table.pages_available == free_before + (s2.max_length - s2.reused_page_count)
    conserved(rt)


def test_logit_parity_miss_partial_full(make_runtime, model, images):
    """Seed item 12: cache off vs miss vs partial hit vs full hit, atol 1e-4, same greedy ids."""
    cfg = model.config
    img = images["shapes_378"]
    a = query_prompt(cfg, [302, 333, 272, 271, 349, 40])
    b = query_prompt(cfg, [302, 333, 272, 500, 501])  # shares the image + 3 question tokens
    off = make_runtime(enable_prefix_cache=False)
    ref = {}
    for name, toks in (("a", a), ("b", b)):
        s, lg = off.start_sequence(toks, img, max_new_tokens=6)
        ref[name] = (lg, greedy(off, s, lg, 6))
        off.release_sequence(s)
    assert off.prefix_cache.total_cached_pages == 0

    rt = make_runtime()
    s, lg = rt.start_sequence(a, img, max_new_tokens=6)  # miss
    assert s.reused_page_count == 0 and s.vision_encoded
    assert_close(lg, ref["a"][0], rel=REL)
    assert greedy(rt, s, lg, 6) == ref["a"][1]
    rt.release_sequence(s)

    s, lg = rt.start_sequence(b, img, max_new_tokens=6)  # partial hit: image + shared text
    assert s.reused_page_count == cfg.prefix_len + 3 + 3  # template prefix + 3 shared
    assert not s.vision_encoded
    assert_close(lg, ref["b"][0], rel=REL)
    assert greedy(rt, s, lg, 6) == ref["b"][1]
    rt.release_sequence(s)

    s, lg = rt.start_sequence(a, img, max_new_tokens=6)  # full-prompt hit
    assert s.reused_page_count == s.prompt_length - 1
    assert_close(lg, ref["a"][0], rel=REL)
    assert greedy(rt, s, lg, 6) == ref["a"][1]
    rt.release_sequence(s)
    assert rt.counters.vision_encodes == 1
    conserved(rt)


def test_shared_prefix_concurrent_decode(make_runtime, model, images):
    """Seed item 9: two rows map the same cached pages and decode into disjoint private pages,
    producing exactly what each produces alone."""
    cfg = model.config
    img = images["scene_800x600"]
    p1 = query_prompt(cfg, [443, 450, 624])
    p2 = query_prompt(cfg, [443, 450, 700, 701])
    alone = make_runtime(enable_prefix_cache=False)
    expected = []
    for p in (p1, p2):
        s, lg = alone.start_sequence(p, img, max_new_tokens=10)
        expected.append(greedy(alone, s, lg, 10))
        alone.release_sequence(s)

    rt = make_runtime()
    s1, l1 = rt.start_sequence(p1, img, max_new_tokens=10)
    s2, l2 = rt.start_sequence(p2, img, max_new_tokens=10)
    assert s2.reused_page_count >= cfg.prefix_len
    pt = rt.page_table
    assert pt.get_pages(s1.batch_idx, 0, cfg.prefix_len) == pt.get_pages(
        s2.batch_idx, 0, cfg.prefix_len
    )
    toks = [[int(l1.argmax())], [int(l2.argmax())]]
    for _ in range(9):
        logits = rt.decode_step([s1, s2], [TextToken(toks[0][-1]), TextToken(toks[1][-1])])
        for i in range(2):
            toks[i].append(int(logits[i].argmax()))
        conserved(rt)
    assert toks == expected
    d1 = pt.get_pages(s1.batch_idx, s1.prompt_length, s1.length)
    d2 = pt.get_pages(s2.batch_idx, s2.prompt_length, s2.length)
    assert len(d1) == len(d2) == 9 and set(d1).isdisjoint(d2)
    rt.release_sequence(s2)
    rt.release_sequence(s1)
    conserved(rt)


def test_text_only_system_prompt_sharing(make_runtime, model):
    cfg = model.config
    system = [400 + i for i in range(40)]
    rt = make_runtime()
    s, _ = rt.start_sequence(text_tokens([cfg.tokenizer.bos_id, *system, 10, 11]))
    rt.release_sequence(s)
    s, _ = rt.start_sequence(text_tokens([cfg.tokenizer.bos_id, *system, 12, 13, 14]))
    assert s.reused_page_count == 1 + len(system)
    assert s.cache_owned_page_count == s.prompt_length
    rt.release_sequence(s)
    conserved(rt)


def test_namespaces_never_share(make_runtime, model, images):
    cfg = model.config
    rt = make_runtime()
    tokens = query_prompt(cfg, [302, 333])
    s, _ = rt.start_sequence(tokens, images["shapes_378"], max_new_tokens=2)
    rt.release_sequence(s)
    # Another image, same text: separate tree, no reuse (BOS depends on the image).
    s, _ = rt.start_sequence(tokens, images["rgba_500x500"], max_new_tokens=2)
    assert s.reused_page_count == 0 and s.vision_encoded
    rt.release_sequence(s)
    # Text-only prompt with the same tokens: its own namespace.
    s, _ = rt.start_sequence(tokens, max_new_tokens=2)
    assert s.reused_page_count == 0
    rt.release_sequence(s)
    assert rt.prefix_cache.namespace_count == 3
    conserved(rt)


def test_page_conservation_many_sequences(make_runtime, model):
    """Seed items 14/15: after many hits/misses/full matches everything is accounted for."""
    rt = make_runtime(kv_cache_pages=400, max_batch_size=4)
    bos = model.config.tokenizer.bos_id
    total = rt.page_table.n_pages - 1
    for i in range(60):
        prompt = text_tokens([bos] + [20 + j for j in range(i % 10 + 1)])
        s, _ = rt.start_sequence(prompt, max_new_tokens=3)
        rt.release_sequence(s)
        assert rt.page_table.pages_available + rt.prefix_cache.total_cached_pages == total
    rt.check_integrity()
    rt.prefix_cache.evict(total)
    assert rt.page_table.pages_available == total


def test_errors_are_clear(make_runtime, model, images):
    from kestrel.errors import InvalidInputError
    from kestrel.runtime.sequence import SequenceError

    cfg = model.config
    rt = make_runtime()
    with pytest.raises(SequenceError, match="BOS"):
        rt.start_sequence(text_tokens([5, 6]))
    with pytest.raises(InvalidInputError, match="bad image"):
        rt.start_sequence(text_tokens([cfg.tokenizer.bos_id, 6]), b"not an image")
    rt.check_integrity()  # a bad image is refused before anything is taken
    with pytest.raises(SequenceError, match="context"):
        rt.start_sequence(text_tokens([cfg.tokenizer.bos_id, 6]), max_new_tokens=5000)
    with pytest.raises(SequenceError, match="at least one token after BOS"):
        rt.start_sequence(text_tokens([cfg.tokenizer.bos_id]), images["shapes_378"])
    s, _ = rt.start_sequence(text_tokens([cfg.tokenizer.bos_id, 6]), max_new_tokens=1)
    with pytest.raises(SequenceError, match="twice"):
        rt.decode_step([s, s], [TextToken(1), TextToken(1)])
    with pytest.raises(SequenceError, match="one token per sequence"):
        rt.decode_step([s], [])
    rt.decode_step([s], [TextToken(1)])
    with pytest.raises(SequenceError, match="max_new_tokens"):
        rt.decode_step([s], [TextToken(1)])
    rt.release_sequence(s)
    with pytest.raises(SequenceError, match="already released"):
        rt.release_sequence(s)
    with pytest.raises(SequenceError, match="not running"):
        rt.decode_step([s], [TextToken(1)])
    conserved(rt)


def test_from_pretrained_checkpoint_dir():
    from tests.conftest import fixture_dir

    rt = MoondreamRuntime.from_pretrained(fixture_dir(), kv_cache_pages=1500, max_batch_size=2)
    cfg = rt.config
    ids = rt.tokenizer.encode("Tell me about a red car.")
    s, logits = rt.start_sequence(query_prompt(cfg, ids), max_new_tokens=2)
    assert logits.shape == (cfg.text.vocab_size,) and torch.isfinite(logits).all()
    rt.release_sequence(s)
    rt.check_integrity()


def test_release_retains_the_decoded_tokens_under_the_prompt(make_runtime, model):
    """The fed tokens' KV becomes cache-owned at release; a prompt continuing through them
    hits, and its logits equal a cache-off runtime's prefill of the same ids."""
    rt, off = make_runtime(), make_runtime(enable_prefix_cache=False)
    tokens = query_prompt(model.config, [300, 301, 302])
    state, logits = rt.start_sequence(tokens, max_new_tokens=5)
    out = greedy(rt, state, logits, 5)  # feeds 4: the last sampled token is never fed
    assert [t.token_id for t in state.fed] == out[:4]
    rt.release_sequence(state)
    assert rt.counters.retained_tokens == 4 and state.lease.retained == 4
    assert state.cache_owned_page_count == len(tokens) + 4
    answer = text_tokens(out[:4])
    m = rt.prefix_cache.match_prefix([*tokens, *answer])
    assert m.matched_kv_length == len(tokens) + 4
    assert rt.prefix_cache.evictable_page_count() >= 4  # an unlocked leaf: evictable at once
    conserved(rt)
    follow = [*tokens, *answer, *text_tokens([303, 304])]
    s2, hit = rt.start_sequence(follow, max_new_tokens=1)
    s3, miss = off.start_sequence(follow, max_new_tokens=1)
    assert s2.reused_page_count == len(tokens) + 4 and s3.reused_page_count == 0
    assert_close(hit, miss, rel=REL)
    rt.release_sequence(s2)
    off.release_sequence(s3)
    conserved(rt)


def test_retention_stops_at_an_off_grid_coordinate_and_can_be_off(make_runtime, model):
    from kestrel.tokens import CoordToken

    bins = model.config.region.coord_bins
    fed = [TextToken(310), CoordToken(0.123456, 126), TextToken(311)]
    for retain, kept in ((True, 1), (False, 0)):
        rt = make_runtime(retain_decoded=retain)
        tokens = query_prompt(model.config, [305, 306])
        state, _ = rt.start_sequence(tokens, max_new_tokens=4)
        assert CoordToken(126 / bins, 126).pos != fed[1].pos  # off its bin's grid
        for tok in fed:
            rt.decode_step([state], [tok])
        rt.release_sequence(state)
        assert state.lease.retained == kept and rt.counters.retained_tokens == kept
        m = rt.prefix_cache.match_prefix([*tokens, *fed])
        assert m.matched_kv_length == len(tokens) + kept
        conserved(rt)


def test_check_integrity_catches_a_fed_record_out_of_step(make_runtime, model):
    rt = make_runtime()
    state, _ = rt.start_sequence(query_prompt(model.config, [307]), max_new_tokens=3)
    rt.decode_step([state], [TextToken(308)])
    rt.check_integrity()
    state.fed.append(TextToken(309))  # a token recorded whose KV was never written
    with pytest.raises(AssertionError, match="fed tokens"):
        rt.check_integrity()
    state.fed.pop()
    rt.release_sequence(state)


def _placed(cfg, img, *ids) -> list:
    """A prompt that places ``img`` itself after its text (as a later chat turn does)."""
    from kestrel.images import image_hash_int
    from kestrel.tokens import ImageToken

    token = ImageToken(image_hash_int(img.digest), cfg.image_tokens)
    return [*query_prompt(cfg, list(ids)), token]


@pytest.mark.parametrize("tier", [False, True], ids=["encoder", "embedding-tier"])
def test_a_full_hit_of_a_prompt_ending_in_an_image_recomputes_the_whole_block(
    make_runtime, model, images, tier
):
    """The full-prompt backoff steps back one cache token: a whole image block, never into
    it; its logits equal the miss's and a cache-off runtime's. The block's embedding comes
    from the vision encoder, or with the embedding tier from the tier."""
    rt = make_runtime(embedding_cache_bytes=None if tier else 0)
    off = make_runtime(enable_prefix_cache=False)
    cfg, img = model.config, prepare_image(images["shapes_378"])
    prompt = _placed(cfg, img, 320, 321)
    s1, miss = rt.start_sequence(prompt, (img,), max_new_tokens=2)
    assert s1.image_regions == [(len(prompt) - 1, len(prompt) - 1 + cfg.image_tokens)]
    rt.release_sequence(s1)
    s2, hit = rt.start_sequence(prompt, (img,), max_new_tokens=2)
    assert s2.reused_page_count == len(prompt) - 1
    assert (s2.vision_encoded, s2.embedding_hits) == ((False, 1) if tier else (True, 0))
    s3, ref = off.start_sequence(prompt, (img,), max_new_tokens=2)
    assert_close(hit, miss, rel=REL)
    assert_close(hit, ref, rel=REL)
    for rt_, s in ((rt, s2), (off, s3)):
        rt_.release_sequence(s)
    conserved(rt)


def test_two_images_in_one_prompt_each_attend_within_their_block(make_runtime, model, images):
    """A miss of a two-image prompt (two bidirectional blocks in one forward) equals building
    it in two steps (the second image a cache hit's suffix, its block alone), and namespace
    is the first image's; placed images must be the ones given."""
    rt, off = make_runtime(), make_runtime(enable_prefix_cache=False)
    cfg = model.config
    a, b = prepare_image(images["shapes_378"]), prepare_image(images["scene_800x600"])
    first = query_prompt(cfg, [330, 331])
    from kestrel.images import image_hash_int
    from kestrel.tokens import ImageToken

    both = [first[0], ImageToken(image_hash_int(a.digest), cfg.image_tokens), *first[1:]]
    both += _placed(cfg, b, 332)[1:]  # the second block's framing, its image last...
    both.append(TextToken(333))  # ...then one more token
    s, _ = rt.start_sequence(first, a, max_new_tokens=1)  # caches BOS + a + the first block
    rt.release_sequence(s)
    s1, hit = rt.start_sequence(both, (a, b), max_new_tokens=1)
    s2, miss = off.start_sequence(both, (a, b), max_new_tokens=1)
    n = cfg.image_tokens
    b_at = len(both) - 3 + n  # BOS, the first block, the second framing (all but 3 tokens)
    assert s2.image_regions == [(0, 1 + n), (b_at, b_at + n)]
    assert s1.reused_page_count == len(first) + n and s1.namespace == s.namespace
    assert_close(hit, miss, rel=REL)
    rt.release_sequence(s1)
    off.release_sequence(s2)
    with pytest.raises(SequenceError, match="not the 2 given"):
        rt.start_sequence(both, (b, a), max_new_tokens=1)
    with pytest.raises(SequenceError, match="places 2 images but 1"):
        rt.start_sequence(both, a, max_new_tokens=1)
    conserved(rt)
