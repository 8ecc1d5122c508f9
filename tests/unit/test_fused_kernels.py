"""The fused ops (``kestrel_kernels.fused``): Triton kernels under the interpreter against the
torch forms, the whole decoder and vision encoder through them, and sm_90 builds of each kernel.

Skipped without the ``triton`` package (the suite stays green without it; ``.ci/run`` installs
it). Tolerances: float32 and float16 agree exactly under the interpreter; in bfloat16 the
interpreter truncates float32 -> bfloat16 casts where torch rounds to nearest, so results may
differ by an ulp or two (2**-7 relative) per rounding of the values compared.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kestrel_kernels import fused  # noqa: E402
from kestrel_kernels.counting import LaunchCounter  # noqa: E402
from tests.fused_forms import both  # noqa: E402
from tests.sm90 import assert_built, sm90_builds  # noqa: E402
from tests.tolerance import assert_close  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_ulp_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:  # up to two roundings (q * tau, then the rotation)
        scale = float(want.float().abs().max())
        bound = 2.0**-6 * want.float().abs() + 2.0**-8 * scale + 1e-6
        assert torch.all((got.float() - want.float()).abs() <= bound), (got, want)
    else:
        assert_close(got, want, rel=1e-06)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_rope_write_kv_matches_torch(interpreted, dtype, tau, heads, kv_heads) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + int(tau))
    B, T, D, R = 2, 3, 16, 4
    qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=g).to(dtype)
    angles = torch.randn(B, T, R, generator=g) * 3
    tau_q = torch.rand(B, T, heads, generator=g).to(dtype) if tau else None
    tau_v = torch.rand(B, T, kv_heads, generator=g).to(dtype) if tau else None
    slots = torch.tensor([3, 5, -1, 7, 9, -1])
    caches = []

    def run():
        kc = torch.full((12, kv_heads, D), 0.5, dtype=dtype)
        vc = torch.full((12, kv_heads, D), -0.5, dtype=dtype)
        caches.append((kc, vc))
        return fused.rope_write_kv(qkv, angles.cos(), angles.sin(), fused.KvWrite(kc, vc, slots),
                                   fused.HeadLayout(heads, kv_heads, D),
                                   tau_q=tau_q, tau_v=tau_v)  # fmt: skip

    q_tri, q_ref = both(run)
    assert q_tri.shape == (B, T, heads, D) and q_tri.is_contiguous()
    assert_ulp_close(q_tri, q_ref, dtype)
    (kt, vt), (kr, vr) = caches
    assert_ulp_close(kt, kr, dtype)
    assert_ulp_close(vt, vr, dtype)
    untouched = [p for p in range(12) if p not in (3, 5, 7, 9)]
    assert torch.all(kt[untouched] == 0.5) and torch.all(vt[untouched] == -0.5), "slot -1 wrote"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_deltas", [0, 1, 2])
def test_add_layer_norm_matches_torch(interpreted, dtype, n_deltas) -> None:
    g = torch.Generator().manual_seed(n_deltas)
    x = torch.randn(2, 5, 40, generator=g).to(dtype)
    deltas = tuple(torch.randn(2, 5, 40, generator=g).to(dtype) for _ in range(n_deltas))
    w, b = torch.randn(40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    (x_tri, h_tri), (x_ref, h_ref) = both(lambda: fused.add_layer_norm(x, deltas, w, b, 1e-5))
    assert_ulp_close(x_tri, x_ref, dtype)
    # the norm of values one ulp apart: bounded by the ulp times the normalised scale
    bound = 4 * (2.0**-7 if dtype == torch.bfloat16 else 1e-3) * (h_ref.float().abs() + 1)
    assert torch.all((h_tri.float() - h_ref.float()).abs() <= bound)


def test_each_fused_op_is_one_launch(interpreted) -> None:
    fused.set_fused_backend("triton")
    qkv = torch.randn(1, 2, 6 * 8)
    ang = torch.randn(1, 2, 2)
    kc, vc = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    x, w = torch.randn(2, 8), torch.randn(8)
    cos, sin, slots = ang.cos(), ang.sin(), torch.tensor([1, 2])
    with LaunchCounter() as c:
        fused.rope_write_kv(qkv, cos, sin, fused.KvWrite(kc, vc, slots), fused.HeadLayout(4, 1, 8))
    assert c.launches == 1 and c.syncs == 0
    with LaunchCounter() as c:
        fused.add_layer_norm(x, (x, x), w, w, 1e-5)
    assert c.launches == 1
    weight, bias = torch.randn(3, 8), torch.randn(3)
    with LaunchCounter() as c:
        fused.linear_gelu(x, weight, bias)
    assert c.launches == 1


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = fused.get_fused_backend()
    fused.set_fused_backend("triton")
    try:
        with pytest.raises(fused.BackendUnavailableError, match="TRITON_INTERPRET"):
            fused.fused_backend(torch.device("cpu"))
    finally:
        fused.set_fused_backend(before)
    assert fused.fused_backend(torch.device("cpu")) in ("torch",) or before != "auto"


def test_model_through_the_fused_kernels_matches_torch(interpreted) -> None:
    """The fixture model's prefill + decode logits and its image embedding, fused vs torch."""
    from kestrel.moondream.model import MoondreamModel
    from kestrel.runtime.runtime import MoondreamRuntime
    from kestrel.tokens import TextToken
    from tests.conftest import fixture_dir

    model = MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    image = torch.randint(0, 256, (200, 260, 3), generator=g, dtype=torch.uint8).numpy()
    ids = torch.randint(10, 900, (7,), generator=g).tolist()
    prompt = [TextToken(model.config.tokenizer.bos_id), *(TextToken(i) for i in ids)]

    def run():
        rt = MoondreamRuntime(model, kv_cache_pages=1200, max_batch_size=2,
                              attention_backend="torch")  # fmt: skip
        state, logits = rt.start_sequence(prompt, image, max_new_tokens=3)
        out = [logits]
        for t in (11, 12):
            out.append(rt.decode_step([state], [TextToken(t)])[0])
        rt.release_sequence(state)
        return torch.stack(out)

    with torch.inference_mode():
        fused_logits, torch_logits = both(run)
    assert_close(fused_logits, torch_logits, rel=0.0001)


@pytest.mark.parametrize("kernel", ["rope_kv", "add_ln"])
def test_kernels_compile_for_sm90(kernel, tmp_path) -> None:
    """Each kernel builds for an H100 (sm_90) here, no GPU needed, and spills no registers.
    (In a fresh process: the compiler cannot run where the interpreter is switched on.)"""
    code = (
        "import json, sys; from kestrel_kernels.triton_fused import sm90_build; "
        f"print(json.dumps(sm90_build({kernel!r}, sys.argv[1])))"
    )
    (got,) = sm90_builds(code, tmp_path)
    assert_built(got, max_registers=128)


def test_fused_ops_trace_whole_under_torch_compile(interpreted) -> None:
    """Under ``torch.compile`` the fused ops take their torch forms, with nothing Dynamo
    cannot trace: with the Triton forms forced (as "auto" is on CUDA), the package probe and
    the launchers broke the compiled decode on an H200 (``find_spec`` is not traceable)."""
    fused.set_fused_backend("triton")
    gen = torch.Generator().manual_seed(0)
    x, d = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    w, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen)

    def step(x, d):
        return fused.add_layer_norm(x, (d,), w, b, 1e-5)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(x, d)
    fused.set_fused_backend("torch")
    want = step(x, d)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r)
