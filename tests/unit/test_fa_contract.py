"""The ``fa`` backend's contract with flash-attn-4, checked on CPU (this file never skips).

``flash_attn.cute.flash_attn_varlen_func`` is replaced by a recording fake with the real
function's parameter names (flash-attn-4 4.0.0b36, so a misspelt keyword fails here too). The fake
records every call and computes its output with the torch model of the kernel
(``varlen_paged_attention_torch``), so the rest of the fa path -- the segment plan, the page-table
view, the output assembly -- runs for real. Each case checks the exact arguments: dtypes,
shapes, page-table contents, ``seqused_k``, ``cu_seqlens_q``, the causal flags, and that the fake's
outputs reproduce the torch backend; the last test runs the runtime on the fixture model with the
fake and compares its logits with the torch path's. This is what guards the GPU code on machines
without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import kestrel_kernels as kk
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import coord_token, size_token
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from kestrel_kernels.backends import FLASH, TORCH
from kestrel_kernels.segments import SINGLE_CALL_MAX_CAUSAL_ROWS, VarlenSeqs
from kestrel_kernels.torch_backend import varlen_paged_attention_torch
from tests.attention_args import with_meta
from tests.conftest import fixture_dir
from tests.tolerance import assert_close

I32, BF16 = torch.int32, torch.bfloat16
REL = 1e-2  # bf16 outputs of two summation orders: about one bf16 ulp of the largest value


@dataclass(frozen=True, slots=True)
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    softmax_scale: float
    causal: bool


class RecordingBinding:
    """Stands in for ``flash_attn_varlen_func``; its parameters mirror the real signature."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(
        self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
        max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
        gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
        window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
    ):  # fmt: skip
        # Only the paged path's arguments may be set; the rest keep the binding's defaults.
        assert qv is None and cu_seqlens_k is None and max_seqlen_k is None
        assert seqused_q is None and min_seqlen_k is None and gather_kv_indices is None
        assert page_table is not None and seqused_k is not None and cu_seqlens_q is not None
        self.calls.append(
            Call(q.clone(), k, v, cu_seqlens_q.clone(), max_seqlen_q, seqused_k.clone(),
                 page_table.clone(), softmax_scale, causal)
        )  # fmt: skip
        seqs = VarlenSeqs(1, seqused_k, cu_seqlens_q, max_seqlen_q, causal, softmax_scale)
        out = varlen_paged_attention_torch(q, k[:, 0], v[:, 0], page_table, seqs)
        return out, None  # (out, lse) like the real binding


@pytest.fixture
def fake(monkeypatch) -> RecordingBinding:
    binding = RecordingBinding()
    monkeypatch.setattr(fa_backend, "probe", lambda device=None: fa_backend.FaProbe(True, "fake"))
    monkeypatch.setattr(fa_backend, "load_binding", lambda: binding)
    monkeypatch.delenv("KESTREL_FA_PAGED", raising=False)
    monkeypatch.delenv("KESTREL_FA_SINGLE_CALL_ROWS", raising=False)
    return binding


def make_inputs(k_lens, q_len, q_lens=None, regions=None, hq=4, hkv=2, d=16, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch, max_pages, n_pages = len(k_lens), max(k_lens) + 2, sum(k_lens) + 6
    page_table = torch.zeros(batch, max_pages, dtype=I32)
    perm = (torch.randperm(n_pages - 1, generator=g) + 1).to(I32)
    used = 0
    for b, k in enumerate(k_lens):
        page_table[b, :k] = perm[used : used + k]
        used += k
    return dict(
        q=torch.randn(batch, q_len, hq, d, generator=g).to(BF16),
        k_cache=torch.randn(n_pages, hkv, d, generator=g).to(BF16),
        v_cache=torch.randn(n_pages, hkv, d, generator=g).to(BF16),
        page_table=page_table,
        seqused_k=torch.tensor(k_lens, dtype=I32),
        seqused_q=None if q_lens is None else torch.tensor(q_lens, dtype=I32),
        bidir_regions=None if regions is None else torch.tensor(regions, dtype=I32),
    )


def run_both(args: dict) -> torch.Tensor:
    out = kk.paged_attention(**with_meta(args), backend=FLASH)
    ref = kk.paged_attention(**with_meta(args), backend=TORCH)
    assert out.dtype == BF16 and out.shape == ref.shape
    assert_close(out, ref, rel=REL, msg="fa (fake kernel) vs torch backend")
    return out


def check_common(call: Call, args: dict, rows: int) -> None:
    """What every call shares: packed bf16 queries, the cache viewed with page_size 1, the scale."""
    batch, q_len, hq, d = args["q"].shape
    n_pages, hkv, _ = args["k_cache"].shape
    assert call.q.dtype == BF16 and tuple(call.q.shape) == (batch * q_len, hq, d)
    assert torch.equal(call.q, args["q"].reshape(-1, hq, d))  # a reshape: the same bits
    assert tuple(call.k.shape) == tuple(call.v.shape) == (n_pages, 1, hkv, d)
    assert call.k.data_ptr() == args["k_cache"].data_ptr(), "the cache must be a view, not a copy"
    assert call.v.data_ptr() == args["v_cache"].data_ptr()
    assert call.max_seqlen_q == q_len and call.softmax_scale == pytest.approx(1 / math.sqrt(d))
    for t in (call.cu_seqlens_q, call.seqused_k, call.page_table):
        assert t.dtype == I32
    want = args["page_table"].repeat_interleave(rows // batch, dim=0)
    assert torch.equal(call.page_table, want)  # integers
    assert call.seqused_k.shape == (rows,) and call.cu_seqlens_q.shape == (rows + 1,)


def ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t]


def test_decode_is_one_causal_call(fake) -> None:
    args = make_inputs([5, 9, 2], q_len=1)
    run_both(args)
    (call,) = fake.calls
    check_common(call, args, rows=3)
    assert call.causal is True
    assert ints(call.cu_seqlens_q) == [0, 1, 2, 3] and ints(call.seqused_k) == [5, 9, 2]


def test_append_is_one_causal_call_right_aligned(fake) -> None:
    args = make_inputs([10], q_len=4)  # 6 cached positions + 4 new ones
    run_both(args)
    (call,) = fake.calls
    check_common(call, args, rows=1)
    assert call.causal is True
    assert ints(call.cu_seqlens_q) == [0, 4] and ints(call.seqused_k) == [10]


def test_full_prefill_with_image_block_is_one_call(fake) -> None:
    args = make_inputs([12], q_len=12, regions=[(0, 5)])  # BOS + a 4-position "image"
    run_both(args)
    (call,) = fake.calls
    # sequences: the block (keys 0..4), one per text query (keys 0..p), then empty ones up
    # to the bound (12 queries outside the block at most) and the padding one
    check_common(call, args, rows=1 + 12 + 1)
    assert call.causal is False
    assert ints(call.cu_seqlens_q) == [0, *range(5, 13), *[12] * 6]
    assert ints(call.seqused_k) == [5, *range(6, 13), *[0] * 6]


def test_long_text_after_image_block_is_two_calls(fake) -> None:
    q_len = 5 + SINGLE_CALL_MAX_CAUSAL_ROWS + 1  # past the bound: one-row sequences would not pay
    args = make_inputs([q_len], q_len=q_len, regions=[(0, 5)])
    run_both(args)
    causal, noncausal = fake.calls
    for call in (causal, noncausal):
        check_common(call, args, rows=4)
        # segments per row: before the block, inside it, after it, padding
        assert ints(call.cu_seqlens_q) == [0, 0, 5, q_len, q_len]
    assert causal.causal is True and ints(causal.seqused_k) == [0, 0, q_len, 0]
    assert noncausal.causal is False and ints(noncausal.seqused_k) == [0, 5, 0, 0]


def test_varlen_batch_pads_with_empty_sequences(fake) -> None:
    args = make_inputs([7, 3], q_len=4, q_lens=[4, 2])
    out = run_both(args)
    (call,) = fake.calls
    check_common(call, args, rows=4)
    assert call.causal is True
    assert ints(call.cu_seqlens_q) == [0, 4, 4, 6, 8] and ints(call.seqused_k) == [7, 0, 3, 0]
    assert torch.count_nonzero(out[1, 2:]) == 0, "padding query rows must be zeros"


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_passes_kv_heads_unexpanded(fake, hkv: int) -> None:
    args = make_inputs([6, 11], q_len=3, q_lens=[3, 1], hq=4, hkv=hkv)
    run_both(args)
    (call,) = fake.calls
    check_common(call, args, rows=4)
    assert call.q.shape[1] == 4 and call.k.shape[2] == hkv


def test_one_plan_serves_every_layer_and_guards_its_metadata(fake, monkeypatch) -> None:
    """``plan_attention`` builds the segment plan once; every call given the plan reuses it
    (also under inference_mode, where tensors have no version counter), equals a call
    without a plan, and a plan made for another query length is refused (the plan carries its
    metadata: there is no other metadata to hand it)."""
    from kestrel_kernels import backends, segments

    builds = []
    original = segments.choose_segment_plan

    def counting(*a, **k):
        builds.append(1)
        return original(*a, **k)

    monkeypatch.setattr(backends, "choose_segment_plan", counting)
    args = with_meta(make_inputs([12, 9], q_len=12, q_lens=[12, 9], regions=[(0, 5), (0, 5)]))
    q, k, v = args["q"], args["k_cache"], args["v_cache"]
    with torch.inference_mode():
        plan = kk.plan_attention(args["meta"], 12, dtype=BF16, backend=FLASH)
        assert plan.backend is FLASH and len(builds) == 1
        outs = [kk.attend(q, k, v, plan) for _ in range(3)]
        assert len(builds) == 1, "calls with the plan must not rebuild it"
        alone = kk.paged_attention(**args, backend=FLASH)
        assert len(builds) == 2
    for out in outs:
        assert torch.equal(out, alone)
    with pytest.raises(kk.KernelInputError, match="the plan is for 12 queries per row"):
        kk.attend(q[:, :6], k, v, plan)


def test_missing_package_names_it(monkeypatch) -> None:
    with pytest.raises(kk.BackendUnavailableError, match="flash-attn-4"):
        kk.resolve_backend("fa", "cpu")

    def no_package():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(fa_backend, "load_binding", no_package)
    found = fa_backend._probe_cuda.__wrapped__(0)
    assert not found.ok and "pip install 'kestrel[gpu]'" in found.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    found = fa_backend._probe_cuda.__wrapped__(0)
    assert not found.ok and "compute capability 9.x" in found.reason


# --- the model on the fake ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_model() -> MoondreamModel:
    return MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=BF16)


def _generate(rt: MoondreamRuntime, prompts: list, image, steps: int) -> list[torch.Tensor]:
    """Prefill each prompt (same image: the second one hits), then decode them as one batch."""
    states, logits = [], []
    for tokens in prompts:
        state, row = rt.start_sequence(tokens, image, max_new_tokens=steps)
        states.append(state)
        logits.append(row)
    last = [int(row.argmax()) for row in logits]
    for _ in range(steps - 1):
        rows = rt.decode_step(states, [TextToken(t) for t in last])
        logits.extend(rows)
        last = [int(r.argmax()) for r in rows]
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()
    return logits


def test_runtime_logits_match_torch_path(fake, bf16_model) -> None:
    cfg = bf16_model.config
    g = torch.Generator().manual_seed(3)
    image = torch.randint(0, 256, (378, 378, 3), generator=g, dtype=torch.uint8).numpy()
    bos = TextToken(cfg.tokenizer.bos_id)
    prompts = [[bos, *(TextToken(int(i)) for i in torch.randint(10, 900, (n,), generator=g))]
               for n in (9, 6)]  # fmt: skip
    runs = {}
    for backend in ("torch", "fa"):
        rt = MoondreamRuntime(bf16_model, kv_cache_pages=4000, max_batch_size=4,
                              attention_backend=backend)  # fmt: skip
        fake.calls.clear()
        runs[backend] = _generate(rt, prompts, image, steps=4)
    n_layers, prefix = cfg.text.n_layers, cfg.prefix_len
    # miss: 1 call per layer (the image block and each text query one sequence: 1 + 9 + 1);
    # hit: 1 (causal); 3 decode steps: 1
    assert len(fake.calls) == n_layers * (1 + 1 + 3)
    miss = fake.calls[0]
    assert not miss.causal and len(miss.seqused_k) == 1 + 9 + 1
    assert ints(miss.seqused_k) == [prefix, *range(prefix + 1, prefix + 10), 0]
    hit = fake.calls[n_layers]
    assert hit.causal and ints(hit.seqused_k) == [prefix + 6] and ints(hit.cu_seqlens_q) == [0, 6]
    step = fake.calls[-1]
    assert ints(step.cu_seqlens_q) == [0, 1, 2] and ints(step.seqused_k) == [
        prefix + 9 + 3,
        prefix + 6 + 3,
    ]
    for got, want in zip(runs["fa"], runs["torch"], strict=True):
        assert_close(got.float(), want.float(), rel=0.05)


def test_static_decode_step_matches_eager() -> None:
    """The graph-capturable step (run uncaptured on CPU) equals the eager one, padding included.

    Three sequences use the 4-row bucket (one padding row), and one step feeds a coordinate and a
    size token through the override rows.
    """
    model = MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.float32)
    region = model.config.region
    g = torch.Generator().manual_seed(5)
    bos = TextToken(model.config.tokenizer.bos_id)
    prompts = [[bos, *(TextToken(int(i)) for i in torch.randint(10, 900, (n,), generator=g))]
               for n in (5, 8, 3)]  # fmt: skip
    feeds = [[TextToken(11), TextToken(12), TextToken(13)],
             [coord_token(300, region), TextToken(14), size_token(500, 600, region)],
             [TextToken(15), TextToken(16), TextToken(17)]]  # fmt: skip
    runs = []
    for static in (False, True):
        rt = MoondreamRuntime(
            model, kv_cache_pages=200, max_batch_size=4, attention_backend="torch"
        )
        if static:
            rt.decode_graphs = DecodeGraphs(
                model, rt.kv, rt.page_table.page_table, max_batch_size=4, backend=TORCH,
                capture=False,
            )  # fmt: skip
        states = [rt.start_sequence(p, max_new_tokens=4)[0] for p in prompts]
        free_before = rt.page_table.pages_available
        runs.append([rt.decode_step(states, f) for f in feeds])
        assert rt.page_table.pages_available == free_before
        assert torch.count_nonzero(rt.kv.k[0][0]) == 0, "padding rows must not write page 0"
        for s in states:
            rt.release_sequence(s)
        rt.check_integrity()
    for eager, static in zip(*runs, strict=True):
        assert_close(static, eager, rel=0.0001)


def test_padded_mixed_prefill_matches_torch_path(fake, bf16_model, monkeypatch) -> None:
    """One padded forward of an image miss (one call per layer: the single-call plan), a
    text-only prompt and a second image beside them (rows of different lengths, padding)."""
    import kestrel.runtime.prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "group_by_length", lambda n: [list(range(len(n)))])
    cfg = bf16_model.config
    g = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (378, 378, 3), generator=g, dtype=torch.uint8).numpy()
              for _ in range(2)]  # fmt: skip
    bos = TextToken(cfg.tokenizer.bos_id)
    texts = [[bos, *(TextToken(int(i)) for i in torch.randint(10, 900, (n,), generator=g))]
             for n in (7, 12, 3)]  # fmt: skip
    requests = [(texts[0], images[0]), (texts[1], None), (texts[2], images[1])]
    runs = {}
    for backend in ("torch", "fa"):
        rt = MoondreamRuntime(bf16_model, kv_cache_pages=4000, max_batch_size=4,
                              attention_backend=backend)  # fmt: skip
        fake.calls.clear()
        states = [rt.prepare_sequence(t, img, max_new_tokens=2) for t, img in requests]
        _hidden, runs[backend] = rt.prefill_sequences(states)
        for s in states:
            rt.abort_sequence(s)
    n_layers = cfg.text.n_layers
    assert len(fake.calls) == n_layers, "one padded forward, one attention call per layer"
    call = fake.calls[0]
    # per row: 1 region + up to 13 queries outside it (the text-only prompt: BOS + 12) + the
    # padding sequence; the image rows end on their last text query's keys
    assert not call.causal and len(call.seqused_k) == 3 * (1 + 13 + 1)
    prefix = cfg.prefix_len
    assert ints(call.seqused_k[:9]) == [*range(prefix, prefix + 8), 0]
    assert_close(runs["fa"].float(), runs["torch"].float(), rel=0.05)
