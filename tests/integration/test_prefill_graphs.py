"""The static prefill the prefill graphs replay (``prefill_graphs.prefill_static``, run here
uncaptured) and the vision encoder by crop count (``vision_graphs``) give the eager path's
logits: misses with an image block, text-only prompts, hits of several rows padded into one
bucket; a prefill that fits no bucket runs eagerly."""

from __future__ import annotations

import torch

from kestrel.runtime.prefill import prefill_item
from kestrel.runtime.prefill_graphs import ForwardBatch, PrefillGraphs, prefill_buckets
from kestrel.runtime.vision_graphs import VisionGraphs
from tests.integration.test_batched_prefill import _batched, _requests


def _static(rt, model, calls: list | None = None) -> tuple[PrefillGraphs, VisionGraphs]:
    """Uncaptured prefill and vision graphs on ``rt``; ``calls`` records the static steps run
    (("prefill", rows, tokens) and ("vision", crops))."""
    rt.prefill_graphs = PrefillGraphs(model, rt.kv, rt.page_table.page_table, max_batch_size=8,
                                      backend="torch", capture=False)  # fmt: skip
    rt.vision_graphs = VisionGraphs(model, capture=False)
    if calls is not None:
        step, encoder = rt.prefill_graphs._step, rt.vision_graphs._encoder
        rt.prefill_graphs._step = lambda b: (
            calls.append(("prefill", b.batch.B, b.batch.T)) or step(b)
        )
        rt.vision_graphs._encoder = lambda p: calls.append(("vision", p.shape[0])) or encoder(p)
    return rt.prefill_graphs, rt.vision_graphs


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_static_prefill_and_vision_equal_eager(make_runtime, model, images) -> None:
    first, hits = _requests(model.config, images)
    logits, calls = {}, []
    for how in ("eager", "static"):
        rt = make_runtime()
        graphs = _static(rt, model, calls) if how == "static" else None
        states, first_BV = _batched(rt, first[:1])  # a miss: image block + question
        states2, text_BV = _batched(rt, first[1:2])  # text only
        hit_states, hits_BV = _batched(rt, [hits[0], hits[1]])  # two hits, padded together
        logits[how] = (first_BV, text_BV, hits_BV)
        if graphs is not None:
            prefill, vision = graphs
            assert prefill.replays == 0 and vision.replays == 0  # uncaptured: the static step
        for s in states + states2 + hit_states:
            rt.release_sequence(s)
    kinds = [c[:2] for c in calls]
    assert kinds == [("vision", 2), ("prefill", 1), ("prefill", 1), ("prefill", 2)], calls
    for got, want in zip(logits["static"], logits["eager"], strict=True):
        _close(got, want)


def test_buckets_and_what_fits(model) -> None:
    cfg = model.config
    shapes = prefill_buckets(cfg.prefix_len, cfg.text.max_context, 4)
    assert (1, 16, False) in shapes and (4, 64, False) in shapes and (8, 16, False) not in shapes
    misses = [t for b, t, r in shapes if r]
    assert misses and all(t > cfg.prefix_len and t % 64 == 0 for t in misses)
    batch = ForwardBatch.allocate(2, 16, False, cfg.text.dim, model.dtype, torch.device("cpu"))
    positions, seqused_k, seqused_q, rows, regions = batch.fields()
    assert (positions == -1).all() and seqused_k.tolist() == seqused_q.tolist() == [1, 1]
    assert rows.tolist() == [0, 0] and regions.tolist() == [[0, 0], [0, 0]]


def test_a_prefill_that_fits_no_bucket_runs_eagerly(make_runtime, model, images) -> None:
    rt = make_runtime()
    prefill, _ = _static(rt, model)
    first, _ = _requests(model.config, images)
    states = [rt.prepare_sequence(t, img, max_new_tokens=4) for t, img in first]
    # three rows, one of them an image miss: no bucket holds a miss beside other rows
    items = [prefill_item(s, model, model.dtype, rt._encode_images(s)) for s in states]
    assert prefill.run(items) is None
    for s in states:
        rt.abort_sequence(s)
