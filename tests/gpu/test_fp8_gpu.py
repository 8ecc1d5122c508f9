"""FP8 experts on a CUDA GPU (md3-tiny-a-fp8 in bfloat16).

On an SM 9.0+ GPU the experts go through the row-scaled FP8 grouped GEMM
(``torch._scaled_grouped_mm``); on an older one the stack is widened on use. Checked here: the
FP8 grouped GEMM against its float32 model (``scaled_grouped_reference``), the MoE with FP8
experts inside a captured CUDA graph (replay equals the eager call, no host synchronisation),
within FP8 error of the MoE over the dequantised experts, and decode through the runtime's
CUDA graphs on md3-tiny-a-fp8 equal to eager decode. Without CUDA everything skips
(tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows
from kestrel.moondream.model import Linear, MoeWeights, MoondreamModel
from kestrel.moondream.moe import moe_mlp
from kestrel_kernels import decode_route
from kestrel_kernels import moe as kernels_moe
from tests.conftest import FIXTURES
from tests.gpu.test_md3_gpu import STEPS, fa_ready, replayed, run  # noqa: F401
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

FP8 = FIXTURES / "md3-tiny-a-fp8"
CFG = TextMoeConfig(expert_inner_dim=64)  # 64 experts, top 8
DIM = 128


def hopper() -> bool:
    return kernels_moe.scaled_grouped_supported(torch.device("cuda"), torch.bfloat16)


def fp8_weights(seed: int) -> tuple[MoeWeights, MoeWeights]:
    gen = torch.Generator().manual_seed(seed)
    e, inner = CFG.num_experts, CFG.expert_inner_dim
    router = Linear(torch.randn(e, DIM, generator=gen), torch.randn(e, generator=gen))
    up = torch.randn(e, 2 * inner, DIM, generator=gen) * DIM**-0.5
    down = torch.randn(e, DIM, inner, generator=gen) * inner**-0.5
    (uq, us), (dq, ds) = quantize_rows(up), quantize_rows(down)
    router = Linear(router.weight.cuda().bfloat16(), router.bias.cuda().bfloat16())
    q = MoeWeights(router, uq.cuda(), dq.cuda(), us.cuda(), ds.cuda())
    deq = MoeWeights(router, dequantize_rows(q.up, q.up_scale, torch.bfloat16),
                     dequantize_rows(q.down, q.down_scale, torch.bfloat16))  # fmt: skip
    return q, deq


def test_scaled_grouped_gemm_on_device() -> None:
    """``torch._scaled_grouped_mm`` against its float32 model: uneven groups, an empty one."""
    if not hopper():
        pytest.skip("the row-scaled FP8 grouped GEMM needs an SM 9.0+ GPU")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 128, generator=gen).cuda().bfloat16()
    q, s = quantize_rows(torch.randn(4, 256, 128, generator=gen))
    q, s = q.cuda(), s.cuda()
    offs = torch.tensor([3, 3, 20, 40], dtype=torch.int32, device="cuda")
    xq, xs = kernels_moe.quantize_rows(x)
    rows = kernels_moe.Rows(xq, xs)
    got = kernels_moe.grouped_linear(rows, q, offs, s).float()
    want = kernels_moe.scaled_grouped_reference(xq, xs, q, s, offs).float()
    assert_close(got, want, rel=0.01)


@pytest.mark.parametrize("rows", [1, 7, 8, 16, 300])
def test_fp8_moe_within_fp8_error(rows: int) -> None:
    """The FP8 MoE against the MoE over the dequantised experts (both bf16)."""
    q, deq = fp8_weights(rows)
    x = torch.randn(rows, 1, DIM, generator=torch.Generator().manual_seed(9)).cuda().bfloat16()
    got, r = moe_mlp(x, q, CFG)
    want, r_want = moe_mlp(x, deq, CFG)
    assert torch.equal(r.experts, r_want.experts)
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < (0.12 if hopper() else 0.02), rel


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_moe_in_a_cuda_graph(rows: int) -> None:
    q, _ = fp8_weights(3)
    x = torch.randn(rows, 1, DIM, generator=torch.Generator().manual_seed(4)).cuda().bfloat16()
    eager, _ = moe_mlp(x, q, CFG)
    assert_close(replayed(lambda: moe_mlp(x, q, CFG)[0]), eager, rel=0.01)


@pytest.fixture(scope="module")
def fp8_model() -> MoondreamModel:
    m = MoondreamModel.from_pretrained(FP8, device="cuda")
    assert m.dtype == torch.bfloat16 and m.text.blocks[1].moe.up.dtype == FP8_DTYPE
    return m


@pytest.mark.parametrize("n", [1, 3], ids=["B1-gather", "B3-all-experts"])
def test_fp8_graph_decode_matches_eager(fa_ready, fp8_model, n) -> None:  # noqa: F811
    image = np.asarray(Image.open(FIXTURES / "md3-tiny-a/images/shapes_378.png").convert("RGB"))
    captured, rt = run(fp8_model, image, n, attention_backend="fa", cuda_graphs=True)
    assert rt.decode_graphs is not None and rt.decode_graphs.replays == STEPS
    eager, _ = run(fp8_model, image, n, attention_backend="fa", cuda_graphs=False)
    for g, e in zip(captured, eager, strict=True):
        assert_close(g, e, rel=0.01)


def test_fp8_kv_pages_on_device(fp8_model) -> None:
    """FP8 KV pages on the GPU (the scaled case's torch form, the Triton decode kernel switched
    off): e4m3 pages on the device, no decode graphs, logits within e4m3's error of bfloat16
    pages (scales calibrated here). With the kernel on, test_decode_tune_gpu.py."""
    from kestrel.runtime.runtime import MoondreamRuntime
    from kestrel.tokens import TextToken
    from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales

    image = np.asarray(Image.open(FIXTURES / "md3-tiny-a/images/shapes_378.png").convert("RGB"))
    prompt = [TextToken(i) for i in (0, 439, 2, 302, 333, 272, 271, 3)]

    def decode(rt):
        state, logits = rt.start_sequence(prompt, image, max_new_tokens=4)
        out = [logits.float().cpu()]
        out += [rt.decode_step([state], [TextToken(100 + t)])[0].float().cpu() for t in range(4)]
        rt.release_sequence(state)
        return out

    plain = MoondreamRuntime(fp8_model, kv_cache_pages=1000, max_batch_size=1,
                             attention_backend="torch")  # fmt: skip
    want = decode(plain)
    scales = [KvScales((plain.kv.k[i].abs().max().float() * 1.25 / 448).reshape(1),
                       (plain.kv.v[i].abs().max().float() * 1.25 / 448).reshape(1))
              for i in range(fp8_model.config.text.n_layers)]  # fmt: skip
    before = decode_route.get_decode_kernel()
    decode_route.set_decode_kernel("fa")
    try:
        rt = MoondreamRuntime(fp8_model, kv_cache_pages=1000, max_batch_size=1,
                              kv_scales=scales)  # fmt: skip
        got = decode(rt)
    finally:
        decode_route.set_decode_kernel(before)
    assert rt.kv.k[0].dtype == KV_FP8_DTYPE and rt.kv.k[0].is_cuda and rt.decode_graphs is None
    for g, w in zip(got, want, strict=True):
        assert bool(torch.isfinite(g).all())
        assert float((g - w).abs().max()) < 0.25 * float(w.abs().max())


def test_fp8_kv_pool_is_sized_at_fp8_bytes_per_page(fp8_model) -> None:
    """``kv_cache_pages=None`` with FP8 pages: the pool's bytes per page are FP8's (half of
    bfloat16's), so the same memory holds about twice the positions."""
    from kestrel.kv.storage import PagedKVCache
    from kestrel.runtime.runtime import MoondreamRuntime
    from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales

    text = fp8_model.config.text
    ones = torch.ones(1, device="cuda")
    scales = [KvScales(ones, ones) for _ in range(text.n_layers)]
    kw = {"kv_cache_pages": None, "kv_memory_fraction": 0.05, "max_batch_size": 1}
    rt = MoondreamRuntime(fp8_model, kv_scales=scales, **kw)
    per_page = PagedKVCache.bytes_per_page(text.n_layers, text.n_kv_heads, text.head_dim,
                                           KV_FP8_DTYPE)  # fmt: skip
    assert rt.kv_report is not None and rt.kv_report.bytes_per_page == per_page
    assert rt.kv.bytes // rt.kv.n_pages == per_page
    del rt
    torch.cuda.empty_cache()
    plain = MoondreamRuntime(fp8_model, **kw)
    assert plain.kv_report is not None and plain.kv_report.bytes_per_page == 2 * per_page
