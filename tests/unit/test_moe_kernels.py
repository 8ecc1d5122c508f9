"""Moondream 3's Triton kernels (``kestrel_kernels.triton_moe``) under the interpreter against
their torch forms (``kestrel_kernels.moe``): the gather (and its inverse permutation), the
GeGLU, the per-row FP8 quantisation both fuse, the combine and the tau factors; the whole MoE
layer and the whole Moondream 3 decoder through them; one launch each; sm_90 builds.

Tolerances: in float32 the kernels round once where torch rounds after each op, so they agree
to float32 rounding of the largest value; in bfloat16 the interpreter truncates float32 ->
bfloat16 casts (torch rounds to nearest), up to two bf16 ulps of the values compared."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kestrel.moondream.config import TextMoeConfig  # noqa: E402
from kestrel.moondream.moe import moe_mlp  # noqa: E402
from kestrel_kernels import fused  # noqa: E402
from kestrel_kernels import moe as kmoe  # noqa: E402
from kestrel_kernels.counting import LaunchCounter  # noqa: E402
from tests.fused_forms import both  # noqa: E402
from tests.sm90 import assert_built, sm90_builds  # noqa: E402
from tests.tolerance import assert_close  # noqa: E402
from tests.unit.test_moe_grouped import random_moe  # noqa: E402

REL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-6}


def routed(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [False, True])
def test_gather_matches_torch(interpreted, dtype, quantize) -> None:
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[5] = 0  # an all-zero row: scale 1
    plan = kmoe.plan_experts(routed(37, 3, 8, seed=2), torch.arange(8))
    got, want = both(lambda: kmoe.gather_rows(x, plan, quantize=quantize))
    assert got.inv is not None and want.inv is None
    # integers: the inverse permutation exactly
    assert torch.equal(got.inv[plan.order], torch.arange(plan.order.shape[0]))
    if not quantize:
        assert torch.equal(got.x, want.x)  # a copy of rows: bit-equal
        return
    assert got.x.dtype == want.x.dtype == torch.float8_e4m3fn
    assert_close(got.scale, want.scale, rel=1e-6)
    assert float(got.scale[(plan.order // 3 == 5).nonzero()[0, 0]]) == 1.0
    # the same scaled values cast by torch: equal bytes but where a bf16 input's scale
    # rounded apart by an ulp moves a value across a rounding boundary
    same = (got.x.view(torch.uint8) == want.x.view(torch.uint8)).float().mean()
    assert float(same) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [False, True])
def test_geglu_matches_torch(interpreted, dtype, quantize) -> None:
    hg = torch.randn(29, 2 * 40, generator=torch.Generator().manual_seed(3)).to(dtype) * 3
    got, want = both(lambda: kmoe.geglu(hg, quantize=quantize))
    if quantize:
        assert_close(got.scale, want.scale, rel=REL[dtype])
        got_x, want_x = got.x.float() * got.scale[:, None], want.x.float() * want.scale[:, None]
        assert_close(got_x, want_x, rel=2.0**-3)  # one e4m3 step of the largest value
    else:
        assert_close(got.x.float(), want.x.float(), rel=REL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_torch(interpreted, dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    plan = kmoe.plan_experts(routed(21, 4, 8, seed=5), torch.arange(8))
    x = torch.randn(21, 24, generator=gen).to(dtype)
    y = torch.randn(21 * 4, 24, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(21, 4, generator=gen), dim=-1)
    fused.set_fused_backend("triton")
    rows = kmoe.gather_rows(x, plan, quantize=False)
    got, want = both(lambda: kmoe.combine(y, plan, rows, weights))
    assert_close(got.float(), want.float(), rel=REL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tau_matches_torch(interpreted, dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    lin = torch.randn(2, 9, 2 * 6, generator=gen).to(dtype) * 2
    positions = torch.arange(18).view(2, 9) * 97
    alpha = torch.randn(6, generator=gen).to(dtype)
    (gq, gv), (wq, wv) = both(lambda: kmoe.tau_scales(lin, positions, alpha))
    assert_close(gq.float(), wq.float(), rel=REL[dtype])
    assert_close(gv.float(), wv.float(), rel=REL[dtype])


CFG = TextMoeConfig(num_experts=8, start_layer=0, experts_per_token=3, expert_inner_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_through_the_kernels_matches_torch(interpreted, dtype) -> None:
    w = random_moe(CFG, 32, seed=7, dtype=dtype)
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(8)).to(dtype)
    (got, r1), (want, r2) = both(lambda: moe_mlp(x, w, CFG))
    assert torch.equal(r1.experts, r2.experts)  # the router is torch's in both
    assert_close(got.float(), want.float(), rel=4 * REL[dtype])


def test_each_kernel_is_one_launch(interpreted) -> None:
    w = random_moe(CFG, 32, seed=7, dtype=torch.float32)
    x = torch.randn(4, 1, 32, generator=torch.Generator().manual_seed(8))
    fused.set_fused_backend("triton")
    with LaunchCounter() as c:
        moe_mlp(x, w, CFG)
    # linear, topk, softmax, sort, searchsorted, gather, 2 grouped GEMMs, geglu, combine
    assert c.launches == 10 and c.syncs == 0


@pytest.mark.parametrize("kernel", ["gather", "geglu", "combine", "tau"])
def test_kernels_compile_for_sm90(kernel, tmp_path) -> None:
    """Each kernel builds for an H100 (sm_90) at Moondream 3's widths, no GPU needed, and
    spills no registers (in a fresh process: the compiler cannot run under the interpreter)."""
    code = (
        "import json, sys; from kestrel_kernels.triton_moe import sm90_build; "
        f"print(json.dumps(sm90_build({kernel!r}, sys.argv[1])))"
    )
    (got,) = sm90_builds(code, tmp_path)
    assert_built(got, max_registers=128)
