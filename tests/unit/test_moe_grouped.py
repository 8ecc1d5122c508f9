"""The grouped MoE (``moe.moe_mlp``: pairs sorted by expert on the device, two grouped GEMMs):
equal to a per-token loop over the chosen experts in every dtype and shape, the plan's order and
offsets equal to the host's, only the chosen experts read, no host synchronisation or
data-dependent shape anywhere (recorded with a dispatch mode that does catch them). The same
step through the runtime: ``decode_static`` (what CUDA graphs capture) equals the eager decode
on md3-tiny-a."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.fp8 import quantize_rows
from kestrel.moondream.model import Linear, MoeWeights, MoondreamModel
from kestrel.moondream.moe import expert_activation, moe_mlp
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels import moe as kernels_moe
from kestrel_kernels.backends import TORCH
from kestrel_kernels.moe import plan_experts
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

MD3 = FIXTURES / "md3-tiny-a"
CFG = TextMoeConfig(num_experts=8, start_layer=0, experts_per_token=3, expert_inner_dim=16)
# relative to each output's largest magnitude: bfloat16 rounds each expert's partial sum
REL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero"}


def random_moe(cfg: TextMoeConfig, dim: int, seed: int, dtype: torch.dtype) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)
    e, inner = cfg.num_experts, cfg.expert_inner_dim
    router = Linear(
        torch.randn(e, dim, generator=gen).to(dtype), torch.randn(e, generator=gen).to(dtype)
    )
    up = torch.randn(e, 2 * inner, dim, generator=gen) / dim**0.5
    down = torch.randn(e, dim, inner, generator=gen) / inner**0.5
    return MoeWeights(router, up.to(dtype), down.to(dtype))


def per_token_loop(x_BTC: torch.Tensor, w: MoeWeights, experts, weights) -> torch.Tensor:
    """The MoE of the routing taken, one token and one chosen expert at a time, in float64."""
    x = x_BTC.reshape(-1, x_BTC.shape[-1]).double()
    want = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for e, wk in zip(experts[n].tolist(), weights[n].double(), strict=True):
            h, g = (w.up[e].double() @ x[n]).chunk(2)
            want[n] += wk * (w.down[e].double() @ expert_activation(h, g))
    return want.view(x_BTC.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3, 1), (16, 1), (2, 7)], ids=str)
def test_grouped_equals_per_token_loop(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Decode rows and a prefill; float64 takes the per-expert loop (no grouped GEMM for it)."""
    w = random_moe(CFG, 32, seed=sum(shape), dtype=dtype)
    x = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    got, r = moe_mlp(x, w, CFG)
    assert got.shape == x.shape and got.dtype == dtype
    assert r.weights.dtype == torch.float32
    assert_close(r.weights.sum(-1), torch.ones(r.weights.shape[0]))
    want = per_token_loop(x, w, r.experts, r.weights.to(dtype))
    assert_close(got.double(), want, rel=REL[dtype])


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_plan_sorts_pairs_and_finds_offsets_on_the_device(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(tokens)])
    plan = plan_experts(experts, torch.arange(8))
    flat = experts.flatten()
    # integers: the host's grouping, exactly
    assert torch.equal(plan.order, torch.argsort(flat, stable=True))
    assert plan.offs.dtype == torch.int32
    assert plan.offs.tolist() == torch.bincount(flat, minlength=8).cumsum(0).tolist()


def test_reads_only_the_chosen_experts() -> None:
    w = random_moe(CFG, 32, seed=3, dtype=torch.float32)
    x = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))  # 6 pairs, 8 experts
    out, routing = moe_mlp(x, w, CFG)
    unused = sorted(set(range(8)) - set(routing.experts.flatten().tolist()))
    assert unused
    up, down = w.up.clone(), w.down.clone()
    up[unused], down[unused] = float("nan"), float("nan")
    poisoned, _ = moe_mlp(x, MoeWeights(w.router, up, down), CFG)
    assert torch.equal(out, poisoned)  # the same kernels on the same rows: bit-equal


class OpRecorder(TorchDispatchMode):
    """Names every aten op dispatched, and which of them sync or have data-dependent shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.flagged: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops.append(name)
        tags = set(func.tags)
        dynamic = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & tags
        if dynamic or name in SYNC_OPS:
            self.flagged.append(name)
        return func(*args, **(kwargs or {}))


def record(fn, *args) -> OpRecorder:
    rec = OpRecorder()
    with rec:
        fn(*args)
    return rec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64], ids=lambda n: f"N{n}")
def test_grouped_form_never_syncs(rows: int, dtype: torch.dtype) -> None:
    w = random_moe(CFG, 32, seed=5, dtype=dtype)
    x = torch.randn(rows, 1, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    rec = record(moe_mlp, x, w, CFG)
    assert rec.ops.count("aten::_grouped_mm") == 2  # up and down: one launch each
    assert rec.flagged == []


def test_recorder_catches_a_sync_and_a_dynamic_shape() -> None:
    x = torch.randn(2, 32)
    assert "aten::bincount" in record(torch.bincount, torch.tensor([1, 2])).flagged
    assert "aten::_local_scalar_dense" in record(lambda t: t.sum().item(), x).flagged
    assert "aten::nonzero" in record(torch.nonzero, x).flagged


def test_shapes_the_grouped_gemm_refuses_take_the_loop() -> None:
    """A width whose rows are not 16-byte aligned: the per-expert loop, same answer."""
    cfg = TextMoeConfig(num_experts=4, start_layer=0, experts_per_token=2, expert_inner_dim=5)
    w = random_moe(cfg, 6, seed=8, dtype=torch.float32)
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(9))
    got, r = moe_mlp(x, w, cfg)
    assert_close(got.double(), per_token_loop(x, w, r.experts, r.weights), rel=REL[torch.float32])


@pytest.mark.parametrize("fp8", [False, True])
def test_the_compile_form_equals_the_grouped_gemm(fp8: bool) -> None:
    """The per-row gather ``torch.compile`` traces outside bf16: the grouped GEMM's rows."""
    gen = torch.Generator().manual_seed(12)
    w, scale = torch.randn(4, 24, 16, generator=gen), None
    if fp8:
        w, scale = quantize_rows(w)
    x = torch.randn(11, 16, generator=gen)
    offs = torch.tensor([3, 3, 9, 11], dtype=torch.int32)  # an expert with no rows
    want = kernels_moe.grouped_linear(kernels_moe.Rows(x), w, offs, scale)
    got = kernels_moe._gathered(x, w, offs, scale)
    assert_close(got, want, rel=REL[torch.float32])


# ---------------------------------------------------------------------------- through the runtime
@pytest.fixture(scope="module")
def md3() -> MoondreamModel:
    return MoondreamModel.from_pretrained(MD3, device="cpu", dtype=torch.float32)


def decode_logits(model: MoondreamModel, static: bool, n_seqs: int, steps: int) -> list:
    rt = MoondreamRuntime(model, kv_cache_pages=200, max_batch_size=4, attention_backend="torch")
    if static:  # what CUDA runs, uncaptured: decode_static over device tensors
        rt.decode_graphs = DecodeGraphs(
            model, rt.kv, rt.page_table.page_table, max_batch_size=4, backend=TORCH,
            capture=False,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    bos = TextToken(model.config.tokenizer.bos_id)
    prompts = [torch.randint(10, 700, (4 + 3 * s,), generator=gen).tolist() for s in range(n_seqs)]
    states = [
        rt.start_sequence([bos, *map(TextToken, ids)], max_new_tokens=steps)[0] for ids in prompts
    ]
    out = [rt.decode_step(states, [TextToken(20 + 9 * t + s) for s in range(n_seqs)])
           for t in range(steps)]  # fmt: skip
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()
    return out


@pytest.mark.parametrize("n_seqs", [1, 3], ids=["B1", "B3-padded"])
def test_static_decode_equals_eager_decode(md3, n_seqs) -> None:
    """md3-tiny-a (8 experts, top 2): the static step (bucket 4 pads three rows with one that
    routes too) against the eager one: the padding row's pairs change no real row."""
    eager = decode_logits(md3, static=False, n_seqs=n_seqs, steps=3)
    static = decode_logits(md3, static=True, n_seqs=n_seqs, steps=3)
    for s, g in zip(static, eager, strict=True):
        # float32 sums in another order: the error scales with the logits' size (AMD: 1.2e-4)
        assert_close(s, g, rel=2e-5)
