"""The static-shape, sync-free MoE (``moe.moe_mlp_static``, the CUDA decode form) against the
grouped one (``moe.moe_mlp``): equal outputs on both branches and dtypes, the branch chosen
from the shape alone, the gather branch reading only the chosen experts, and no host
synchronisation or data-dependent shape anywhere (recorded with a dispatch mode that does catch
the grouped path). The same step through the runtime: ``decode_static`` on md3-tiny-a equals
the eager (grouped) decode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel.moondream import text as text_module
from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.model import Linear, MoeWeights, MoondreamModel
from kestrel.moondream.moe import Routing, gathers_experts, moe_mlp, moe_mlp_static
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
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


def test_branch_is_a_function_of_the_shape() -> None:
    # E = 8, k = 3: gather while N * 3 < 8
    assert [gathers_experts(n, CFG) for n in (1, 2, 3, 64)] == [True, True, False, False]
    md3 = TextMoeConfig()  # 64 experts, top 8: gather up to 7 rows
    assert gathers_experts(7, md3) and not gathers_experts(8, md3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3, 1), (16, 1), (2, 7)], ids=str)
def test_static_equals_grouped(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Both branches (N = 1, 2: gather; N >= 3: all experts), decode rows and a prefill."""
    w = random_moe(CFG, 32, seed=sum(shape), dtype=dtype)
    x = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    want, r_want = moe_mlp(x, w, CFG)
    got, r_got = moe_mlp_static(x, w, CFG)
    # One router, one input: the routing is the same tensor either way, so no near tie can
    # flip between the two forms here (the model-level test below checks its margins).
    assert torch.equal(r_got.experts, r_want.experts)
    assert torch.equal(r_got.weights, r_want.weights)
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, want, rel=REL[dtype])


def test_gather_branch_reads_only_the_chosen_experts() -> None:
    w = random_moe(CFG, 32, seed=3, dtype=torch.float32)
    x = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))  # 2 * 3 < 8: gather
    out, routing = moe_mlp_static(x, w, CFG)
    unused = sorted(set(range(8)) - set(routing.experts.flatten().tolist()))
    assert unused
    up, down = w.up.clone(), w.down.clone()
    up[unused], down[unused] = float("nan"), float("nan")
    poisoned, _ = moe_mlp_static(x, MoeWeights(w.router, up, down), CFG)
    assert torch.equal(out, poisoned)


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


@pytest.mark.parametrize("rows", [1, 2, 3, 16], ids=lambda n: f"N{n}")
def test_static_form_never_syncs(rows: int) -> None:
    w = random_moe(CFG, 32, seed=5, dtype=torch.float32)
    x = torch.randn(rows, 1, 32, generator=torch.Generator().manual_seed(6))
    rec = record(moe_mlp_static, x, w, CFG)
    assert "aten::bmm" in rec.ops  # the recorder saw the expert matmuls
    assert rec.flagged == []


def test_recorder_catches_the_grouped_form_and_item() -> None:
    w = random_moe(CFG, 32, seed=5, dtype=torch.float32)
    x = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(6))
    assert "aten::bincount" in record(moe_mlp, x, w, CFG).flagged  # a data-dependent shape
    assert "aten::_local_scalar_dense" in record(lambda t: t.sum().item(), x).flagged
    assert "aten::nonzero" in record(torch.nonzero, x).flagged


# ---------------------------------------------------------------------------- through the runtime
@pytest.fixture(scope="module")
def md3() -> MoondreamModel:
    return MoondreamModel.from_pretrained(MD3, device="cpu", dtype=torch.float32)


def decode_logits(model: MoondreamModel, static: bool, n_seqs: int, steps: int) -> list:
    rt = MoondreamRuntime(model, kv_cache_pages=200, max_batch_size=4, attention_backend="torch")
    if static:  # what CUDA runs, uncaptured: decode_static with the static MoE
        rt.decode_graphs = DecodeGraphs(
            model, rt.kv, rt.page_table.page_table, max_batch_size=4, backend="torch",
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


@pytest.mark.parametrize("n_seqs", [1, 3], ids=["B1-gather", "B3-all-experts"])
def test_static_decode_equals_grouped_decode(md3, n_seqs, monkeypatch) -> None:
    """md3-tiny-a (8 experts, top 2): one row gathers, three rows (bucket 4) run every expert.
    The static run's routing margins are recorded: a k-th / (k+1)-th logit gap under 1e-3
    would make the comparison meaningless (a float32 difference could flip it), as the
    conformance tests exclude the fixture's near ties; these inputs have none."""
    routings: list[Routing] = []

    def recording(x, w, cfg):
        out, r = moe_mlp_static(x, w, cfg)
        routings.append(r)
        return out, r

    grouped = decode_logits(md3, static=False, n_seqs=n_seqs, steps=3)
    monkeypatch.setattr(text_module, "moe_mlp_static", recording)
    static = decode_logits(md3, static=True, n_seqs=n_seqs, steps=3)
    k = md3.config.text.moe.experts_per_token
    assert len(routings) == 3 * (md3.config.text.n_layers - md3.config.text.moe.start_layer)
    for r in routings:  # the real rows (bucket 4 has a padding row after them)
        top = r.logits[:n_seqs].topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min() > 1e-3
    for s, g in zip(static, grouped, strict=True):
        # float32 sums in another order: the error scales with the logits' size (AMD: 1.2e-4)
        assert_close(s, g, rel=2e-5)
