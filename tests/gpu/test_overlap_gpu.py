"""The vision encoder's captured graph replayed on a second stream while decode steps run on
the main one (``scripts/bench_overlap.py``): the same embedding as on the main stream, and the
rows decode as they would alone; skips without CUDA (tests/conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kestrel.moondream.config import MoondreamConfig
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.random_weights import random_model
from tests.scripts import on_path

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def overlap():
    with on_path():
        yield importlib.import_module("bench_overlap")


def _runtime(overlap) -> MoondreamRuntime:
    model = random_model(MoondreamConfig.from_dict(overlap.SMOKE), device="cuda",
                         dtype=torch.bfloat16)  # fmt: skip
    return MoondreamRuntime(model, max_batch_size=4, kv_cache_pages=4 * 1024)


def _after(overlap, rt: MoondreamRuntime, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last encode's output and the logits of one more step, after 2 encodes and 6 decode
    steps of 4 rows on one stream or two."""
    o = overlap.Overlap(rt, batch=4, steps=6)
    try:
        with torch.inference_mode():
            _, embedding = o.run(2, 6, streams)
            logits = rt.decode_step(o.states, o.feed).float()
        torch.cuda.synchronize()
        return embedding.clone(), logits
    finally:
        o.release()


def test_the_encoder_on_a_side_stream_beside_decode(overlap) -> None:
    rt = _runtime(overlap)
    assert rt.vision_graphs is not None  # the captured encoder is what runs beside decode
    want_embedding, want_logits = _after(overlap, rt, streams=1)
    embedding, logits = _after(overlap, rt, streams=2)
    assert torch.equal(embedding, want_embedding)
    # the same prompts fed the same tokens: the side stream's work changed nothing they read
    bound = 1e-3 * float(want_logits.abs().max())
    assert float((logits - want_logits).abs().max()) <= bound
    rt.check_integrity()
