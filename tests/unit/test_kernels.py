"""kestrel_kernels: the torch backend against an independent dense float64 implementation.

Also: the segment decomposition the FlashAttention path relies on equals the explicit mask,
write_kv round-trips (padding slots skipped), input errors, and import cleanliness.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import kestrel_kernels as kk
from kestrel_kernels import torch_backend
from kestrel_kernels.backends import TORCH
from kestrel_kernels.segments import build_segment_plan
from kestrel_kernels.torch_backend import paged_attention_segmented
from tests.attention_args import with_meta
from tests.tolerance import assert_close as near

I32 = torch.int32


@dataclass(frozen=True)
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    seqused_k: torch.Tensor
    seqused_q: torch.Tensor | None
    regions: torch.Tensor | None


def make_case(
    seed: int,
    k_lens: list[int],
    q_lens: list[int] | None,
    *,
    q_len: int | None = None,
    hq: int = 4,
    hkv: int = 2,
    d: int = 16,
    regions: list | None = None,  # one (s, e) per row, or a list of them per row
    dtype: torch.dtype = torch.float32,
    share_prefix: int = 0,
) -> Case:
    """Random Q/K/V and a random page table (non-contiguous pages; rows may share a prefix)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(k_lens)
    max_pages = max(k_lens) + 3
    n_pages = sum(k_lens) + 8
    lq = q_len if q_len is not None else max(q_lens or [1])
    page_table = torch.zeros(batch, max_pages, dtype=I32)  # padding = page 0
    perm = (torch.randperm(n_pages - 1, generator=g) + 1).to(I32)
    used = 0
    for b, k in enumerate(k_lens):
        page_table[b, :k] = perm[used : used + k]
        used += k
        if b and share_prefix:
            shared = min(share_prefix, k, k_lens[0])
            page_table[b, :shared] = page_table[0, :shared]
    return Case(
        q=torch.randn(batch, lq, hq, d, generator=g).to(dtype),
        k_cache=torch.randn(n_pages, hkv, d, generator=g).to(dtype),
        v_cache=torch.randn(n_pages, hkv, d, generator=g).to(dtype),
        page_table=page_table,
        seqused_k=torch.tensor(k_lens, dtype=I32),
        seqused_q=None if q_lens is None else torch.tensor(q_lens, dtype=I32),
        regions=None if regions is None else torch.tensor(regions, dtype=I32),
    )


def naive_attention(c: Case, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Dense float64 attention, one query at a time, written from the masking rule."""
    batch, lq, hq, d = c.q.shape
    group = hq // c.k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, lq, hq, d, dtype=torch.float64)
    heads = torch.arange(hq) // group
    for b in range(batch):
        k_len = int(c.seqused_k[b])
        n_q = lq if c.seqused_q is None else int(c.seqused_q[b])
        pages = c.page_table[b, :k_len].long()
        keys, vals = c.k_cache[pages].double(), c.v_cache[pages].double()  # [K, Hkv, D]
        spans = [] if c.regions is None else c.regions[b].reshape(-1, 2).tolist()
        for i in range(n_q):
            p = k_len - n_q + i
            vis = [
                j
                for j in range(k_len)
                if not causal or j <= p or any(s <= p < e and s <= j < e for s, e in spans)
            ]
            kh = keys[vis][:, heads]  # [n, Hq, D]
            vh = vals[vis][:, heads]
            scores = torch.einsum("hd,nhd->hn", c.q[b, i].double(), kh) * scale
            w = torch.softmax(scores, dim=-1)
            out[b, i] = torch.einsum("hn,nhd->hd", w, vh)
    return out


def run(c: Case, causal: bool = True, **kw) -> torch.Tensor:
    meta = kk.AttentionMeta(c.page_table, c.seqused_k, c.seqused_q, c.regions, causal)
    return kk.paged_attention(c.q, c.k_cache, c.v_cache, meta, backend=TORCH, **kw)


def run_segmented(c: Case, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    d = c.q.shape[-1]
    meta = kk.AttentionMeta(c.page_table, c.seqused_k, c.seqused_q, c.regions, causal)
    return paged_attention_segmented(
        c.q, c.k_cache, c.v_cache, meta,
        softmax_scale=1.0 / math.sqrt(d) if scale is None else scale,
    )  # fmt: skip


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Attention outputs (|values| up to ~3) within ``rel`` of the reference's largest
    magnitude, and never below the dtype's rounding (tests/tolerance.py)."""
    near(out, ref, rel=rel, dtype=out.dtype)


# --- torch backend vs naive ----------------------------------------------------------------------

CASES = {
    "varlen": dict(k_lens=[7, 19, 3, 12], q_lens=[2, 5, 3, 1]),
    "full_prefill": dict(k_lens=[23], q_lens=None, q_len=23),
    "append": dict(k_lens=[30, 18], q_lens=[6, 9]),
    "decode": dict(k_lens=[5, 41, 17, 1, 33, 9], q_lens=None, q_len=1),
    "empty_row": dict(k_lens=[0, 9, 4], q_lens=[0, 3, 0]),
    "shared_pages": dict(k_lens=[20, 25, 14], q_lens=[4, 3, 2], share_prefix=12),
    "prefix_region_full": dict(k_lens=[24], q_lens=None, q_len=24, regions=[(0, 10)]),
    "region_not_at_0": dict(k_lens=[26, 21], q_lens=[26, 21], regions=[(5, 14), (3, 9)]),
    "region_crosses_chunk": dict(k_lens=[20, 20], q_lens=[8, 8], regions=[(10, 16), (14, 30)]),
    "region_before_chunk": dict(k_lens=[30, 16], q_lens=[5, 4], regions=[(0, 12), (2, 2)]),
    "region_after_all": dict(k_lens=[12], q_lens=[12], regions=[(12, 20)]),
    "decode_shared": dict(k_lens=[30, 28, 33, 31], q_lens=None, q_len=1, share_prefix=25),
    "shared_regions_padding": dict(
        k_lens=[40, 38, 42], q_lens=[5, 3, 0], regions=[(0, 20)] * 3, share_prefix=30
    ),
    "varlen_regions": dict(
        k_lens=[15, 31, 9, 22], q_lens=[15, 6, 2, 0], regions=[(0, 6), (20, 29), (9, 3), (1, 2)]
    ),
    # several regions per row (one per image of a multi-image prompt), unused ones (0, 0)
    "two_images_prefill": dict(
        k_lens=[30, 26], q_lens=[30, 26], regions=[[(0, 8), (14, 22)], [(3, 9), (0, 0)]]
    ),
    "three_regions_append": dict(
        k_lens=[40, 35, 12],
        q_lens=[25, 6, 12],
        regions=[
            [(0, 5), (10, 18), (30, 37)],
            [(0, 0), (0, 0), (28, 33)],
            [(2, 4), (4, 9), (0, 0)],
        ],
    ),
    "regions_and_shared_pages": dict(
        k_lens=[34, 30], q_lens=[20, 9], regions=[[(0, 9), (20, 28)]] * 2, share_prefix=18
    ),
}


@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_matches_naive(name: str, hkv: int) -> None:
    c = make_case(sum(map(ord, name)) + hkv, hkv=hkv, **CASES[name])
    assert_close(run(c), naive_attention(c))


@pytest.mark.parametrize("name", ["shared_pages", "decode_shared", "shared_regions_padding"])
def test_shared_page_path_runs_and_matches_naive(name: str, monkeypatch) -> None:
    """Rows sharing pages take the read-each-page-once path; rows that share nothing, or a row
    listing a page twice, take the per-row gather; every case matches the naive rule."""
    taken = []
    real = torch_backend._shared_page_attention

    def spy(*args, **kw):
        out = real(*args, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(torch_backend, "_shared_page_attention", spy)
    c = make_case(11, hkv=2, **CASES[name])
    assert_close(run(c), naive_attention(c))
    assert taken == [True]
    unshared = make_case(11, hkv=2, **{**CASES[name], "share_prefix": 0})
    assert_close(run(unshared), naive_attention(unshared))
    assert taken == [True, False]
    twice = c.page_table.clone()
    twice[1, 1] = twice[1, 0]  # the same page at two positions of one row
    dup = Case(**{**vars(c), "page_table": twice})
    assert_close(run(dup), naive_attention(dup))
    assert taken == [True, False, False]


@pytest.mark.parametrize("name", ["varlen", "append", "region_crosses_chunk", "decode"])
def test_non_causal_sees_every_key(name: str) -> None:
    c = make_case(7, **CASES[name])
    assert_close(run(c, causal=False), naive_attention(c, causal=False))


def test_custom_softmax_scale() -> None:
    c = make_case(3, **CASES["varlen_regions"])
    assert_close(run(c, softmax_scale=0.37), naive_attention(c, scale=0.37))
    assert (run(c, softmax_scale=0.37) - run(c)).abs().max() > 1e-3  # the scale is used


@pytest.mark.parametrize("name", ["varlen", "region_crosses_chunk", "decode"])
def test_bfloat16(name: str) -> None:
    c = make_case(11, dtype=torch.bfloat16, **CASES[name])
    out = run(c)
    assert out.dtype == torch.bfloat16
    assert_close(out, naive_attention(c), rel=1e-2)


def test_padding_rows_are_zero_and_real_rows_are_not() -> None:
    c = make_case(5, **CASES["varlen"])
    out = run(c)
    padded = 0
    for b, n in enumerate(c.seqused_q.tolist()):
        padded += out.shape[1] - n
        assert torch.count_nonzero(out[b, n:]) == 0
        assert out[b, :n].abs().amax(dim=(-1, -2)).min().item() > 0.0
    assert padded > 0


def test_all_rows_empty_gives_zeros() -> None:
    c = make_case(2, k_lens=[0, 0], q_lens=[0, 0], q_len=3)
    assert run(c).abs().max().item() == 0.0


def test_prefill_then_decode_agree_with_one_pass() -> None:
    """The last query of a full prefill equals a decode step over the same cache."""
    c = make_case(9, k_lens=[18], q_lens=None, q_len=18, regions=[(0, 7)])
    full = run(c)
    meta = kk.AttentionMeta(c.page_table, c.seqused_k, bidir_regions=c.regions)
    step = kk.paged_attention(c.q[:, -1:], c.k_cache, c.v_cache, meta, backend=TORCH)
    assert_close(step, full[:, -1:], rel=0.0)  # the dtype's rounding only


# --- the segment decomposition used by the fa backend ----------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_segment_decomposition_equals_mask(name: str, causal: bool) -> None:
    c = make_case(100 + len(name), hkv=1, **CASES[name])
    assert_close(run_segmented(c, causal=causal), run(c, causal=causal), rel=0.0)


@pytest.mark.parametrize("seed", range(12))
def test_segment_decomposition_random(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 5, (1,), generator=g))
    k_lens = torch.randint(0, 40, (batch,), generator=g).tolist()
    q_lens = [int(torch.randint(0, k + 1, (1,), generator=g)) for k in k_lens]
    regions = []
    n_regions = int(torch.randint(1, 4, (1,), generator=g))
    for k in k_lens:  # n_regions ordered, disjoint spans per row (some empty)
        row, s = [], 0
        for _ in range(n_regions):
            s += int(torch.randint(0, k // 2 + 3, (1,), generator=g))
            e = s + int(torch.randint(-3, 14, (1,), generator=g))
            row.append((s, e) if e > s else (0, 0))
            s = max(s, e)
        regions.append(row if n_regions > 1 else row[0])
    c = make_case(seed, k_lens, q_lens, q_len=max(q_lens) + 1, regions=regions, hq=4, hkv=2)
    ref = naive_attention(c)
    assert_close(run(c), ref)
    assert_close(run_segmented(c), ref)


def test_segment_plan_shape() -> None:
    k = torch.tensor([20, 9], dtype=I32)
    q_used = torch.tensor([8, 3], dtype=I32)
    regions = torch.tensor([[10, 16], [0, 0]], dtype=I32)
    plan = build_segment_plan(8, k, q_used, regions, causal=True)
    assert plan.segs_per_row == 4
    # row 0: queries at 12..19; 12..15 inside (10, 16); row 1: no region, all in the last
    # (causal) run; runs: before, inside, after, padding.
    assert plan.cu_seqlens_q.tolist() == [0, 0, 4, 8, 8, 8, 8, 11, 16]
    assert plan.causal_k.tolist() == [12, 0, 20, 0, 6, 0, 9, 0]
    assert plan.noncausal_k.tolist() == [0, 16, 0, 0, 0, 0, 0, 0]
    two = torch.tensor([[[0, 3], [10, 16]], [[0, 0], [0, 0]]], dtype=I32)
    plan = build_segment_plan(8, k, q_used, two, causal=True)
    # row 0: queries 12..19: (0, 3) lies before them, (10, 16) as above; 2 regions: 6 runs
    assert plan.segs_per_row == 6
    assert plan.cu_seqlens_q.tolist() == [0, 0, 0, 0, 4, 8, 8, 8, 8, 8, 8, 11, 16]
    assert plan.noncausal_k.tolist() == [0, 0, 0, 16, 0, 0] + [0] * 6
    simple = build_segment_plan(1, k, None, None, causal=True)
    assert simple.segs_per_row == 1 and simple.noncausal_k is None
    assert simple.cu_seqlens_q.tolist() == [0, 1, 2]


# --- write_kv ------------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_round_trip_with_padding_slots(slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(10, 2, 4, generator=g), torch.randn(10, 2, 4, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, -1, 3, 9, -1], dtype=slot_dtype)
    k, v = torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
    kk.write_kv(k_cache, v_cache, slots, k, v)
    for n, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s], k[n]) and torch.equal(v_cache[s], v[n])
    untouched = [p for p in range(10) if p not in {7, 3, 9}]  # page 0 included
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


def test_write_kv_then_attend() -> None:
    """Keys written through slot_mapping are what paged_attention reads through page_table."""
    c = make_case(4, k_lens=[9], q_lens=[3])
    pages = c.page_table[0, 6:9]
    new_k, new_v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kk.write_kv(c.k_cache, c.v_cache, pages, new_k, new_v)
    assert torch.equal(c.k_cache[pages.long()], new_k)
    assert_close(run(c), naive_attention(c))


def test_write_kv_empty_is_noop() -> None:
    k_cache = torch.randn(4, 1, 2)
    before = k_cache.clone()
    kk.write_kv(k_cache, k_cache.clone(), torch.empty(0, dtype=I32), *[torch.empty(0, 1, 2)] * 2)
    assert torch.equal(k_cache, before)


# --- errors and backend selection -------------------------------------------------------------


def _with(c: Case, **changes) -> dict:
    args = dict(
        q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, page_table=c.page_table,
        seqused_k=c.seqused_k, seqused_q=c.seqused_q, bidir_regions=c.regions,
    )  # fmt: skip
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: {"q": c.q[0]}, "q must be"),
        (lambda c: {"q": c.q.double()}, "float32/float16/bfloat16"),
        (lambda c: {"q": c.q.bfloat16()}, "dtypes differ"),
        (lambda c: {"q": c.q[..., :8]}, "head_dim differs"),
        (lambda c: {"q": torch.randn(2, 4, 3, 16)}, "multiple of Hkv"),
        (lambda c: {"v_cache": c.v_cache[:-1]}, "v_cache shape"),
        (lambda c: {"page_table": c.page_table.long()}, "page_table must be int32"),
        (lambda c: {"page_table": c.page_table[:1]}, "page_table must be"),
        (lambda c: {"seqused_k": c.seqused_k.long()}, "seqused_k must be int32"),
        (lambda c: {"seqused_q": c.seqused_q[:1]}, "seqused_q must have shape"),
        (lambda c: {"bidir_regions": torch.zeros(2, 3, dtype=I32)}, "bidir_regions must"),
        (lambda c: {"bidir_regions": torch.zeros(2, 2, 3, dtype=I32)}, "bidir_regions must"),
        (
            lambda c: {"bidir_regions": torch.tensor([[[4, 8], [2, 5]]] * 2, dtype=I32)},
            "in order and disjoint",
        ),
        (lambda c: {"seqused_q": torch.tensor([4, 2], dtype=I32)}, "only 3 keys"),
        (lambda c: {"seqused_k": torch.tensor([3, 99], dtype=I32)}, "outside [0, max_pages"),
        (lambda c: {"page_table": c.page_table + 1000}, "the cache has"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, message: str) -> None:
    c = make_case(0, k_lens=[3, 5], q_lens=[2, 2], q_len=4)
    with pytest.raises(kk.KernelInputError, match=message.replace("[", r"\[")):
        kk.paged_attention(backend=TORCH, **with_meta(_with(c, **change(c))))
    assert issubclass(kk.KernelInputError, ValueError)


def test_write_kv_bad_inputs() -> None:
    k_cache, v_cache = torch.zeros(5, 2, 4), torch.zeros(5, 2, 4)
    k = torch.zeros(2, 2, 4)
    with pytest.raises(kk.KernelInputError, match="beyond the cache"):
        kk.write_kv(k_cache, v_cache, torch.tensor([1, 5]), k, k)
    with pytest.raises(kk.KernelInputError, match="k must be"):
        kk.write_kv(k_cache, v_cache, torch.tensor([1, 2]), k[:, :1], k)
    with pytest.raises(kk.KernelInputError, match="slot_mapping must be"):
        kk.write_kv(k_cache, v_cache, torch.tensor([1.0, 2.0]), k, k)
    with pytest.raises(kk.KernelInputError, match="bfloat16"):
        kk.write_kv(k_cache, v_cache, torch.tensor([1, 2]), k.bfloat16(), k)


def test_backend_selection_on_cpu() -> None:
    assert kk.resolve_backend("auto", "cpu") is TORCH
    assert kk.resolve_backend("torch").name == "torch" and not TORCH.captures_decode
    assert kk.available_backends("cpu") == ["torch"]
    with pytest.raises(kk.BackendUnavailableError, match="needs a CUDA device"):
        kk.resolve_backend("fa", "cpu")
    with pytest.raises(kk.KernelInputError, match="unknown attention backend"):
        kk.resolve_backend("triton")
    c = make_case(1, **CASES["varlen"])
    with pytest.raises(kk.BackendUnavailableError, match="cannot run"):
        kk.paged_attention(**with_meta(_with(c)), backend=kk.resolve_backend("fa3"))


def test_default_backend_setting() -> None:
    c = make_case(1, **CASES["varlen"])
    try:
        kk.set_default_backend("fa")
        assert kk.get_default_backend() == "fa"
        with pytest.raises(kk.BackendUnavailableError):
            kk.paged_attention(**with_meta(_with(c)))
        kk.set_default_backend("torch")
        assert_close(kk.paged_attention(**with_meta(_with(c))), naive_attention(c))
        with pytest.raises(kk.KernelInputError):
            kk.set_default_backend("nope")
    finally:
        kk.set_default_backend("auto")


def test_import_does_not_pull_flash_attention() -> None:
    code = (
        "import sys, torch, kestrel_kernels as kk\n"
        "kk.resolve_backend(); kk.available_backends()\n"
        "q = torch.zeros(1, 1, 2, 8); kv = torch.zeros(3, 2, 8)\n"
        "pt = torch.ones(1, 2, dtype=torch.int32); sk = torch.ones(1, dtype=torch.int32)\n"
        "kk.paged_attention(q, kv, kv, kk.AttentionMeta(pt, sk))\n"
        "bad = [m for m in ('flash_attn', 'flash_attn_interface', 'flash_attn.cute')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU-machine situation
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "clean" in done.stdout
