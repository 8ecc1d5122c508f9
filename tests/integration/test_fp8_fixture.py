"""Conformance on md3-tiny-a-fp8 (md3-tiny-a in the published FP8 form, see its README).

Golden cases of md3-tiny-a (every kind: query, text-only, spatial refs, caption, reasoning,
point, detect) run on three models through the eager oracle:
- ``fp8``: md3-tiny-a-fp8 as loaded (experts float8_e4m3 in memory, dequantised on use);
- ``deq``: md3-tiny-a with each expert matrix replaced by ``q.float() * scale`` read straight
  from the FP8 file (built here, independent of the loader): the same arithmetic, so every
  tensor and decision must agree to float32 rounding (``SAME_MODEL``, a bound scaled to each
  tensor's largest magnitude);
- md3-tiny-a's goldens (the first-party reference on the 16-bit experts): the FP8 model stays
  within the FP8 error of them (``FP8_LOGITS``, measured and stated below) and takes every
  decision whose golden margin is well above that error.
Then the Engine: answers on md3-tiny-a-fp8 (FP8 experts) equal those with
``moe_weights="dequantize"`` and the eager ``deq`` model's, cache on and off, batched and alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.weights import load_config, load_state_dict
from kestrel.reference.eager import EagerMoondream
from tests.conformance.cases import run_case
from tests.conformance.golden import Golden, load_golden
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle  # noqa: F401
from tests.integration.test_engine_md3 import _submit
from tests.tolerance import assert_close

MD3, FP8 = FIXTURES / "md3-tiny-a", FIXTURES / "md3-tiny-a-fp8"
GOLDEN = load_golden(MD3)
# every kind of case over two of the images (the other images add runtime, not coverage)
KEPT = ("query_shapes", "query_text_only", "query_spatial_refs", "caption_long_shapes",
        "point_shapes_circle", "detect_scene_square", "query_reasoning_shapes")  # fmt: skip
CASES = [c for c in GOLDEN.meta["cases"] if c["id"] in KEPT]
TEXT = [c for c in CASES if c["kind"] not in ("point", "detect")]
# float32 rounding of one model run two ways (the experts dequantised on use against ahead of
# time: other kernels, other summation orders): a few ulps of each tensor's largest magnitude,
# see tests/tolerance.py. Measured up to ~3e-7 of the scale (AVX2 and AVX-512 CPUs); 1e-5 is
# ~80x the float32 epsilon and far below any FP8 effect (FP8_LOGITS is ~1e-2 of the scale).
SAME_MODEL = 1e-5
# The FP8 error of md3-tiny-a's logits: e4m3 rounds each expert weight by up to 2^-4 of its
# row's largest. Measured on these cases' prefill logits (largest |logit| 40-57): 0.16-0.18,
# 0.49 for the text-only query. The bound is 0.75; a golden decision is required only where
# its margin exceeds twice that (smaller margins, down to 0.02 here, may flip under FP8).
FP8_LOGITS = 0.75


class ModelRunner:
    """What ``tests.conformance.cases.run_case`` needs: an eager model, the fixture's crops."""

    def __init__(self, golden: Golden, model: MoondreamModel, tokenizer_dir: Path) -> None:
        self.golden, self.model = golden, model
        self.eager = EagerMoondream(model, MoondreamTokenizer.from_dir(tokenizer_dir))
        self.runs: dict[str, object] = {}
        self._encoded: dict[str, object] = {}

    def adapter(self):
        raise AssertionError("md3-tiny-a has no adapter case")

    def encoded(self, name: str, adapter=None):
        from kestrel.moondream.vision import encode_image_with_intermediates

        if name not in self._encoded:
            px, tiling = self.golden.pixels(name), tuple(self.golden.image(name)["tiling"])
            with torch.inference_mode():
                vis = encode_image_with_intermediates(
                    px, tiling, self.model.vision, self.model.config.vision
                )
            self._encoded[name] = self.eager.encode_embeddings(vis.img_emb, tiling)
        return self._encoded[name]


def dequantised_md3() -> MoondreamModel:
    """md3-tiny-a with the FP8 file's experts, dequantised here by the format's rule."""
    config = load_config(MD3)
    sd = load_state_dict(MD3, config)
    raw = load_file(str(FP8 / "model.safetensors"))
    layer = "text_model.transformer.h"
    for i in (1, 2):
        for fc, stack, scale in (("fc1", "experts", "up"), ("fc2", "output_experts", "down")):
            q = raw[f"{layer}.{i}.mlp.{stack}.weight"]
            s = raw[f"{layer}.{i}.moe_quant.{scale}_scale"]
            sd[f"text.blocks.{i}.mlp.{fc}.weight"] = q.float() * s[..., None]
    return MoondreamModel.from_state_dict(sd, config)


@pytest.fixture(scope="module")
def fp8() -> ModelRunner:
    model = MoondreamModel.from_pretrained(FP8, dtype=torch.float32)
    assert model.text.blocks[1].moe.fp8
    return ModelRunner(GOLDEN, model, FP8)


@pytest.fixture(scope="module")
def deq() -> ModelRunner:
    return ModelRunner(GOLDEN, dequantised_md3(), MD3)


def assert_same(a: object, b: object, where: str) -> None:
    """Equal results: float tensors within ``SAME_MODEL`` of their scale, everything else
    (token ids, decisions, integer tensors) identical."""
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        assert_close(a, b, rel=SAME_MODEL, msg=where)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where  # integers: ids and decisions are exact
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fp8_equals_the_dequantised_model(case: dict, fp8, deq) -> None:
    assert_same(run_case(fp8, case), run_case(deq, case), case["id"])


def _phases(out, case: dict):
    """(phase, golden prefix, golden ids) of a text case's result."""
    if case["kind"] == "query_reasoning":
        yield out.reasoning.phase, "", case["greedy_ids"]
        if list(out.reasoning.token_ids) == case["greedy_ids"]:
            yield out.phase, "answer.", case["answer"]["emitted"]
    else:
        yield out.phase, "", case["greedy_ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fp8_within_fp8_error_of_md3(case: dict, fp8) -> None:
    """Prefill logits within FP8_LOGITS of the reference's; each decision whose golden margin
    exceeds 2 * FP8_LOGITS is taken, up to the first one that is not that clear."""
    out, names, T = run_case(fp8, case), case["tensors"], GOLDEN.tensors
    if case["kind"] in ("point", "detect"):
        err = float((out.prefill_logits - T[names["prefill_logits"]]).abs().max())
        assert 0 < err <= FP8_LOGITS, f"{case['id']}: prefill logits moved {err}"
        return
    margins = [s["margin"] for s in case["steps"]]
    for phase, prefix, ref_ids in _phases(out, case):
        ref = T[names[f"{prefix}prefill_logits"]]
        err = float((phase.prefill_logits - ref).abs().max())
        assert 0 < err <= FP8_LOGITS, f"{case['id']}: {prefix}prefill logits moved {err}"
        if prefix:
            margins = [s["margin"] for s in case["answer"]["steps"]]
        for k, (mine, want) in enumerate(zip(phase.token_ids, ref_ids, strict=False)):
            if margins[k] <= 2 * FP8_LOGITS:
                break  # a near decision may go either way under FP8 error
            assert mine == want, f"{case['id']}: {prefix}decision {k} (margin {margins[k]:.3g})"


def _result_key(case: dict, result) -> tuple:
    if case["kind"] == "point":
        return tuple((p["x"], p["y"]) for p in result.points)
    if case["kind"] == "detect":
        return tuple(tuple(o.values()) for o in result.objects)
    if case["kind"] == "caption":
        return tuple(result.tokens), result.caption
    reasoning = result.reasoning.text if result.reasoning else None
    return tuple(result.tokens), result.answer, reasoning


@pytest.fixture(scope="module")
def engine_answers(deq) -> dict[str, tuple]:
    """Reference answers: an Engine with the experts dequantised at load, one at a time;
    its query / caption tokens are first checked against the eager ``deq`` model's."""
    from kestrel import Engine

    with Engine(str(FP8), device="cpu", kv_cache_pages=8000, moe_weights="dequantize") as e:
        assert not e.runtime.model.text.blocks[1].moe.fp8
        answers = {c["id"]: _result_key(c, _submit(e, c).result()) for c in CASES}
    for case in TEXT:
        if case["kind"] in ("query", "caption"):
            assert list(answers[case["id"]][0]) == list(run_case(deq, case).token_ids)
    return answers


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_engine_fp8_answers_equal_dequantised(make_engine, engine_answers, cache: bool) -> None:
    """FP8 experts in memory: every case submitted at once (batched prefill and decode), then
    one at a time (with the cache on, the second round hits it)."""
    engine = make_engine(model=str(FP8), enable_prefix_cache=cache, kv_cache_pages=8000)
    assert engine.runtime.model.text.blocks[1].moe.fp8
    batched = [(c, _submit(engine, c)) for c in CASES]
    for case, future in batched:
        assert _result_key(case, future.result()) == engine_answers[case["id"]], case["id"]
    for case in CASES:
        assert _result_key(case, _submit(engine, case).result()) == engine_answers[case["id"]]
    if cache:
        assert engine.stats().vision_encodes_skipped > 0
