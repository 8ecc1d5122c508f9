"""The host KV tier through the whole runtime on CPU, with a stand-in for the pinned-memory
mover (plain tensor copies; events finish when the test says): an image whose KV was evicted
comes back from the tier with no vision encode, the same logits and the same greedy answer,
labelled ``host``; every invariant holds after each step. (A CPU device has no tier of its
own: its pool already is host memory. tests/gpu/test_tiers_gpu.py runs the real mover.)"""

from __future__ import annotations

import numpy as np
import torch

from kestrel.images import prepare_image
from kestrel.kv.storage import PagedKVCache
from kestrel.prefix_cache.host_tier import HostKVTier
from tests.integration.test_runtime_cache import REL, greedy, query_prompt
from tests.tolerance import assert_close
from tests.unit.test_host_tier import FakeEvents

MIB = 1 << 20


class TensorMover(FakeEvents):
    """Copies pages' K and V between the runtime's pool and host tensors, at once."""

    def __init__(self, kv: PagedKVCache) -> None:
        super().__init__()
        self.kv = kv
        self.bytes_per_page = kv.bytes_per_page(kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.dtype)

    def copy_out(self, pages):
        idx = torch.from_numpy(np.array(pages, dtype=np.int64))
        buf = torch.stack([torch.stack([side[layer][idx] for layer in range(self.kv.n_layers)])
                           for side in (self.kv.k, self.kv.v)])  # fmt: skip
        return buf, self._event()

    def copy_in(self, buffer, pages):
        idx = torch.from_numpy(np.array(pages, dtype=np.int64))
        for i, side in enumerate((self.kv.k, self.kv.v)):
            for layer in range(self.kv.n_layers):
                side[layer].index_copy_(0, idx, buffer[i, layer])
        return self._event()


def test_an_evicted_image_is_served_from_host_memory(make_runtime, model, images):
    cfg = model.config
    pages = cfg.prefix_len + 40  # one image prompt at a time
    rt = make_runtime(kv_cache_pages=pages, embedding_cache_bytes=0)
    mover = TensorMover(rt.kv)
    rt.prefix_cache.host = HostKVTier(64 * MIB, mover)
    a, b = (prepare_image(images[n]) for n in ("shapes_378", "scene_800x600"))
    prompt = query_prompt(cfg, [302, 333, 272, 271])
    q2 = query_prompt(cfg, [302, 333, 500])

    s, first_logits = rt.start_sequence(prompt, a, max_new_tokens=6)
    first = greedy(rt, s, first_logits, 6)
    rt.release_sequence(s)
    s, lg = rt.start_sequence(prompt, b, max_new_tokens=6)  # evicts a: spilled
    greedy(rt, s, lg, 6)
    rt.release_sequence(s)
    rt.check_integrity()
    host = rt.prefix_cache.host
    assert host.stats().spills >= 1 and host.stats().in_flight >= 1
    mover.finish_all()

    s, lg = rt.start_sequence(prompt, a, max_new_tokens=6)  # back from host memory
    assert s.cache_tier == "host" and s.host_pages >= cfg.prefix_len
    assert s.reused_page_count == s.prompt_length - 1  # a full hit, as if never evicted
    assert_close(lg, first_logits, rel=REL)
    assert greedy(rt, s, lg, 6) == first
    rt.check_integrity()
    rt.release_sequence(s)
    assert rt.counters.encoder_runs == 2  # a was encoded once

    s, lg = rt.start_sequence(q2, a, max_new_tokens=6)  # a partial hit on the restored KV
    assert s.cache_tier == "kv" and s.reused_page_count >= cfg.prefix_len
    off = make_runtime(enable_prefix_cache=False)
    s_off, lg_off = off.start_sequence(q2, a, max_new_tokens=6)
    assert_close(lg, lg_off, rel=REL)
    off.release_sequence(s_off)
    rt.release_sequence(s)
    mover.finish_all()
    host.poll()
    rt.check_integrity()
    assert rt.counters.encoder_runs == 2 and host.stats().hits >= 1
