"""Moondream 3 decode on a CUDA GPU: the md3-tiny-a fixture in bfloat16 with the fa backend.

The MoE layers are grouped GEMMs with static shapes and no host sync (``moe.moe_mlp``), so
decode and prefill capture into CUDA graphs at start-up. Checked here: graph replay equals the
uncaptured decode step for one row and three (bucket 4: a padding row routes too), a
graph-replayed step makes no host synchronisation, every prefill bucket captures and a prefill
from its graph equals the eager one, and the grouped MoE on the device (Moondream 3's routing,
64 experts top 8) equals a per-token loop in float64, inside a CUDA graph too, without a sync.
Without CUDA everything skips (tests/conftest.py); without an sm90 GPU or flash-attn-4 the fa
tests skip.
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
from kestrel.moondream.moe import moe_mlp
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


@pytest.mark.parametrize("n", [1, 3], ids=["B1", "B3-padded"])
def test_md3_graph_decode_matches_eager(fa_ready, model, image, n) -> None:
    captured, rt = run(model, image, n, attention_backend="fa", cuda_graphs=True)
    assert rt.decode_graphs is not None and rt.decode_graphs.captured == (1, 2, 4)
    assert rt.decode_graphs.replays == STEPS
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


def test_md3_prefill_graphs_capture_and_match_eager(fa_ready, model, image) -> None:
    """Every prefill bucket captures at start-up; the image miss and a hit replay their graphs
    and give the logits of the eager prefill."""
    captured, rt = run(model, image, 2, attention_backend="fa", cuda_graphs=True)
    graphs = rt.prefill_graphs
    assert graphs is not None and not graphs.failures
    assert graphs.captured == graphs.shapes and graphs.replays >= 1
    eager, _ = run(model, image, 2, attention_backend="fa", cuda_graphs=False)
    for g, e in zip(captured, eager, strict=True):
        assert_close(g, e, rel=0.01)


def moe_weights(cfg: TextMoeConfig, dim: int, seed: int) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)
    e, inner = cfg.num_experts, cfg.expert_inner_dim

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)

    return MoeWeights(Linear(rand(e, dim), rand(e)), rand(e, 2 * inner, dim, scale=dim**-0.5),
                      rand(e, dim, inner, scale=inner**-0.5))  # fmt: skip


def per_token(x: torch.Tensor, w: MoeWeights, experts, weights) -> torch.Tensor:
    """The MoE of the routing taken, one token and expert at a time, in float64."""
    from kestrel.moondream.moe import expert_activation

    xs = x.reshape(-1, x.shape[-1]).double()
    out = torch.zeros_like(xs)
    for n in range(xs.shape[0]):
        for e, wk in zip(experts[n].tolist(), weights[n].bfloat16().double(), strict=True):
            h, g = (w.up[e].double() @ xs[n]).chunk(2)
            out[n] += wk * (w.down[e].double() @ expert_activation(h, g))
    return out.view(x.shape)


@pytest.mark.parametrize("rows", [1, 7, 8, 64, 300])
def test_grouped_moe_on_cuda(rows: int) -> None:
    """Moondream 3's production routing (64 experts, top 8) at reduced widths, bf16: equal to
    the per-token loop, and no host synchronisation (decode rows and a prefill's)."""
    cfg = TextMoeConfig(expert_inner_dim=64)
    w = moe_weights(cfg, 128, seed=rows)
    x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(2)).cuda().bfloat16()
    with syncs_raise():
        got, r = moe_mlp(x, w, cfg)
    assert_close(got.double(), per_token(x, w, r.experts, r.weights), rel=0.03)


@pytest.mark.parametrize("rows", [1, 64])
def test_grouped_moe_in_a_cuda_graph(rows: int) -> None:
    cfg = TextMoeConfig(expert_inner_dim=64)
    w = moe_weights(cfg, 128, seed=5)
    x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(4)).cuda().bfloat16()
    eager, _ = moe_mlp(x, w, cfg)
    assert_close(replayed(lambda: moe_mlp(x, w, cfg)[0]), eager, rel=0.01)


def replayed(fn) -> torch.Tensor:
    """``fn()``'s output from a CUDA graph captured after a warm-up on a side stream, replayed
    with host synchronisation made an error."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    with syncs_raise():
        graph.replay()
    torch.cuda.synchronize()
    return out
