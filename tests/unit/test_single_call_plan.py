"""The single-call segment plan: one non-causal varlen call for image blocks plus short text.

``segments.build_single_call_plan`` keeps each bidirectional region's queries as one sequence
and turns every other query into a one-row sequence whose key count is its position + 1. Run on
the torch model of FlashAttention's varlen kernel, it must equal the torch backend's masked
reference for every shape a batched prefill produces: a miss beside a hit, padding rows, several
images with text between them, a region whose first positions are cached. The launch counter
pins the point of the plan: one attention launch per layer, no merge.
"""

from __future__ import annotations

import math

import pytest
import torch

import kestrel_kernels as kk
from kestrel_kernels import contract, fa_backend
from kestrel_kernels.backends import FLASH, TORCH
from kestrel_kernels.counting import LaunchCounter, opaque
from kestrel_kernels.segments import (
    SINGLE_CALL_MAX_CAUSAL_ROWS,
    VarlenSeqs,
    build_single_call_plan,
    choose_segment_plan,
)
from kestrel_kernels.torch_backend import paged_attention_segmented, varlen_paged_attention_torch
from tests.attention_args import with_meta
from tests.tolerance import assert_close

I32 = torch.int32


def make_args(k_lens, q_lens, q_len, regions, *, hq=4, hkv=2, d=16, seed=0) -> dict:
    """Random float32 inputs; ``regions``: one list of ``(start, end)`` per row."""
    g = torch.Generator().manual_seed(seed)
    batch, max_pages, n_pages = len(k_lens), max(k_lens) + 3, sum(k_lens) + 8
    page_table = torch.zeros(batch, max_pages, dtype=I32)
    perm = (torch.randperm(n_pages - 1, generator=g) + 1).to(I32)
    used = 0
    for b, k in enumerate(k_lens):
        page_table[b, :k] = perm[used : used + k]
        used += k
    return dict(
        q=torch.randn(batch, q_len, hq, d, generator=g),
        k_cache=torch.randn(n_pages, hkv, d, generator=g),
        v_cache=torch.randn(n_pages, hkv, d, generator=g),
        page_table=page_table,
        seqused_k=torch.tensor(k_lens, dtype=I32),
        seqused_q=None if q_lens is None else torch.tensor(q_lens, dtype=I32),
        bidir_regions=torch.tensor(regions, dtype=I32),
    )


def causal_rows(k_lens, q_lens, q_len, regions) -> int:
    """The host's count (as ``runtime.prefill`` makes it): queries outside every region."""
    most = 0
    for b, k in enumerate(k_lens):
        n = q_len if q_lens is None else q_lens[b]
        inside = sum(max(0, min(e, k) - max(s, k - n)) for s, e in regions[b])
        most = max(most, n - inside)
    return most


def single_call(args: dict, bound: int) -> torch.Tensor:
    plan = build_single_call_plan(
        args["q"].shape[1], args["seqused_k"], args["seqused_q"], args["bidir_regions"], bound
    )
    assert plan.causal_k is None and plan.noncausal_k is not None, "one non-causal call"
    d = args["q"].shape[-1]
    return paged_attention_segmented(**with_meta(args), softmax_scale=1 / math.sqrt(d),
                                     segments=plan)  # fmt: skip


def assert_matches_reference(args: dict, bound: int) -> torch.Tensor:
    out = single_call(args, bound)
    ref = kk.paged_attention(**with_meta(args), backend=TORCH)
    assert out.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    err = (out - ref).abs().max().item()
    assert err <= 1e-5 * scale, f"single-call plan vs masked reference: max abs error {err:.3g}"
    return out


# (k_lens, q_lens, q_len, regions per row)
CASES = {
    # a miss (BOS + 12-position image, then 6 text) beside a hit of 4 text positions: padding
    "miss_beside_hit": ([19, 23], [19, 4], 19, [[(0, 13)], [(0, 0)]]),
    "full_miss_no_padding": ([17], None, 17, [[(0, 13)]]),
    # two images with text between them and after them, and a row with one image
    "two_images": ([30, 16], [30, 16], 30, [[(0, 9), (14, 22)], [(0, 9), (0, 0)]]),
    # a hit whose first computed positions lie inside a partly cached image block
    "region_partly_cached": ([20, 12], [8, 3], 8, [[(5, 15)], [(0, 10)]]),
    # text before the image (no BOS in the block) and an empty row
    "text_before_image": ([14, 6], [14, 0], 14, [[(3, 10)], [(0, 4)]]),
    "decode_row": ([9, 31], None, 1, [[(0, 5)], [(0, 13)]]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("hkv", [1, 2])
def test_single_call_equals_masked_reference(name: str, hkv: int) -> None:
    k_lens, q_lens, q_len, regions = CASES[name]
    args = make_args(k_lens, q_lens, q_len, regions, hkv=hkv, seed=len(name))
    out = assert_matches_reference(args, causal_rows(k_lens, q_lens, q_len, regions))
    if q_lens is not None:
        for b, n in enumerate(q_lens):
            assert torch.count_nonzero(out[b, n:]) == 0, "padding query rows must be zeros"


@pytest.mark.parametrize("seed", range(8))
def test_single_call_random_batches(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 4, (1,), generator=g))
    k_lens = torch.randint(1, 40, (batch,), generator=g).tolist()
    q_lens = [int(torch.randint(0, k + 1, (1,), generator=g)) for k in k_lens]
    regions = []
    for k in k_lens:  # two ordered, disjoint spans per row (some empty)
        row, s = [], 0
        for _ in range(2):
            s += int(torch.randint(0, k // 2 + 2, (1,), generator=g))
            e = s + int(torch.randint(-2, 14, (1,), generator=g))
            row.append((s, e) if e > s else (0, 0))
            s = max(s, e)
        regions.append(row)
    q_len = max(q_lens) + 1
    args = make_args(k_lens, q_lens, q_len, regions, seed=seed)
    bound = causal_rows(k_lens, q_lens, q_len, regions)
    assert_matches_reference(args, bound)
    assert_matches_reference(args, bound + 3)  # a loose bound only adds empty sequences


def test_single_call_plan_layout() -> None:
    k = torch.tensor([20, 9], dtype=I32)
    q_used = torch.tensor([8, 3], dtype=I32)
    regions = torch.tensor([[10, 16], [0, 0]], dtype=I32)
    plan = build_single_call_plan(8, k, q_used, regions, causal_rows=4)
    assert plan.segs_per_row == 1 + 4 + 1
    # row 0: queries at 12..19, 12..15 inside (10, 16): one sequence seeing keys 0..15, then
    # one row each for positions 16..19; row 1: three rows at 6..8, then the padding rows
    assert plan.cu_seqlens_q.tolist() == [0, 4, 5, 6, 7, 8, 8, 9, 10, 11, 11, 11, 16]
    assert plan.noncausal_k.tolist() == [16, 17, 18, 19, 20, 0, 7, 8, 9, 0, 0, 0]
    assert plan.noncausal_k.dtype == I32 and plan.cu_seqlens_q.dtype == I32
    assert plan.inside_BL is None and plan.valid_BL[1].tolist() == [True] * 3 + [False] * 5


def test_too_small_bound_is_refused_on_cpu() -> None:
    k = torch.tensor([20], dtype=I32)
    regions = torch.tensor([[0, 14]], dtype=I32)
    with pytest.raises(kk.KernelInputError, match="causal_rows=5"):
        build_single_call_plan(20, k, None, regions, causal_rows=5)  # 6 queries outside
    assert build_single_call_plan(20, k, None, regions, causal_rows=6).segs_per_row == 8


def test_choice_between_the_two_forms(monkeypatch) -> None:
    monkeypatch.delenv("KESTREL_FA_SINGLE_CALL_ROWS", raising=False)
    k, q_len = torch.tensor([760], dtype=I32), 760
    regions = torch.tensor([[0, 730]], dtype=I32)
    miss = choose_segment_plan(q_len, k, None, regions, True, causal_rows=30)
    assert miss.causal_k is None and miss.segs_per_row == 1 + 30 + 1
    many = SINGLE_CALL_MAX_CAUSAL_ROWS + 1
    long_text = choose_segment_plan(q_len, k, None, regions, True, causal_rows=many)
    assert long_text.causal_k is not None and long_text.noncausal_k is not None
    unknown = choose_segment_plan(q_len, k, None, regions, True)  # bound = q_len: two calls
    assert unknown.causal_k is not None
    short = choose_segment_plan(12, torch.tensor([12], dtype=I32), None, regions, True)
    assert short.causal_k is None, "12 queries bound themselves"
    assert choose_segment_plan(q_len, k, None, None, True).noncausal_k is None
    assert choose_segment_plan(q_len, k, None, regions, False, 3).causal_k is None


def test_environment_sets_the_bound(monkeypatch) -> None:
    k, regions = torch.tensor([20], dtype=I32), torch.tensor([[0, 14]], dtype=I32)
    monkeypatch.setenv("KESTREL_FA_SINGLE_CALL_ROWS", "0")  # always the two-call plan
    assert choose_segment_plan(20, k, None, regions, True, 6).causal_k is not None
    monkeypatch.setenv("KESTREL_FA_SINGLE_CALL_ROWS", "6")
    assert choose_segment_plan(20, k, None, regions, True, 6).causal_k is None
    assert choose_segment_plan(20, k, None, regions, True, 7).causal_k is not None
    monkeypatch.setenv("KESTREL_FA_SINGLE_CALL_ROWS", "many")
    with pytest.raises(kk.KernelInputError, match="KESTREL_FA_SINGLE_CALL_ROWS"):
        choose_segment_plan(20, k, None, regions, True, 6)


def counting_binding(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table,
                     softmax_scale, causal, **unused):  # fmt: skip
    """FlashAttention's varlen call on its torch model, counted as the one launch it is."""
    with opaque("flash_attn"):
        seqs = VarlenSeqs(1, seqused_k, cu_seqlens_q, max_seqlen_q, causal, softmax_scale)
        out = varlen_paged_attention_torch(q, k[:, 0], v[:, 0], page_table, seqs)
    return out, None


def test_one_launch_per_layer(monkeypatch) -> None:
    """A miss prefill's layer is one attention launch (the two-call plan: three)."""
    monkeypatch.setattr(fa_backend, "probe", lambda device=None: fa_backend.FaProbe(True, "fake"))
    monkeypatch.setattr(fa_backend, "load_binding", lambda: counting_binding)
    monkeypatch.setattr(contract, "_check_values", lambda *a, **k: None)  # CPU-only host reads
    monkeypatch.setattr(contract, "_check_regions", lambda *a, **k: None)
    monkeypatch.delenv("KESTREL_FA_PAGED", raising=False)
    monkeypatch.delenv("KESTREL_FA_SINGLE_CALL_ROWS", raising=False)
    layers, per_layer = 3, {}
    # BOS + image then 20 text positions (one call), or then 67 (past the bound: two calls)
    for image_end in (60, 13):
        args = make_args([80], None, 80, [[(0, image_end)]], hq=4, hkv=4)
        args.update(q=args["q"].bfloat16(), k_cache=args["k_cache"].bfloat16(),
                    v_cache=args["v_cache"].bfloat16())  # fmt: skip
        meta = with_meta(args)["meta"]
        q, k, v = args["q"], args["k_cache"], args["v_cache"]
        with LaunchCounter() as c:
            plan = kk.plan_attention(meta, 80, causal_rows=80 - image_end, backend=FLASH)
            planned = c.launches
            outs = [kk.attend(q, k, v, plan) for _ in range(layers)]
        assert c.syncs == 0, "planning and attention must not read the device"
        per_layer[image_end] = (c.launches - planned) / layers
        assert c.by_op["flash_attn"] == layers * (1 if image_end == 60 else 2)
        ref = kk.paged_attention(**with_meta(args), backend=TORCH)
        assert_close(outs[0], ref, rel=1e-2)  # bf16: a few ulps of the largest output
    assert per_layer == {60: 1, 13: 3}
