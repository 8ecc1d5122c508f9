"""The static prefill the prefill graphs replay (``prefill_graphs.prefill_static``, run here
uncaptured) and the vision encoder by crop count (``vision_graphs``) give the eager path's
logits: misses with an image block, text-only prompts, hits of several rows padded into one
bucket; a prefill that fits no bucket runs eagerly."""

from __future__ import annotations

import torch

from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.prefill import prefill_item
from kestrel.runtime.prefill_graphs import PrefillGraphBuffers, PrefillGraphs, prefill_buckets
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.runtime.sequence import images_to_encode
from kestrel.runtime.vision_graphs import VisionGraphs
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from kestrel_kernels.backends import FLASH, TORCH
from tests.conftest import fixture_dir
from tests.integration.conftest import text_tokens
from tests.integration.test_batched_prefill import _batched, _requests
from tests.tolerance import assert_close
from tests.unit.test_fa_contract import RecordingBinding


def _static(rt, model, calls: list | None = None) -> tuple[PrefillGraphs, VisionGraphs]:
    """Uncaptured prefill and vision graphs on ``rt``; ``calls`` records the static steps run
    (("prefill", rows, tokens) and ("vision", crops))."""
    rt.prefill_graphs = PrefillGraphs(model, rt.kv, rt.page_table.page_table, max_batch_size=8,
                                      backend=TORCH, capture=False)  # fmt: skip
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
    hits = [s[:2] for s in shapes if not s[2]]
    assert (1, 16) in hits and (4, 64) in hits and (8, 16) not in hits
    misses = [s for s in shapes if s[2]]
    assert [(b, bound) for b, _t, _r, bound in misses] == [(1, 64), (1, None)]
    assert all(t > cfg.prefix_len and t % 64 == 0 for _b, t, _r, _c in misses)
    assert misses[0][1] >= cfg.prefix_len + 64  # a question of 64 positions fits the first
    batch = PrefillGraphBuffers.allocate((2, 16, False, None), cfg.text.dim, model.dtype, TORCH,
                                         torch.device("cpu"))  # fmt: skip
    m = batch.attention.views()  # padding rows until loaded: no position, one key on page 0
    assert (m.positions_BT == -1).all() and m.seqused_k.tolist() == m.seqused_q.tolist() == [1, 1]
    assert m.rows_B.tolist() == [0, 0] and m.regions.tolist() == [[0, 0], [0, 0]]
    assert batch.attention.backend is TORCH and batch.shape == (2, 16, False, None)


def test_a_prefill_that_fits_no_bucket_runs_eagerly(make_runtime, model, images) -> None:
    rt = make_runtime()
    prefill, _ = _static(rt, model)
    first, _ = _requests(model.config, images)
    states = [rt.prepare_sequence(t, img, max_new_tokens=4) for t, img in first]
    # three rows, one of them an image miss: no bucket holds a miss beside other rows
    found = rt.embeddings.batch(images_to_encode(states))
    with found, rt.crops.hold(found.to_encode):
        items = [prefill_item(s, model, model.dtype, rt._encode_images(s, found)) for s in states]
    assert prefill.run(items) is None
    for s in states:
        rt.abort_sequence(s)


class GarbagePadding(RecordingBinding):
    """The fa stand-in, but rows outside every sequence, and rows that see no key, come back
    NaN: what uninitialized memory may hold on a GPU. The static prefill asks for no zeroing
    of padding rows."""

    garbage = 0  # rows made NaN

    def __call__(self, q, k, v, *args, cu_seqlens_q=None, seqused_k=None, **kwargs):
        out, lse = super().__call__(q, k, v, *args, cu_seqlens_q=cu_seqlens_q,
                                    seqused_k=seqused_k, **kwargs)  # fmt: skip
        out, cu = out.clone(), cu_seqlens_q.tolist()
        out[cu[-1] :] = float("nan")  # rows in no sequence
        self.garbage += out.shape[0] - cu[-1]
        for s, keys in enumerate(seqused_k.tolist()):  # rows that see no key
            if keys == 0:
                out[cu[s] : cu[s + 1]] = float("nan")
                self.garbage += cu[s + 1] - cu[s]
        return out, lse


def test_static_prefill_on_the_fa_path_ignores_padding_rows(monkeypatch) -> None:
    model = MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.bfloat16)
    binding = GarbagePadding()
    monkeypatch.setattr(fa_backend, "probe", lambda device=None: fa_backend.FaProbe(True, "fake"))
    monkeypatch.setattr(fa_backend, "load_binding", lambda: binding)
    image = torch.randint(0, 256, (378, 378, 3), generator=torch.Generator().manual_seed(3),
                          dtype=torch.uint8).numpy()  # fmt: skip
    bos = TextToken(model.config.tokenizer.bos_id)
    prompts = [[bos, *(TextToken(300 + i) for i in range(n))] for n in (9, 6)]
    runs, calls = {}, []
    for how in ("eager", "static"):
        rt = MoondreamRuntime(model, kv_cache_pages=4000, max_batch_size=4,
                              attention_backend="fa")  # fmt: skip
        if how == "static":
            graphs = PrefillGraphs(
                model, rt.kv, rt.page_table.page_table, max_batch_size=4, backend=FLASH,
                capture=False,
            )  # fmt: skip
            step = graphs._step
            graphs._step = lambda b, step=step: calls.append(b.batch.shape) or step(b)
            rt.prefill_graphs = graphs
        out = []
        for tokens in prompts:  # a miss, then a hit of the same image
            state, logits = rt.start_sequence(tokens, image, max_new_tokens=2)
            out.append(logits.float())
            rt.release_sequence(state)
        runs[how] = out
    assert [s[2] for s in calls] == [True, False]  # the miss bucket, then a hit bucket
    assert binding.garbage > 0
    for got, want in zip(runs["static"], runs["eager"], strict=True):
        assert bool(torch.isfinite(got).all())
        # bf16 forwards through another attention plan: a few bf16 roundings of the logits' scale
        assert_close(got, want, rel=2e-2, dtype=torch.bfloat16)


def test_a_mixed_wave_is_split_over_buckets(make_runtime, model, images, monkeypatch) -> None:
    """Two image misses and a text prompt in one prefill fit no single bucket: each miss runs
    from a miss bucket, the text prompt from a hit bucket, a prompt too long for any bucket
    eagerly; the logits, in item order, are the eager path's."""
    first, _ = _requests(model.config, images)
    bos = model.config.tokenizer.bos_id
    long_text = (text_tokens([bos, *range(300, 400)]), None)  # 101 positions: no bucket
    wave = [first[0], first[1], long_text, first[2]]
    logits, calls = {}, []
    for how in ("eager", "static"):
        rt = make_runtime()
        if how == "static":
            _static(rt, model, calls)
        states, logits[how] = _batched(rt, wave)
        for s in states:
            rt.release_sequence(s)
    prefills = [c[1:] for c in calls if c[0] == "prefill"]
    assert sorted(prefills) == [(1, 16), (1, 832), (1, 832)], calls
    _close(logits["static"], logits["eager"])
