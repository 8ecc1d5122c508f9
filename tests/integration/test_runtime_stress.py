"""A long randomized run: a thousand requests over a small page budget.

Mixed hits and misses (shared system prompts, repeated prompts, occasional images), decode of
random length, releases in random order, admission through can_reserve_with_eviction. At the end
(and periodically) pages are conserved and every invariant holds.
"""

from __future__ import annotations

import random

import pytest

from kestrel.tokens import TextToken
from tests.integration.conftest import text_tokens
from tests.integration.test_runtime_cache import conserved

# enough for hits, misses, images (2%), evictions and refused admissions to recur many times
N_REQUESTS = 1000


@pytest.mark.slow
def test_randomized_run_conserves_pages(make_runtime, model, images):
    cfg = model.config
    rng = random.Random(1234)
    bos = cfg.tokenizer.bos_id
    rt = make_runtime(kv_cache_pages=2400, max_batch_size=6)
    systems = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 60))] for _ in range(6)]
    imgs = [images["shapes_378"], images["tall_300x1000"]]
    running: list = []
    done = hits = step = 0
    while done < N_REQUESTS:
        step += 1
        if step % 97 == 0:
            conserved(rt)
        if running and (rng.random() < 0.35 or len(running) == rt.page_table.max_batch_size):
            s = running.pop(rng.randrange(len(running)))
            rt.release_sequence(s)
            done += 1
            continue
        image = imgs[rng.randrange(2)] if rng.random() < 0.02 else None
        body = list(systems[rng.randrange(len(systems))])
        body += [rng.randrange(10, 1000) for _ in range(rng.choice([0, 1, 3, 8]))]
        prompt = text_tokens([bos, *body] if body else [bos, 11])
        max_new = rng.randint(1, 12)
        need = len(prompt) + max_new + (cfg.image_tokens if image is not None else 0)
        if not rt.page_table.can_reserve_with_eviction(need):
            assert running, "an empty runtime must always admit a small request"
            rt.release_sequence(running.pop(rng.randrange(len(running))))
            done += 1
            continue
        s, _ = rt.start_sequence(prompt, image, max_new_tokens=max_new)
        hits += s.reused_page_count > 0
        running.append(s)
        steps = rng.randint(0, max_new)
        if steps:
            batch = [r for r in running if r.remaining > 0]
            tokens = [TextToken(rng.randrange(10, 1000)) for _ in batch]
            if batch:
                rt.decode_step(batch, tokens)
    for s in running:
        rt.release_sequence(s)
    conserved(rt)
    assert hits > N_REQUESTS // 3, "the workload should mostly hit"
    pc = rt.prefix_cache
    assert pc.reclaimable_page_count() == pc.total_cached_pages  # nothing left locked
    total = rt.page_table.n_pages - 1
    pc.evict(total)
    assert rt.page_table.pages_available == total
    assert pc.namespace_count == 0
