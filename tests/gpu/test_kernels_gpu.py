"""kestrel_kernels on CUDA: fa vs torch (bf16) and torch-on-CUDA vs torch-on-CPU (float32).

Every case of the contract (full prefill, prefill with the image block, append, a region crossing
the query chunk, decode, varlen) runs with and without GQA, causal and not, on random inputs.
Tolerances (tests/tolerance.py, scaled to the reference's largest magnitude): fa vs torch in
bfloat16 within 4 bf16 epsilons (both round the output to bf16 and accumulate in different
orders); torch on CUDA vs CPU in float32 within 3e-5. Run with ``pytest -m gpu tests/gpu``;
without CUDA every test skips with a reason, and
the fa tests also skip (with the probe's reason) without an sm90 GPU or flash-attn-4.
"""

from __future__ import annotations

import pytest
import torch

import kestrel_kernels as kk
from kestrel_kernels import fa_backend
from kestrel_kernels.backends import FLASH, TORCH
from tests.attention_args import with_meta
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

I32 = torch.int32

# (k_lens, q_lens, q_len, regions): prefill, append, decode, varlen and bidirectional shapes,
# with the Moondream-like prefix region (0, 730) scaled down and a region crossing the chunk.
CASES = {
    "full_prefill": ([200], None, 200, None),
    "prefix_region": ([260], None, 260, [(0, 131)]),
    "append": ([300, 180], [40, 25], 40, None),
    "append_region_cached": ([300, 180], [40, 25], 40, [(0, 131), (0, 131)]),
    "region_crosses_chunk": ([160, 150], [48, 30], 48, [(120, 170), (100, 140)]),
    "decode": ([131, 400, 7, 1000], None, 1, [(0, 131)] * 4),
    "varlen": ([90, 333, 12, 64], [17, 1, 12, 0], 17, None),
}


def make_case(name: str, hq: int, hkv: int, dtype: torch.dtype, device: str, d: int = 64):
    k_lens, q_lens, q_len, regions = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 31 + hq + hkv)
    batch, max_pages = len(k_lens), max(k_lens) + 5
    n_pages = sum(k_lens) + 16
    page_table = torch.zeros(batch, max_pages, dtype=I32)
    perm = (torch.randperm(n_pages - 1, generator=g) + 1).to(I32)
    used = 0
    for b, k in enumerate(k_lens):
        page_table[b, :k] = perm[used : used + k]
        used += k
    args = dict(
        q=torch.randn(batch, q_len, hq, d, generator=g),
        k_cache=torch.randn(n_pages, hkv, d, generator=g),
        v_cache=torch.randn(n_pages, hkv, d, generator=g),
        page_table=page_table,
        seqused_k=torch.tensor(k_lens, dtype=I32),
        seqused_q=None if q_lens is None else torch.tensor(q_lens, dtype=I32),
        bidir_regions=None if regions is None else torch.tensor(regions, dtype=I32),
    )
    out = {}
    for key, t in args.items():
        if t is None:
            out[key] = None
            continue
        t = t.to(device)
        out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


@pytest.fixture(scope="module")
def fa_ready() -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")


def assert_fa_matches(args: dict, causal: bool) -> None:
    args = with_meta({**args, "causal": causal})
    ref = kk.paged_attention(**args, backend=TORCH)
    out = kk.paged_attention(**args, backend=FLASH)
    torch.cuda.synchronize()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert_close(out, ref, rel=1e-2, msg="fa vs torch")


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fa_matches_torch_on_cuda(fa_ready, name: str, hq: int, hkv: int, causal: bool) -> None:
    assert_fa_matches(make_case(name, hq, hkv, torch.bfloat16, "cuda"), causal)


@pytest.mark.parametrize("name", ["decode", "varlen", "prefix_region"])
def test_fa_gather_fallback_matches_torch(fa_ready, monkeypatch, name: str) -> None:
    monkeypatch.setenv("KESTREL_FA_PAGED", "0")
    assert_fa_matches(make_case(name, 4, 4, torch.bfloat16, "cuda"), True)


def test_fa_moondream_shapes(fa_ready) -> None:
    """Moondream 2's own attention: 32 heads of 64, the (0, 730) block, a 760-token prompt."""
    args = make_case("full_prefill", 32, 32, torch.bfloat16, "cuda")
    k_len = 760
    g = torch.Generator(device="cuda").manual_seed(0)
    n_pages = k_len + 8
    args.update(
        q=torch.randn(1, k_len, 32, 64, generator=g, device="cuda").bfloat16(),
        k_cache=torch.randn(n_pages, 32, 64, generator=g, device="cuda").bfloat16(),
        v_cache=torch.randn(n_pages, 32, 64, generator=g, device="cuda").bfloat16(),
        page_table=(torch.randperm(n_pages - 1, device="cuda")[:k_len] + 1).int()[None],
        seqused_k=torch.tensor([k_len], dtype=I32, device="cuda"),
        bidir_regions=torch.tensor([[0, 730]], dtype=I32, device="cuda"),
    )
    assert_fa_matches(args, True)


def test_auto_picks_fa_on_hopper(fa_ready) -> None:
    assert kk.resolve_backend("auto", "cuda") is FLASH
    assert "fa" in kk.available_backends("cuda")


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_cuda_matches_cpu(name: str) -> None:
    cpu = make_case(name, 4, 2, torch.float32, "cpu")
    gpu = make_case(name, 4, 2, torch.float32, "cuda")
    ref = kk.paged_attention(**with_meta(cpu), backend=TORCH)
    out = kk.paged_attention(**with_meta(gpu), backend=TORCH).cpu()
    assert_close(out, ref, rel=3e-5, msg="torch CUDA vs CPU")


def test_write_kv_on_cuda_skips_padding() -> None:
    k_cache = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    before_k = k_cache.clone()
    slots = torch.tensor([3, -1, 9, -1], dtype=I32, device="cuda")
    k = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kk.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[3], k[0]) and torch.equal(v_cache[9], v[2])
    rest = [p for p in range(16) if p not in (3, 9)]
    assert torch.equal(k_cache[rest], before_k[rest])


def test_fa_single_call_plan_matches_torch(fa_ready) -> None:
    """The one-call plan (``plan_attention(causal_rows=)``) on Moondream 2's heads: an image miss
    with a 20-token question, a hit of 9 text positions (no block) and a row with two images and
    text between them, padded into one forward."""
    k_lens, q_lens, q_len = [750, 770, 300], [750, 9, 300], 750
    regions = [[(0, 730), (0, 0)], [(0, 0), (0, 0)], [(0, 131), (140, 271)]]
    bound = 9 + 29  # the two-image row: 9 text queries between its images and 29 after them
    g = torch.Generator(device="cuda").manual_seed(1)
    n_pages = sum(k_lens) + 8
    page_table = torch.zeros(3, max(k_lens) + 4, dtype=I32, device="cuda")
    perm = torch.randperm(n_pages - 1, device="cuda", generator=g).int() + 1
    used = 0
    for b, k in enumerate(k_lens):
        page_table[b, :k] = perm[used : used + k]
        used += k
    meta = dict(
        page_table=page_table,
        seqused_k=torch.tensor(k_lens, dtype=I32, device="cuda"),
        seqused_q=torch.tensor(q_lens, dtype=I32, device="cuda"),
        bidir_regions=torch.tensor(regions, dtype=I32, device="cuda"),
    )
    args = dict(
        q=torch.randn(3, q_len, 32, 64, generator=g, device="cuda").bfloat16(),
        k_cache=torch.randn(n_pages, 32, 64, generator=g, device="cuda").bfloat16(),
        v_cache=torch.randn(n_pages, 32, 64, generator=g, device="cuda").bfloat16(),
        **meta,
    )
    plan = kk.plan_attention(kk.AttentionMeta(**meta), q_len, backend=FLASH, causal_rows=bound)
    assert plan.segments is not None and plan.segments.causal_k is None, "one call per layer"
    ref = kk.paged_attention(**with_meta(args), backend=TORCH)
    out = kk.attend(args["q"], args["k_cache"], args["v_cache"], plan)
    torch.cuda.synchronize()
    assert_close(out, ref, rel=1e-2, msg="fa single-call plan vs torch")
