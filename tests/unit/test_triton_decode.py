"""The Triton flash-decoding kernel (``kestrel_kernels.triton_decode``) under Triton's
interpreter against the torch reference, its static launch, its launch count, the opt-in
dispatch switch, and sm_90 builds of its kernels.

Skipped without the ``triton`` package. Tolerances (``tests/tolerance.py``, scaled to the
reference's largest output): float16 / bfloat16 within the shared bound (4 epsilons of the
dtype: both sides round the output once and sum in float32 in different orders, the
interpreter truncating float32 -> bfloat16 casts where torch rounds); float32 within 1e-5 (an
online softmax merged over splits sums in another order than SDPA).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

import kestrel_kernels as kk  # noqa: E402
from kestrel_kernels import decode_route, dispatch, fa_backend, triton_decode  # noqa: E402
from kestrel_kernels.backends import FLASH, TORCH  # noqa: E402
from kestrel_kernels.contract import (  # noqa: E402
    AttentionShape,
    KernelInputError,
    KvScales,
    quantize_kv,
)
from kestrel_kernels.counting import LaunchCounter  # noqa: E402
from kestrel_kernels.plan import AttentionMeta  # noqa: E402
from kestrel_kernels.torch_backend import (  # noqa: E402
    paged_attention_scaled_torch,
    paged_attention_torch,
)
from kestrel_kernels.triton_decode import DecodeConfig, paged_decode, plan_decode  # noqa: E402
from tests.sm90 import assert_built, sm90_builds  # noqa: E402
from tests.tolerance import assert_close  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENS = [1, 37, 0, 40, 13]  # a padding row (0) and a row of one key among them
WIDTH, POOL, D, SCALE = 44, 300, 16, 0.3
SCALES = KvScales(torch.tensor([0.02]), torch.tensor([0.03]))


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = decode_route.get_decode_kernel()
    yield
    decode_route.set_decode_kernel(before)


def make_case(heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0, lens=LENS):
    """Random q, K/V pages and a page table whose rows' pages lie scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    perm = (torch.randperm(POOL - 1, generator=g) + 1).to(torch.int32)
    page_table = torch.zeros(batch, WIDTH, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        page_table[b, :n] = perm[used : used + n]
        used += n
    return dict(
        q=torch.randn(batch, 1, heads, D, generator=g).to(dtype),
        k_cache=(2 * torch.randn(POOL, kv_heads, D, generator=g)).to(dtype),
        v_cache=torch.randn(POOL, kv_heads, D, generator=g).to(dtype),
        page_table=page_table,
        seqused_k=torch.tensor(lens, dtype=torch.int32),
    )


def reference(case: dict, kv_scales: KvScales | None = None) -> torch.Tensor:
    q, k = case["q"], case["k_cache"]
    b, _, h, d = q.shape
    shape = AttentionShape(b, 1, h, k.shape[1], d, k.shape[0], WIDTH)
    meta = AttentionMeta(case["page_table"], case["seqused_k"])
    args = (q, k, case["v_cache"], meta, shape)
    if kv_scales is not None:
        return paged_attention_scaled_torch(*args, kv_scales, SCALE)[:, 0]
    return paged_attention_torch(*args, SCALE)[:, 0]


def decode(case: dict, config: DecodeConfig | None = None, **kw) -> torch.Tensor:
    meta = AttentionMeta(case["page_table"], case["seqused_k"], kw.pop("seqused_q", None))
    return paged_decode(
        case["q"][:, 0], case["k_cache"], case["v_cache"], meta, softmax_scale=SCALE,
        config=config, **kw,
    )  # fmt: skip


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    assert not got[LENS.index(0)].any(), "the padding row must be zeros"
    assert_close(got, want, rel=1e-5 if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_matches_torch_reference(interpreted, dtype, heads, kv_heads) -> None:
    case = make_case(heads, kv_heads, dtype, seed=heads + kv_heads)
    config = DecodeConfig(heads=4, min_chunk=16)  # 3 splits of 16; 6 and 8 heads: two blocks
    assert plan_decode(len(LENS), WIDTH, heads, config).splits == 3
    check(decode(case, config), reference(case), dtype)


@pytest.mark.parametrize("splits", [1, 2, 11])
def test_any_split_count(interpreted, splits) -> None:
    case = make_case(6, 2, torch.float32, seed=splits)
    check(decode(case, DecodeConfig(splits=splits)), reference(case), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_fp8_pages_match_scaled_reference(interpreted, dtype, heads, kv_heads) -> None:
    case = make_case(heads, kv_heads, dtype, seed=7)
    case["k_cache"] = quantize_kv(case["k_cache"], SCALES.k)
    case["v_cache"] = quantize_kv(case["v_cache"], SCALES.v)
    got = decode(case, DecodeConfig(splits=4), kv_scales=SCALES)
    check(got, reference(case, SCALES), dtype)


def test_rows_without_queries_are_zeros(interpreted) -> None:
    case = make_case(4, 2, torch.float32)
    seqused_q = torch.tensor([1, 0, 0, 1, 1], dtype=torch.int32)
    got = decode(case, DecodeConfig(splits=2), seqused_q=seqused_q)
    want = reference(case)
    assert not got[1].any() and not got[2].any()
    keep = [0, 3, 4]
    assert_close(got[keep], want[keep], rel=1e-5)


def record_launches(monkeypatch) -> list[tuple]:
    """Wrap the kernels so that each launch records its grid and its tensors' shapes."""
    launches: list[tuple] = []
    real = triton_decode.kernels()

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                launches.append((self.name, grid, shapes, tuple(sorted(kw.items()))))
                return self.kernel[grid](*args, **kw)

            return launch

    wrapped = (Recorder("split", real[0]), Recorder("combine", real[1]))
    monkeypatch.setattr(triton_decode, "kernels", lambda: wrapped)
    return launches


def test_launch_depends_on_shapes_not_lengths(interpreted, monkeypatch) -> None:
    """Two calls with other lengths and page tables launch the very same grids, constants and
    buffers (what a captured CUDA graph replays), and each gives its own reference."""
    launches = record_launches(monkeypatch)
    config = DecodeConfig(heads=4, min_chunk=8)
    for seed, lens in ((1, LENS), (2, [44, 3, 0, 1, 30])):
        case = make_case(8, 2, torch.float32, seed=seed, lens=lens)
        assert_close(decode(case, config), reference(case), rel=1e-5)
    first, second = launches[:2], launches[2:]
    assert [x[0] for x in first] == ["split", "combine"]
    assert first == second


def test_plan_is_a_function_of_static_sizes() -> None:
    cfg = DecodeConfig()
    assert plan_decode(64, 832, 32, cfg) == plan_decode(64, 832, 32, cfg)
    for batch, width, heads in ((1, 832, 32), (8, 832, 32), (64, 832, 32), (3, 5, 6)):
        plan = plan_decode(batch, width, heads, cfg)
        assert plan.splits * plan.chunk >= width > (plan.splits - 1) * plan.chunk
        assert plan.chunk % plan.block_n == 0 and plan.heads * plan.head_blocks >= heads
    assert plan_decode(1, 832, 32, cfg).splits > plan_decode(64, 832, 32, cfg).splits
    assert plan_decode(2, 40, 4, DecodeConfig(splits=1)).splits == 1
    with pytest.raises(KernelInputError, match="power of two"):
        plan_decode(2, 40, 4, DecodeConfig(heads=3))


@pytest.mark.parametrize(("splits", "launches"), [(1, 1), (3, 2)])
def test_one_or_two_launches_and_no_sync(interpreted, splits, launches) -> None:
    case = make_case(4, 4, torch.bfloat16)
    with LaunchCounter() as c:
        decode(case, DecodeConfig(splits=splits))
    assert c.launches == launches and c.syncs == 0, c.by_op


def run(
    case: dict, backend: kk.AttentionBackend, q_len: int = 1,
    bidir_regions: torch.Tensor | None = None, kv_scales: KvScales | None = None,
) -> torch.Tensor:  # fmt: skip
    """``dispatch.run_attention`` as ``paged_attention`` calls it after validation."""
    q = case["q"] if q_len == 1 else case["q"].expand(-1, q_len, -1, -1).contiguous()
    b, _, h, d = q.shape
    k = case["k_cache"]
    shape = AttentionShape(b, q_len, h, k.shape[1], d, k.shape[0], WIDTH)
    meta = AttentionMeta(case["page_table"], case["seqused_k"], bidir_regions=bidir_regions)
    plan = kk.AttentionPlan(backend, q_len, meta)
    return dispatch.run_attention(q, k, case["v_cache"], plan, shape, SCALE, kv_scales)


@pytest.fixture
def fa_calls(monkeypatch) -> list[int]:
    """The ``fa`` binding replaced by a recorder returning zeros (no FlashAttention on CPU)."""
    calls: list[int] = []

    def fake(q, *args, **kw):
        calls.append(q.shape[1])
        return torch.zeros_like(q)

    monkeypatch.setattr(fa_backend, "paged_attention_fa", fake)
    return calls


def test_dispatch_takes_the_kernel_only_when_switched_on(
    interpreted, fa_calls, monkeypatch
) -> None:
    case = make_case(4, 2, torch.bfloat16)
    decode_route.set_decode_kernel("fa")
    assert not run(case, FLASH).any() and fa_calls == [1]  # the default: today's path
    decode_route.set_decode_kernel("triton")
    got = run(case, FLASH)
    assert fa_calls == [1] and got.shape == case["q"].shape
    assert_close(got[:, 0], reference(case))
    run(case, FLASH, q_len=3)  # not a decode shape
    regions = torch.tensor([[0, 5]] * len(LENS), dtype=torch.int32)
    run(case, FLASH, bidir_regions=regions)  # regions: the fa path keeps them
    assert fa_calls == [1, 3, 1]

    def kernel_ran(*args, **kw):
        raise AssertionError("the decode kernel ran")

    monkeypatch.setattr(triton_decode, "paged_decode", kernel_ran)
    assert_close(run(case, TORCH)[:, 0], reference(case))  # torch, 16-bit pages: reference


def test_dispatch_runs_fp8_pages_through_the_kernel(interpreted) -> None:
    case = make_case(8, 2, torch.bfloat16, seed=3)
    case["k_cache"] = quantize_kv(case["k_cache"], SCALES.k)
    case["v_cache"] = quantize_kv(case["v_cache"], SCALES.v)
    decode_route.set_decode_kernel("triton")
    with LaunchCounter() as c:
        run(case, TORCH, kv_scales=SCALES)
    assert c.by_op["triton_decode_split"] == 1 and c.launches <= 2, c.by_op
    seqused_q = (case["seqused_k"] > 0).to(torch.int32)  # the padding row: no query
    meta = AttentionMeta(case["page_table"], case["seqused_k"], seqused_q)
    got = kk.paged_attention(case["q"], case["k_cache"], case["v_cache"], meta,
                             softmax_scale=SCALE, backend=TORCH, kv_scales=SCALES)  # fmt: skip
    assert_close(got[:, 0], reference(case, SCALES))


def test_dispatch_keeps_todays_path_when_tracing_or_not_interpreted(
    interpreted, monkeypatch
) -> None:
    case = make_case(4, 4, torch.float32)
    decode_route.set_decode_kernel("triton")
    shape = AttentionShape(len(LENS), 1, 4, 4, D, POOL, WIDTH)
    plan = kk.AttentionPlan(FLASH, 1, AttentionMeta(case["page_table"], case["seqused_k"]))
    assert dispatch.uses_triton_decode(case["q"], shape, plan, False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not dispatch.uses_triton_decode(case["q"], shape, plan, True)
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not dispatch.uses_triton_decode(case["q"], shape, plan, True)  # a CPU
    with pytest.raises(KernelInputError, match="decode kernel"):
        decode_route.set_decode_kernel("flash")


def test_compiled_call_traces_whole_with_the_switch_on(interpreted, monkeypatch) -> None:
    """``torch.compile`` traces the call as the opaque attention op (nothing of the kernel's
    launcher is traced); at run time that op runs the switched-on kernel."""
    case = make_case(4, 2, torch.bfloat16, seed=9)
    case["k_cache"] = quantize_kv(case["k_cache"], SCALES.k)
    case["v_cache"] = quantize_kv(case["v_cache"], SCALES.v)
    seqused_q = (case["seqused_k"] > 0).to(torch.int32)
    decode_route.set_decode_kernel("triton")
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return paged_decode(*args, **kw)

    monkeypatch.setattr(triton_decode, "paged_decode", counted)

    def step(q, k, v, table, lens, used):
        return kk.paged_attention(q, k, v, AttentionMeta(table, lens, used), softmax_scale=SCALE,
                                  backend=TORCH, kv_scales=SCALES)  # fmt: skip

    kk.prepare_compile()
    torch._dynamo.reset()
    args = (*case.values(), seqused_q)
    got = torch.compile(step, fullgraph=True, backend="eager", dynamic=False)(*args)
    assert calls == [1]
    assert_close(got[:, 0], reference(case, SCALES))


def test_model_decodes_over_fp8_pages_through_the_kernel(interpreted, monkeypatch) -> None:
    """The md3 fixture's decode over FP8 pages with the switch on: every layer of every decode
    step runs the kernel (prefill keeps the torch reference), and the logits equal those of
    the switch off."""
    from kestrel.moondream.model import MoondreamModel
    from kestrel.runtime.runtime import MoondreamRuntime
    from kestrel.tokens import TextToken
    from tests.conftest import FIXTURES

    model = MoondreamModel.from_pretrained(FIXTURES / "md3-tiny-a-fp8")
    layers = model.config.text.n_layers
    scales = [KvScales(torch.tensor([0.5]), torch.tensor([0.3])) for _ in range(layers)]
    prompt = [TextToken(i) for i in (0, 439, 2, 302, 333, 272, 271, 3)]
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return paged_decode(*args, **kw)

    monkeypatch.setattr(triton_decode, "paged_decode", counted)

    def run() -> torch.Tensor:
        rt = MoondreamRuntime(model, kv_cache_pages=600, max_batch_size=2, kv_scales=scales,
                              enable_prefix_cache=False)  # fmt: skip
        state, logits = rt.start_sequence(prompt, None, max_new_tokens=4)
        out = [logits]
        for t in range(3):
            out.append(rt.decode_step([state], [TextToken(100 + 7 * t)])[0])
        return torch.stack(out)

    with torch.inference_mode():
        decode_route.set_decode_kernel("fa")
        want = run()
        assert calls == []
        decode_route.set_decode_kernel("triton")
        got = run()
    assert len(calls) == 3 * layers
    assert_close(got, want, rel=1e-5)


def test_switch_read_from_the_environment() -> None:
    code = (
        "import importlib, os; import kestrel_kernels as kk\n"
        "from kestrel_kernels import decode_route\n"
        "print(kk.get_decode_kernel())\n"
        "os.environ['KESTREL_DECODE_KERNEL'] = 'cuda'\n"
        "try:\n    importlib.reload(decode_route)\nexcept kk.KernelInputError as e:\n    print(e)\n"
    )
    env = {**os.environ, "KESTREL_DECODE_KERNEL": "triton"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "triton" and "KESTREL_DECODE_KERNEL='cuda'" in lines[1]


def test_kernels_compile_for_sm90(tmp_path) -> None:
    """The split kernel (bf16 and FP8 pages) and the combine kernel build for an H100 (sm_90)
    here, no GPU needed, with no register spills (a fresh process: no interpreter); so does
    the split kernel in every launch configuration the start-up measurement tries."""
    code = (
        "import json, sys; from kestrel_kernels.triton_decode import sm90_build\n"
        "from kestrel_kernels.decode_tune import CANDIDATES\n"
        "for name in ('split', 'split_fp8', 'combine'):\n"
        "    r = sm90_build(name, sys.argv[1]); r.pop('report')\n"
        "    print(json.dumps({name: r}))\n"
        "for i, c in enumerate(CANDIDATES[1:]):\n"
        "    r = sm90_build('split', sys.argv[1], c); r.pop('report')\n"
        "    print(json.dumps({f'split {c}': r}))\n"
    )
    builds = {}
    for line in sm90_builds(code, tmp_path, timeout=600):
        builds.update(line)
    assert {"split", "split_fp8", "combine"} <= set(builds) and len(builds) == 7
    for got in builds.values():
        assert_built(got, max_registers=128)
