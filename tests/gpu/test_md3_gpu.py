"""Moondream 3 decode on a CUDA GPU: the md3-tiny-a fixture in bfloat16 with the fa backend.

The MoE layers run in their static, sync-free form on CUDA (``moe.moe_mlp_static``), so a
decode step captures into a CUDA graph. Checked here: graph replay equals the uncaptured step
for one row (the gather branch: 1 x top-2 < 8 experts) and three rows (bucket 4: every expert),
a graph-replayed step makes no host synchronisation, and the static MoE equals the grouped one
on the device (same routing: one router, one input). Without CUDA
everything skips (tests/conftest.py); without an sm90 GPU or flash-attn-4 the fa tests skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.model import Linear, MoeWeights, MoondreamModel
from kestrel.moondream.moe import gathers_experts, moe_mlp, moe_mlp_static
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

MD3 = FIXTURES / "md3-tiny-a"
STEPS = 6


@pytest.fixture(scope="module")
def fa_ready() -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    m = MoondreamModel.from_pretrained(MD3, device="cuda")
    assert m.dtype == torch.bfloat16 and m.config.family == "moondream3"
    return m


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.asarray(Image.open(MD3 / "images" / "shapes_378.png").convert("RGB"))


def prompts(model: MoondreamModel, n: int) -> list[list[TextToken]]:
    gen = torch.Generator().manual_seed(3)
    bos = TextToken(model.config.tokenizer.bos_id)
    return [[bos, *(TextToken(int(i)) for i in torch.randint(10, 700, (5 + 2 * s,), generator=gen))]
            for s in range(n)]  # fmt: skip


def run(model, image, n: int, **kw) -> tuple[list[torch.Tensor], MoondreamRuntime]:
    """Prefill n sequences (the first with the image), then STEPS decode steps of fixed tokens."""
    rt = MoondreamRuntime(model, kv_cache_pages=4000, max_batch_size=4, **kw)
    states = [rt.start_sequence(p, image if i == 0 else None, max_new_tokens=STEPS)[0]
              for i, p in enumerate(prompts(model, n))]  # fmt: skip
    out = [rt.decode_step(states, [TextToken(100 + 7 * t + s) for s in range(n)]).float().cpu()
           for t in range(STEPS)]  # fmt: skip
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()
    return out, rt


@pytest.mark.parametrize("n", [1, 3], ids=["B1-gather", "B3-all-experts"])
def test_md3_graph_decode_matches_eager(fa_ready, model, image, n) -> None:
    captured, rt = run(model, image, n, attention_backend="fa", cuda_graphs=True)
    bucket = 1 if n == 1 else 4
    assert rt.decode_graphs is not None and rt.decode_graphs.captured == (1, 2, 4)
    assert rt.decode_graphs.replays == STEPS
    assert gathers_experts(bucket, model.config.text.moe) == (n == 1)
    eager, _ = run(model, image, n, attention_backend="fa", cuda_graphs=False)
    for g, e in zip(captured, eager, strict=True):
        assert_close(g, e, rel=0.01)


def test_md3_graph_decode_does_not_sync(fa_ready, model, image) -> None:
    rt = MoondreamRuntime(model, kv_cache_pages=4000, max_batch_size=4, attention_backend="fa")
    states = [rt.start_sequence(p, image, max_new_tokens=5)[0] for p in prompts(model, 2)]
    assert rt.decode_graphs is not None and rt.decode_graphs.captured == (1, 2, 4)  # start-up
    rt.decode_step(states, [TextToken(5), TextToken(6)])
    with syncs_raise():
        for t in range(3):
            rt.decode_step(states, [TextToken(7 + t), TextToken(9 + t)])
    for s in states:
        rt.release_sequence(s)


@contextlib.contextmanager
def syncs_raise() -> Iterator[None]:
    """Inside, any host synchronisation with the device raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("rows", [1, 7, 8, 64])
def test_static_moe_equals_grouped_on_cuda(rows: int) -> None:
    """Moondream 3's production routing (64 experts, top 8) at reduced widths, bf16."""
    cfg = TextMoeConfig(expert_inner_dim=64)
    gen = torch.Generator().manual_seed(rows)
    e, dim, inner = cfg.num_experts, 128, cfg.expert_inner_dim

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)

    w = MoeWeights(Linear(rand(e, dim), rand(e)), rand(e, 2 * inner, dim, scale=dim**-0.5),
                   rand(e, dim, inner, scale=inner**-0.5))  # fmt: skip
    x = rand(rows, 1, dim)
    want, r_want = moe_mlp(x, w, cfg)
    got, r_got = moe_mlp_static(x, w, cfg)
    assert torch.equal(r_got.experts, r_want.experts)
    assert_close(got, want, rel=0.03)
