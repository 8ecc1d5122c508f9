"""The Triton decode kernel (``kestrel_kernels.triton_decode``) on a CUDA device: against the
torch reference and FlashAttention's decode at Moondream's shapes (32 heads of 64; Moondream 2
and 3 share them), with grouped heads, on FP8 pages, through the dispatch switch, and replayed
from a captured CUDA graph after the lengths and page table changed.

Tolerances (``tests/tolerance.py``, scaled to the reference's largest output): bfloat16 within
the shared bound (4 bf16 epsilons: each side rounds the output once and sums in float32 in
another order); float32 within 1e-4 (FMA contraction and another summation order). Run with
``pytest -m gpu tests/gpu``; without CUDA every test skips (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import kestrel_kernels as kk
from kestrel_kernels import decode_route, fa_backend
from kestrel_kernels.backends import FLASH, TORCH
from kestrel_kernels.contract import KvScales, quantize_kv
from kestrel_kernels.triton_decode import DecodeConfig, paged_decode
from tests.attention_args import with_meta
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

I32 = torch.int32
LENS = [800, 1, 812, 357, 799, 64, 1024, 2]  # about 800-position contexts, and short rows
WIDTH = 1100
SCALES = (0.05, 0.04)


@pytest.fixture(autouse=True)
def cuda_and_restore():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    before = decode_route.get_decode_kernel()
    yield
    decode_route.set_decode_kernel(before)


def make_case(heads: int, kv_heads: int, dtype: torch.dtype, lens=LENS, seed: int = 0):
    """q ``[B, 1, H, 64]``, K/V pages scattered over a pool, a page table ``WIDTH`` wide."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(lens) + 64
    perm = (torch.randperm(n_pages - 1, generator=g) + 1).to(I32)
    page_table = torch.zeros(len(lens), WIDTH, dtype=I32)
    used = 0
    for b, n in enumerate(lens):
        page_table[b, :n] = perm[used : used + n]
        used += n
    case = dict(
        q=torch.randn(len(lens), 1, heads, 64, generator=g),
        k_cache=2 * torch.randn(n_pages, kv_heads, 64, generator=g),
        v_cache=torch.randn(n_pages, kv_heads, 64, generator=g),
        page_table=page_table,
        seqused_k=torch.tensor(lens, dtype=I32),
    )
    return {k: (v.to(dtype) if v.is_floating_point() else v).cuda() for k, v in case.items()}


def to_fp8(case: dict) -> KvScales:
    scales = KvScales(*(torch.tensor([s], device="cuda") for s in SCALES))
    case["k_cache"] = quantize_kv(case["k_cache"], scales.k)
    case["v_cache"] = quantize_kv(case["v_cache"], scales.v)
    return scales


def triton_out(case: dict, kv_scales: KvScales | None = None, config=None) -> torch.Tensor:
    out = paged_decode(
        case["q"][:, 0], case["k_cache"], case["v_cache"],
        kk.AttentionMeta(case["page_table"], case["seqused_k"]), softmax_scale=0.125,
        kv_scales=kv_scales, config=config,
    )  # fmt: skip
    return out[:, None]


def torch_out(case: dict, kv_scales: KvScales | None = None) -> torch.Tensor:
    return kk.paged_attention(**with_meta(case), softmax_scale=0.125, backend=TORCH,
                              kv_scales=kv_scales)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 32), (32, 8)], ids=["md", "gqa"])
def test_matches_torch_reference(dtype, heads: int, kv_heads: int) -> None:
    case = make_case(heads, kv_heads, dtype)
    got, want = triton_out(case), torch_out(case)
    torch.cuda.synchronize()
    assert got.dtype == dtype
    assert_close(got, want, rel=1e-4 if dtype == torch.float32 else 0.0, msg="triton vs torch")


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_matches_flash_attention_decode(batch: int) -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    lens = [(800 + 37 * b) % 1000 + 1 for b in range(batch)]
    case = make_case(32, 32, torch.bfloat16, lens=lens, seed=batch)
    want = kk.paged_attention(**with_meta(case), backend=FLASH)
    got = triton_out(case, config=None)
    assert_close(got, want, msg="triton vs fa")
    decode_route.set_decode_kernel("triton")  # the switch: backend "fa" now runs the kernel
    switched = kk.paged_attention(**with_meta(case), backend=FLASH)
    assert torch.equal(switched, got)  # the same kernel on the same inputs


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 32), (32, 8)], ids=["md", "gqa"])
def test_fp8_pages_match_scaled_reference(heads: int, kv_heads: int) -> None:
    case = make_case(heads, kv_heads, torch.bfloat16, seed=5)
    scales = to_fp8(case)
    assert_close(triton_out(case, scales), torch_out(case, scales), msg="fp8 triton vs torch")


@pytest.mark.parametrize("splits", [1, 5, None])
def test_padding_rows_are_zeros(splits) -> None:
    case = make_case(32, 32, torch.bfloat16, lens=[0, 700, 0])
    out = triton_out(case, config=DecodeConfig(splits=splits))
    assert not out[0].any() and not out[2].any() and torch.isfinite(out).all()
    assert out[1].abs().max() > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_replays_from_a_cuda_graph(fp8: bool) -> None:
    """Capture once, then give the captured buffers other lengths and page tables: each
    replay equals the eager reference on the new inputs (what a decode step's graph does)."""
    case = make_case(32, 32, torch.bfloat16, seed=11)
    scales = to_fp8(case) if fp8 else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_out(case, scales)  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_out(case, scales)
    g = torch.Generator().manual_seed(3)
    n_pages = case["k_cache"].shape[0]
    for lens in ([5, 1000, 1, 33, 800, 0, 999, 64], LENS):
        table = torch.randint(1, n_pages, (len(lens), WIDTH), generator=g, dtype=I32)
        case["page_table"].copy_(table)
        case["seqused_k"].copy_(torch.tensor(lens, dtype=I32))
        case["q"].copy_(torch.randn(case["q"].shape, generator=g).to(case["q"].dtype))
        graph.replay()
        torch.cuda.synchronize()
        valid = [b for b, n in enumerate(lens) if n > 0]
        want = torch_out({k: v[valid] if k != "k_cache" and k != "v_cache" else v
                          for k, v in case.items()}, scales)  # fmt: skip
        assert_close(out[valid], want, msg=f"replay with lengths {lens}")
        if len(valid) < len(lens):
            assert not out[[b for b in range(len(lens)) if b not in valid]].any()
