"""FP8 experts in the grouped MoE: on a CPU the result equals the MoE over the dequantised
experts and no expert that no token chose is read; the Hopper path (activations quantised per
row, ``torch._scaled_grouped_mm``, here its float32 stand-in) agrees within the activations'
FP8 error, and never syncs (what a GPU would be asked, counted with the counting stand-in)."""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream import moe as moe_module
from kestrel.moondream.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows
from kestrel.moondream.model import Linear, MoeWeights
from kestrel.moondream.moe import moe_mlp
from kestrel_kernels import moe as kernels_moe
from kestrel_kernels.counting import LaunchCounter
from tests.tolerance import assert_close
from tests.unit.test_moe_grouped import CFG, random_moe

DIM = 32


def fp8_moe(seed: int) -> tuple[MoeWeights, MoeWeights]:
    """(FP8 experts, the same experts dequantised to float32)."""
    w = random_moe(CFG, DIM, seed=seed, dtype=torch.float32)
    (up, up_s), (down, down_s) = quantize_rows(w.up), quantize_rows(w.down)
    q = MoeWeights(w.router, up, down, up_s, down_s)
    deq = MoeWeights(w.router, up.float() * up_s[..., None], down.float() * down_s[..., None])
    return q, deq


def x_of(rows: int, seed: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, 1, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_quantize_rows_round_trip() -> None:
    w = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(0))
    w[1, 2] = 0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (4, 6) and float(scale[1, 2]) == 1.0
    assert torch.equal(q.float().abs().amax(-1)[w.abs().amax(-1) > 0], torch.full((23,), 448.0))
    back = dequantize_rows(q, scale, torch.float32)
    assert bool(((back - w).abs() <= w.abs().amax(-1, keepdim=True) * 2.0**-4).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
def test_fp8_equals_the_dequantised_moe(rows: int) -> None:
    """Same weights, same arithmetic: equal to float32 rounding (the bound scales with |y|)."""
    q, deq = fp8_moe(seed=1)
    got, r_got = moe_mlp(x_of(rows), q, CFG)
    want, r_want = moe_mlp(x_of(rows), deq, CFG)
    assert torch.equal(r_got.experts, r_want.experts)  # one router, one input
    assert_close(got, want, rel=1e-05)


def test_cpu_reads_only_the_routed_experts() -> None:
    """Experts no token chose hold NaN bytes and NaN scales: the answer does not change."""
    q, _ = fp8_moe(seed=2)
    x = x_of(2)
    out, r = moe_mlp(x, q, CFG)
    unused = sorted(set(range(CFG.num_experts)) - set(r.experts.flatten().tolist()))
    assert unused  # 2 tokens x 3 of 8 experts: some are never read
    up, down = q.up.clone(), q.down.clone()
    up.view(torch.uint8)[unused] = 0x7F  # e4m3fn NaN
    down.view(torch.uint8)[unused] = 0x7F
    up_s, down_s = q.up_scale.clone(), q.down_scale.clone()
    up_s[unused], down_s[unused] = float("nan"), float("nan")
    poisoned, _ = moe_mlp(x, MoeWeights(q.router, up, down, up_s, down_s), CFG)
    assert torch.equal(out, poisoned)  # the same ops on the same rows: bit-equal


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """FP8 experts through the scaled grouped GEMM, as on Hopper (its float32 stand-in here),
    counting its calls."""
    calls: list[int] = []
    real = kernels_moe.scaled_grouped_reference

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(moe_module, "scaled_grouped_supported", lambda device, dtype: True)
    monkeypatch.setattr(kernels_moe, "scaled_grouped_reference", counting)
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
def test_scaled_grouped_path(rows: int, hopper: list[int]) -> None:
    """Two scaled grouped GEMMs per layer whatever the routing, bf16 out, no sync, within the
    activations' e4m3 error of the dequantised MoE."""
    q, deq = fp8_moe(seed=4)
    router = Linear(q.router.weight.bfloat16(), q.router.bias.bfloat16())
    q = MoeWeights(router, q.up, q.down, q.up_scale, q.down_scale)
    deq = MoeWeights(Linear(router.weight.float(), router.bias.float()), deq.up, deq.down)
    x = x_of(rows, dtype=torch.bfloat16)
    with LaunchCounter() as c:
        got, _ = moe_mlp(x, q, CFG)
    assert len(hopper) == 2 and got.dtype == torch.bfloat16
    assert c.syncs == 0
    want, _ = moe_mlp(x.float(), deq, CFG)
    # e4m3 rounds each activation and weight to 3 mantissa bits (at most 2^-4 relative, about
    # 3.6% rms); through two matmuls that is below 12% of the output's norm (measured: 3-9%)
    rel = float((got.float() - want).norm() / want.norm())
    assert 0 < rel <= 0.12


def test_quantised_activations_round_trip() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    x[2] = 0
    q, scale = kernels_moe.quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5,) and float(scale[2]) == 1.0
    assert_close(q.float() * scale[:, None], x, rel=2.0**-4)


def test_scaled_grouped_support_is_hopper_bf16_only() -> None:
    assert not kernels_moe.scaled_grouped_supported(torch.device("cpu"), torch.bfloat16)
    assert not kernels_moe.scaled_grouped_supported(torch.device("cuda", 0), torch.float32)
