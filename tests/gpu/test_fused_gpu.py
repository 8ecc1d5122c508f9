"""The fused kernels on a CUDA device against their torch forms (``kestrel_kernels.fused``).

Interpreter-exact on a CPU is not GPU-exact (FMA contraction, other rounding of casts), so each
comparison has a bound: float32 within 1e-5 relative, bfloat16 within two bf16 ulps of the
values compared. ``linear_gelu`` on CUDA is one cuBLASLt call with a GELU epilogue
(``torch._addmm_activation``): its GELU must be the tanh form the model uses. The last test runs
the whole model (random bf16 weights, Moondream 2's structure at small widths) fused and
unfused and compares logits. Run with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from kestrel_kernels import fused
from tests.fused_forms import both
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def cuda_and_restore():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    before = fused.get_fused_backend()
    yield
    fused.set_fused_backend(before)


def close(got, want, dtype):
    if dtype == torch.float32:
        assert_close(got, want, rel=1e-05)
    else:
        scale = float(want.float().abs().max())
        bound = 2.0**-6 * want.float().abs() + 2.0**-8 * scale + 1e-5
        assert torch.all((got.float() - want.float()).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tau", [False, True])
def test_rope_write_kv_on_cuda(dtype, tau) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, G, D, R = 4, 33, 32, 32, 64, 16
    qkv = torch.randn(B, T, (H + 2 * G) * D, generator=g, device="cuda").to(dtype)
    ang = torch.randn(B, T, R, generator=g, device="cuda") * 50
    tq = torch.rand(B, T, H, generator=g, device="cuda").to(dtype) if tau else None
    tv = torch.rand(B, T, G, generator=g, device="cuda").to(dtype) if tau else None
    slots = torch.randperm(B * T, device="cuda") + 1
    slots[::7] = -1
    caches = []

    def run():
        kc = torch.zeros(B * T + 1, G, D, dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        caches.append((kc, vc))
        return fused.rope_write_kv(qkv, ang.cos(), ang.sin(), fused.KvWrite(kc, vc, slots),
                                   fused.HeadLayout(H, G, D), tau_q=tq, tau_v=tv)  # fmt: skip

    q_f, q_t = both(run)
    close(q_f, q_t, dtype)
    close(caches[0][0], caches[1][0], dtype)
    close(caches[0][1], caches[1][1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_layer_norm_and_linear_gelu_on_cuda(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x, a, m = (torch.randn(300, 2048, generator=g, device="cuda").to(dtype) for _ in range(3))
    w, b = (torch.randn(2048, generator=g, device="cuda").to(dtype) for _ in range(2))
    (x_f, h_f), (x_t, h_t) = both(lambda: fused.add_layer_norm(x, (a, m), w, b, 1e-5))
    close(x_f, x_t, dtype)
    close(h_f, h_t, dtype)
    W = torch.randn(512, 2048, generator=g, device="cuda").to(dtype) / 45
    bias = torch.randn(512, generator=g, device="cuda").to(dtype)
    y_f, y_t = both(lambda: fused.linear_gelu(x, W, bias))
    close(y_f, y_t, dtype)


def test_model_fused_equals_unfused_on_cuda() -> None:
    from dataclasses import replace

    from kestrel.moondream.config import MoondreamConfig
    from kestrel.runtime.runtime import MoondreamRuntime
    from kestrel.testing.random_weights import random_model
    from kestrel.tokens import TextToken
    from tests.conftest import fixture_dir

    base = MoondreamConfig.from_json_file(fixture_dir() / "config.json")
    cfg = replace(base, text=replace(base.text, n_layers=6))
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16)
    image = torch.randint(0, 256, (400, 500, 3), dtype=torch.uint8).numpy()
    prompt = [TextToken(cfg.tokenizer.bos_id), *(TextToken(i) for i in range(20, 35))]

    def run():
        rt = MoondreamRuntime(model, kv_cache_pages=2000, max_batch_size=2,
                              attention_backend="torch", cuda_graphs=False)  # fmt: skip
        state, logits = rt.start_sequence(prompt, image, max_new_tokens=4)
        out = [logits]
        for t in (40, 41, 42):
            out.append(rt.decode_step([state], [TextToken(t)])[0])
        rt.release_sequence(state)
        return torch.stack(out).float()

    with torch.inference_mode():
        f, t = both(run)
    scale = float(t.abs().max())
    assert float((f - t).abs().max()) <= 0.05 * scale, (f - t).abs().max()
