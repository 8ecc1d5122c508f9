"""The runtime end to end on a CUDA GPU, in bfloat16, with the FlashAttention backend.

Two models: the md2-tiny-a fixture (loaded with the default dtype, which must be bf16 on CUDA)
and a Moondream-2-sized model with random bf16 weights made on the device. For each: fa vs torch
backend, a cache hit vs the uncached run, graph-captured vs eager decode, a decode step free of
host synchronisation, and the KV pool sized from free memory.

Tolerances: logits agree within 3% of the largest |logit| plus 0.05 (two bf16 computations with
different summation orders and matmul shapes; a wrong mask or position moves logits by tens of
percent). Greedy answers must be equal token for token, except that when the reference's top two
logits are within ``TIE`` of each other the step may pick either; the continuations after such a
step are not compared. Without CUDA everything skips (tests/conftest.py); without an sm90 GPU or
flash-attn-4 the fa tests skip with the probe's reason.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.random_weights import random_model
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from tests.conftest import fixture_dir
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

STEPS = 8
TIE = 0.15  # bf16 logits of the two backends differ by about this much at most


@pytest.fixture(scope="module")
def fa_ready() -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")


@pytest.fixture(scope="module", params=["md2-tiny-a", "md2-random"])
def model(request) -> MoondreamModel:
    if request.param == "md2-tiny-a":
        m = MoondreamModel.from_pretrained(fixture_dir(), device="cuda")
    else:
        m = random_model(MoondreamConfig(), device="cuda", dtype=torch.bfloat16, seed=0)
    yield m
    del m
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.asarray(Image.open(fixture_dir() / "images" / "shapes_378.png").convert("RGB"))


@pytest.fixture(scope="module")
def tokenizer() -> MoondreamTokenizer:
    return MoondreamTokenizer.from_dir(fixture_dir())


def prompt(model: MoondreamModel, tok: MoondreamTokenizer, question: str) -> list[TextToken]:
    """The query template, spelled out (ids of the fixture's tokenizer fit both vocabularies)."""
    t = model.config.tokenizer
    parts = t.templates["query"]
    ids = [t.bos_id, *parts["prefix"], *tok.encode(question), *parts["suffix"]]
    return [TextToken(int(i)) for i in ids]


@pytest.fixture
def runtimes(model):
    made: list[MoondreamRuntime] = []

    def make(**kw) -> MoondreamRuntime:
        kw.setdefault("kv_cache_pages", 12_000)
        kw.setdefault("max_batch_size", 8)
        rt = MoondreamRuntime(model, **kw)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.check_integrity()
    made.clear()
    gc.collect()
    torch.cuda.empty_cache()


def greedy(rt: MoondreamRuntime, tokens, image, steps: int = STEPS):
    state, logits = rt.start_sequence(tokens, image, max_new_tokens=steps)
    ids, rows = [], []
    for t in range(steps):
        rows.append(logits.float())
        ids.append(int(logits.argmax()))
        if t < steps - 1:
            logits = rt.decode_step([state], [TextToken(ids[-1])])[0]
    reused = state.reused_page_count
    rt.release_sequence(state)
    return ids, rows, reused


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs().max().item()
    bound = 0.03 * want.float().abs().max().item() + 0.05
    assert err <= bound, f"logits differ by {err:.3g} > {bound:.3g}"


def assert_same_answer(got: tuple, want: tuple) -> None:
    """Equal greedy tokens and close logits, up to the first near-tie of the reference."""
    got_ids, got_rows, _ = got
    want_ids, want_rows, _ = want
    for step, (a, b, row_a, row_b) in enumerate(
        zip(got_ids, want_ids, got_rows, want_rows, strict=True)
    ):
        assert_logits_close(row_a, row_b)
        if a != b:
            gap = (row_b[b] - row_b[a]).item()
            assert gap <= TIE, f"step {step}: {a} != {b} and the reference's gap is {gap:.3g}"
            return  # a near-tie: the continuations are not comparable


def test_default_dtype_on_cuda_is_bf16() -> None:
    m = MoondreamModel.from_pretrained(fixture_dir(), device="cuda")
    assert m.dtype == torch.bfloat16
    rt = MoondreamRuntime(m, kv_cache_pages=64, max_batch_size=2)
    assert rt.kv.k[0].dtype == torch.bfloat16


@pytest.mark.parametrize("with_image", [True, False], ids=["image", "text"])
def test_fa_answers_like_torch(fa_ready, runtimes, model, tokenizer, image, with_image) -> None:
    tokens = prompt(model, tokenizer, "What color is the circle?")
    img = image if with_image else None
    fa = greedy(runtimes(attention_backend="fa"), tokens, img)
    ref = greedy(runtimes(attention_backend="torch"), tokens, img)
    assert_same_answer(fa, ref)


def test_cache_hit_matches_uncached(fa_ready, runtimes, model, tokenizer, image) -> None:
    first = prompt(model, tokenizer, "What shape is on the left?")
    second = prompt(model, tokenizer, "What color is the circle?")
    rt = runtimes(attention_backend="fa")
    greedy(rt, first, image)  # miss: caches BOS + image + the shared template prefix
    partial = greedy(rt, second, image)
    full = greedy(rt, second, image)
    uncached = greedy(runtimes(attention_backend="fa", enable_prefix_cache=False), second, image)
    assert partial[2] >= model.config.prefix_len  # BOS + image + the template prefix
    assert full[2] == model.config.image_tokens + len(second) - 1  # all but the last position
    assert_same_answer(partial, uncached)
    assert_same_answer(full, uncached)


def test_graph_decode_matches_eager(fa_ready, runtimes, model, tokenizer, image) -> None:
    questions = ["What color is the circle?", "Describe the picture.", "How many shapes?"]
    feeds = [[TextToken(100 + 7 * s + i) for i in range(3)] for s in range(STEPS)]
    logits = {}
    for graphs in (True, False):
        rt = runtimes(attention_backend="fa", cuda_graphs=graphs)
        states = [rt.start_sequence(prompt(model, tokenizer, q), image if i != 1 else None,
                                    max_new_tokens=STEPS)[0]
                  for i, q in enumerate(questions)]  # fmt: skip
        logits[graphs] = [rt.decode_step(states, feed) for feed in feeds]
        for s in states:
            rt.release_sequence(s)
        assert rt.decode_graphs is not None
        if graphs:
            assert rt.decode_graphs.captured == (1, 2, 4, 8)  # every bucket to 8, at start-up
            assert rt.decode_graphs.replays == STEPS
    for g, e in zip(logits[True], logits[False], strict=True):
        assert_close(g, e, rel=0.01)


def test_decode_step_does_not_sync(fa_ready, runtimes, model, tokenizer, image) -> None:
    rt = runtimes(attention_backend="fa")
    states = [rt.start_sequence(prompt(model, tokenizer, q), image, max_new_tokens=4)[0]
              for q in ("What is this?", "Is it red?")]  # fmt: skip
    rt.decode_step(states, [TextToken(5), TextToken(6)])  # captured at start-up: a replay
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(3):
            rt.decode_step(states, [TextToken(7 + t), TextToken(9 + t)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s in states:
        rt.release_sequence(s)


def test_kv_pool_sized_from_free_memory(runtimes, model) -> None:
    fraction = 0.05
    rt = runtimes(kv_cache_pages=None, kv_memory_fraction=fraction, max_batch_size=4)
    report = rt.kv_report
    assert report is not None and report.pages == rt.kv.n_pages
    assert report.bytes_per_page == rt.kv.bytes // rt.kv.n_pages
    if not report.capped:
        sized = report.kv_bytes + report.carved_pages * report.bytes_per_page  # KV + tier
        assert sized <= fraction * report.free_bytes
        assert sized >= fraction * report.free_bytes - report.warmup_peak_bytes - (
            report.bytes_per_page
        )
    assert report.warmup_peak_bytes > 0 and "GiB" in str(report)
    print(report)
