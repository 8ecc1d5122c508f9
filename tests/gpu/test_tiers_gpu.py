"""The cache tiers on a CUDA GPU: the pinned host KV tier's copies (exact round trips, bf16 and
FP8 pages), an evicted image's KV coming back from host memory with the same greedy answer and
no vision encode, and the image-embedding tier on the device. Without CUDA everything skips
(tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.images import prepare_image
from kestrel.kv.storage import PagedKVCache
from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.host_kv import PinnedKVMover
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales
from tests.conftest import fixture_dir

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, KV_FP8_DTYPE], ids=["bf16", "fp8"])
def test_pinned_mover_round_trip_is_exact(dtype):
    scales = [KvScales(torch.tensor([0.02]), torch.tensor([0.03])) for _ in range(3)]
    fp8 = dtype == KV_FP8_DTYPE
    kv = PagedKVCache(64, 3, 2, 16, dtype, "cuda", kv_scales=scales if fp8 else None)
    for side in (kv.k, kv.v):
        for t in side:
            t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
    src = np.array([5, 9, 10, 33], dtype=np.int32)
    raw = [t.view(torch.uint8) for t in (*kv.k, *kv.v)]  # 1-byte floats: index as bytes
    before = [r[torch.from_numpy(src).long().cuda()].clone() for r in raw]
    mover = PinnedKVMover(kv)
    buffer, event = mover.copy_out(src)
    assert buffer.is_pinned() and buffer.numel() * buffer.element_size() == 4 * mover.bytes_per_page
    for r in raw:  # the pages are reused at once: queued after the copy out
        r[torch.from_numpy(src).long().cuda()] = 0
    mover.wait(event)
    dst = np.array([40, 41, 50, 2], dtype=np.int32)
    done = mover.copy_in(buffer, dst)
    mover.wait(done)
    assert mover.done(done)
    after = [r[torch.from_numpy(dst).long().cuda()] for r in raw]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    return MoondreamModel.from_pretrained(fixture_dir(), device="cuda")


def _images() -> list:
    d = fixture_dir() / "images"
    return [prepare_image(np.asarray(Image.open(d / f"{n}.png").convert("RGB")))
            for n in ("shapes_378", "scene_800x600")]  # fmt: skip


def _ask(rt: MoondreamRuntime, image, n: int = 6):
    cfg = rt.config
    t = cfg.tokenizer
    ids = [t.bos_id, *t.templates["query"]["prefix"], 302, 333, 272, t.answer_id, t.answer_id]
    state, logits = rt.start_sequence([TextToken(i) for i in ids], image, max_new_tokens=n)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        if len(out) == n:
            break
        logits = rt.decode_step([state], [TextToken(out[-1])])[0]
    tier = (state.cache_tier, state.host_pages)
    rt.release_sequence(state)
    rt.check_integrity()
    return out, tier


def test_evicted_image_comes_back_from_host_memory(model):
    cfg = model.config
    pages = cfg.prefix_len + 40  # one image prompt at a time
    rt = MoondreamRuntime(model, kv_cache_pages=pages, max_batch_size=2,
                          embedding_cache_bytes=0, host_kv_bytes=256 * MIB)  # fmt: skip
    a, b = _images()
    first, _ = _ask(rt, a)
    _ask(rt, b)  # evicts a: spilled to host memory
    host = rt.prefix_cache.host
    host.drain()
    assert host.stats().spills >= 1
    again, (tier, restored) = _ask(rt, a)
    assert tier == "host" and restored >= cfg.prefix_len
    assert again == first
    assert rt.counters.encoder_runs == 2  # a was not encoded again
    host.drain()
    host.check_integrity()


def test_embedding_tier_on_the_device(model):
    cfg = model.config
    rt = MoondreamRuntime(model, kv_cache_pages=cfg.prefix_len + 40, max_batch_size=2,
                          embedding_cache_bytes=64 * MIB)  # fmt: skip
    a, b = _images()
    first, _ = _ask(rt, a)
    _ask(rt, b)
    again, (tier, _) = _ask(rt, a)
    assert tier == "embedding" and again == first and rt.counters.encoder_runs == 2
