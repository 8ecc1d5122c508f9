"""The opt-in ``torch.compile`` path on a CUDA GPU, bf16, with the FlashAttention backend.

The compiled decode step replaces ``decode_static`` inside ``DecodeGraphs`` (compiled in the
warm-up, then captured into the bucket's CUDA graph, as ``compile=True`` does) and the compiled
prefill replaces ``prefill_batch``; logits and greedy tokens must match the eager runtime's.
Tolerance as in ``test_runtime_gpu``: 3% of the largest |logit| plus 0.05 (bf16, different
fusion and summation order). Skips without CUDA (tests/conftest.py), without an sm90 GPU or
flash-attn-4, or where inductor cannot compile (no triton).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kestrel.runtime.cuda_graphs as graphs_mod
import kestrel.runtime.runtime as runtime_mod
from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.compiled import CompiledDecode, CompiledPrefill, compile_unavailable_reason
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels import fa_backend
from tests.conftest import fixture_dir

pytestmark = pytest.mark.gpu

STEPS = 6


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    reason = compile_unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    return MoondreamModel.from_pretrained(fixture_dir(), device="cuda", dtype=torch.bfloat16)


def _generate(model: MoondreamModel, image: np.ndarray) -> tuple[list[torch.Tensor], list]:
    rt = MoondreamRuntime(
        model, kv_cache_pages=4000, max_batch_size=4, attention_backend="fa", cuda_graphs=True
    )
    rt.prefill_graphs = None  # the prefill under test is prefill_batch (eager or compiled)
    bos = TextToken(model.config.tokenizer.bos_id)
    prompts = [[bos, *(TextToken(300 + i) for i in range(n))] for n in (9, 4, 6)]
    states = [rt.prepare_sequence(p, image if i < 2 else None, max_new_tokens=STEPS + 1)
              for i, p in enumerate(prompts)]  # fmt: skip
    hidden, logits = rt.prefill_sequences(states)
    for s, h in zip(states, hidden, strict=True):
        rt.commit_sequence(s, h)
    out, tokens = [logits.float().cpu()], [logits.argmax(-1).tolist()]
    for _ in range(STEPS):
        logits = rt.decode_step(states, [TextToken(t) for t in tokens[-1]])
        out.append(logits.float().cpu())
        tokens.append(logits.argmax(-1).tolist())
    assert rt.decode_graphs is not None and rt.decode_graphs.captured == (1, 2, 4)
    for s in states:
        rt.release_sequence(s)
    rt.check_integrity()
    return out, tokens


def test_compiled_decode_and_prefill_match_eager_on_cuda(model, monkeypatch) -> None:
    image = np.random.default_rng(0).integers(0, 256, (378, 378, 3), dtype=np.uint8)
    eager, eager_tokens = _generate(model, image)
    monkeypatch.setattr(graphs_mod, "decode_static", CompiledDecode())
    monkeypatch.setattr(runtime_mod, "prefill_batch", CompiledPrefill().prefill_batch)
    compiled, compiled_tokens = _generate(model, image)
    for got, want in zip(compiled, eager, strict=True):
        bound = 0.03 * float(want.abs().max()) + 0.05
        assert float((got - want).abs().max()) <= bound
    assert compiled_tokens[0] == eager_tokens[0]  # the prefill's choice
