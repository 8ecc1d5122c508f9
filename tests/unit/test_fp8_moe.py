"""FP8 experts in the MoE: the result equals the MoE over the dequantised experts (grouped and
static, both branches), only the experts a forward reads are widened (one at a time, or the
N * k gathered slices), the static FP8 form never syncs, and the row-scaled FP8 GEMM path
(``torch._scaled_mm``, which torch also runs on CPU) agrees within the activations' FP8 error."""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream import fp8 as fp8_module
from kestrel.moondream import moe as moe_module
from kestrel.moondream.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows
from kestrel.moondream.model import MoeWeights
from kestrel.moondream.moe import moe_mlp, moe_mlp_static
from tests.tolerance import assert_close
from tests.unit.test_moe_static import CFG, random_moe, record

DIM = 32


def fp8_moe(seed: int) -> tuple[MoeWeights, MoeWeights]:
    """(FP8 experts, the same experts dequantised to float32)."""
    w = random_moe(CFG, DIM, seed=seed, dtype=torch.float32)
    (up, up_s), (down, down_s) = quantize_rows(w.up), quantize_rows(w.down)
    q = MoeWeights(w.router, up, down, up_s, down_s)
    deq = MoeWeights(w.router, up.float() * up_s[..., None], down.float() * down_s[..., None])
    return q, deq


def x_of(rows: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(rows, 1, DIM, generator=torch.Generator().manual_seed(seed))


def test_quantize_rows_round_trip() -> None:
    w = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(0))
    w[1, 2] = 0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (4, 6) and float(scale[1, 2]) == 1.0
    assert torch.equal(q.float().abs().amax(-1)[w.abs().amax(-1) > 0], torch.full((23,), 448.0))
    back = dequantize_rows(q, scale, torch.float32)
    assert bool(((back - w).abs() <= w.abs().amax(-1, keepdim=True) * 2.0**-4).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("form", ["grouped", "static"])
def test_fp8_equals_the_dequantised_moe(rows: int, form: str) -> None:
    """Same weights, same arithmetic: equal to float32 rounding (the bound scales with |y|)."""
    q, deq = fp8_moe(seed=1)
    fn = moe_mlp if form == "grouped" else moe_mlp_static
    got, r_got = fn(x_of(rows), q, CFG)
    want, r_want = fn(x_of(rows), deq, CFG)
    assert torch.equal(r_got.experts, r_want.experts)
    assert_close(got, want, rel=1e-05)


class Widened:
    """Records the element count of every dequantisation (both modules' references)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []

        def recording(q, scale, dtype):
            self.sizes.append(q.numel())
            return dequantize_rows(q, scale, dtype)

        monkeypatch.setattr(fp8_module, "dequantize_rows", recording)
        monkeypatch.setattr(moe_module, "dequantize_rows", recording)


def test_grouped_widens_only_the_routed_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    q, _ = fp8_moe(seed=2)
    seen = Widened(monkeypatch)
    x = x_of(2)
    _, r = moe_mlp(x, q, CFG)
    routed = len(set(r.experts.flatten().tolist()))
    up, down = q.up[0].numel(), q.down[0].numel()
    assert routed < CFG.num_experts  # 2 tokens x 3 of 8 experts: some are never read
    assert sorted(seen.sizes) == sorted([up] * routed + [down] * routed)


@pytest.mark.parametrize("rows", [1, 2, 16], ids=lambda n: f"N{n}")
def test_static_scratch_is_bounded(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gather branch: the N * k chosen slices (< E); all-experts branch: one expert at a time.
    Never the whole stack in one piece."""
    q, _ = fp8_moe(seed=2)
    seen = Widened(monkeypatch)
    moe_mlp_static(x_of(rows), q, CFG)
    k, one = CFG.experts_per_token, q.up[0].numel()
    if rows * k < CFG.num_experts:
        assert seen.sizes == [rows * k * q.up[0].numel(), rows * k * q.down[0].numel()]
    else:
        assert len(seen.sizes) == 2 * CFG.num_experts and max(seen.sizes) <= one
    assert max(seen.sizes) < q.up.numel()  # less than one whole stack at any time


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
def test_static_fp8_never_syncs(rows: int) -> None:
    q, _ = fp8_moe(seed=5)
    rec = record(moe_mlp_static, x_of(rows), q, CFG)
    assert rec.flagged == []
    assert "aten::_to_copy" in rec.ops  # the recorder saw the dequantisation


@pytest.fixture
def scaled_mm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route FP8 experts through torch._scaled_mm here (as on Hopper) and count its calls."""
    calls: list[int] = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_module, "fp8_gemm_supported", lambda device, dtype: True)
    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("form", ["grouped", "static"])
def test_scaled_gemm_path(rows: int, form: str, scaled_mm: list[int]) -> None:
    """The row-scaled FP8 GEMM: two calls per (expert or slot) matmul pair, no sync in the
    static form, the output within the activations' e4m3 error of the dequantised MoE."""
    q, deq = fp8_moe(seed=4)
    fn = moe_mlp if form == "grouped" else moe_mlp_static
    x = x_of(rows)
    got, r = fn(x, q, CFG)
    want, _ = fn(x, deq, CFG)
    pairs = len(set(r.experts.flatten().tolist()))
    if form == "static":
        gathers = rows * CFG.experts_per_token < CFG.num_experts
        pairs = rows * CFG.experts_per_token if gathers else CFG.num_experts
    assert len(scaled_mm) == 2 * pairs
    if form == "static":
        assert record(fn, x, q, CFG).flagged == []
    # e4m3 rounds each activation and weight to 3 mantissa bits (at most 2^-4 relative, about
    # 3.6% rms); through two matmuls that is below 12% of the output's norm (measured: 3-9%)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel <= 0.12


def test_scaled_linear_matches_dequantised_matmul() -> None:
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(48, 64, generator=gen)
    q, scale = quantize_rows(w)
    got = fp8_module.scaled_linear(x, q, scale)
    want = x @ dequantize_rows(q, scale, torch.float32).T
    assert got.shape == (5, 48) and got.dtype == torch.float32
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05


def test_gemm_support_is_hopper_bf16_only() -> None:
    assert not fp8_module.fp8_gemm_supported(torch.device("cpu"), torch.bfloat16)
    assert not fp8_module.fp8_gemm_supported(torch.device("cuda", 0), torch.float32)
