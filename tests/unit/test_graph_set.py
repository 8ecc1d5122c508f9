"""Which CUDA graphs a runtime builds (``graph_set.GraphSet.build``), decided on a CPU with
CUDA's support standing in: the vision encoder's whenever nothing is compiled (Moondream 3
and FP8 pages included), prefill's for both families over 16-bit pages, and FP8 decode only
with the Triton decode kernel, whose static decode step over FP8 pages reads nothing back and
equals the eager step."""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream.model import MoondreamModel
from kestrel.runtime import graph_set
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels import contract, decode_route
from kestrel_kernels import moe as kernels_moe
from kestrel_kernels.backends import FLASH, TORCH
from kestrel_kernels.contract import KvScales
from kestrel_kernels.counting import LaunchCounter
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

pytest.importorskip("triton")


@pytest.fixture
def switch():
    before = decode_route.get_decode_kernel()
    yield decode_route.set_decode_kernel
    decode_route.set_decode_kernel(before)


def _built(monkeypatch, fixture: str, *, fp8: bool, compile: bool = False):
    monkeypatch.setattr(graph_set, "graphs_supported", lambda model, backend: True)
    model = MoondreamModel.from_pretrained(FIXTURES / fixture)
    rt = MoondreamRuntime(model, kv_cache_pages=64, max_batch_size=2)
    return graph_set.GraphSet.build(
        model, rt.kv, rt.page_table.page_table, max_batch_size=2, backend=FLASH,
        capture=True, compile=compile, fp8_kv=fp8,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fixture", "fp8", "kernel", "want"),
    [
        ("md2-tiny-a", False, "fa", (True, True, True)),
        ("md2-tiny-a", True, "fa", (False, False, True)),  # scaled decode reads the host
        ("md2-tiny-a", True, "triton", (True, False, True)),
        ("md3-tiny-a", False, "fa", (True, True, True)),  # grouped MoE: static, no sync
        ("md3-tiny-a", True, "triton", (True, False, True)),  # scaled prefill reads the host
    ],
)
def test_which_graphs_are_built(monkeypatch, switch, fixture, fp8, kernel, want) -> None:
    switch(kernel)
    built = _built(monkeypatch, fixture, fp8=fp8)
    assert (built.decode is not None, built.prefill is not None, built.vision is not None) == want


def test_compiled_runtimes_capture_no_vision_or_prefill(monkeypatch) -> None:
    built = _built(monkeypatch, "md2-tiny-a", fp8=False, compile=True)
    assert built.decode is not None and built.decode.compiled is not None
    assert built.prefill is None and built.vision is None


def test_fp8_static_decode_reads_nothing_back(monkeypatch, switch) -> None:
    """The step the decode graphs capture, over FP8 pages through the Triton decode kernel
    (under the interpreter): no host read, and the logits of the eager decode step over the
    same pages through the scaled torch reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the contract's value checks read CPU tensors back; on CUDA they never run (as in
    # scripts/count_kernels.py, they are left out of what is counted)
    monkeypatch.setattr(contract, "_check_values", lambda *args, **kwargs: None)
    # FP8 experts as a GPU without the FP8 grouped GEMM widens them: the stack in one cast
    monkeypatch.setattr(kernels_moe, "widens_per_expert", lambda x: False)
    model = MoondreamModel.from_pretrained(FIXTURES / "md3-tiny-a-fp8")
    layers = model.config.text.n_layers
    scales = [KvScales(torch.tensor([0.5]), torch.tensor([0.3])) for _ in range(layers)]
    prompt = [TextToken(i) for i in (0, 439, 2, 302, 333, 272, 271, 3)]
    logits = {}
    with torch.inference_mode():
        for static in (False, True):
            switch("triton" if static else "fa")
            rt = MoondreamRuntime(model, kv_cache_pages=200, max_batch_size=2,
                                  kv_scales=scales, enable_prefix_cache=False)  # fmt: skip
            if static:
                rt.decode_graphs = graph_set.DecodeGraphs(
                    model, rt.kv, rt.page_table.page_table, max_batch_size=2, backend=TORCH,
                    capture=False,
                )  # fmt: skip
            state, _ = rt.start_sequence(prompt, None, max_new_tokens=4)
            steps = []
            for t in range(2):  # the second step reads the first one's FP8 write
                with LaunchCounter() as c:
                    steps.append(rt.decode_step([state], [TextToken(100 + 7 * t)])[0])
                if static:
                    assert c.syncs == 0, c.by_op
            logits[static] = torch.stack(steps)
            rt.release_sequence(state)
    assert_close(logits[True], logits[False], rel=1e-5)
