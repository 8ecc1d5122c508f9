"""The LoRA training forward (``tiny/train_forward.py``) on Moondream 3 (md3-tiny-a: tau in
every layer, MoE layers 1-2): a packed row (BOS + image + two question segments) gives the
runtime's prefill logits for each segment, with and without an adapter (whose MoE-layer MLP
pairs are ignored, as the runtime ignores them), and gradients flow through the experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.crops.overlap import overlap_crops
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.text import lm_head
from kestrel.moondream.vision import normalize_pixels
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tiny import train_forward as tf
from kestrel.tokens import TextToken
from tests.integration.test_adapters_md3 import CONFIG, IMAGE, MD3, random_adapter
from tests.tolerance import assert_close

QUESTIONS = ("What color is the circle?", "How many shapes are there?")


@pytest.fixture(scope="module")
def rt() -> MoondreamRuntime:
    return MoondreamRuntime.from_pretrained(
        MD3, device="cpu", dtype=torch.float32, kv_cache_pages=3000
    )


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.asarray(Image.open(IMAGE).convert("RGB"))


def prompt_ids(rt: MoondreamRuntime, question: str) -> list[int]:
    """The query prompt after BOS (md3's template: the answer marker once)."""
    q = rt.config.tokenizer.templates["query"]
    return [*q["prefix"], *rt.tokenizer.encode(question), *q["suffix"]]


def runtime_logits(rt, image, ids: list[int], adapter: LoraAdapter | None) -> torch.Tensor:
    tokens = [TextToken(rt.config.tokenizer.bos_id), *(TextToken(i) for i in ids)]
    with torch.inference_mode():
        state, logits = rt.start_sequence(tokens, image, adapter=adapter)
        rt.release_sequence(state)
    return logits


def packed_hidden(rt, image, prompts: list[list[int]], adapter, grad: bool = False):
    model = rt.model
    none = tf.NO_TARGET
    segments = [
        tf.Segment(tuple(map(TextToken, ids)), (none,) * len(ids), (none,) * len(ids),
                   (None,) * len(ids))
        for ids in prompts
    ]  # fmt: skip
    crops = overlap_crops(image, model.config.vision)
    pixels = normalize_pixels(crops.crops, model.dtype)
    batch = tf.pack([segments], model.config)
    img = tf.image_embeddings([pixels], [tuple(crops.tiling)], model)
    x = tf.embed_packed(batch, img, model, model.config.tokenizer.bos_id).requires_grad_(grad)
    hidden = tf.dense_text_forward(
        x, model.text, model.config.text, positions_BT=batch.positions, mask_B1TT=batch.mask,
        lora=adapter,
    )  # fmt: skip
    return x, hidden[0]


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_training_forward_matches_the_runtime(rt, image, with_adapter: bool) -> None:
    adapter = LoraAdapter.from_tensors("a", random_adapter(4), CONFIG) if with_adapter else None
    prompts = [prompt_ids(rt, q) for q in QUESTIONS]
    with torch.no_grad():
        _, hidden = packed_hidden(rt, image, prompts, adapter)
    end = rt.config.prefix_len
    for ids in prompts:  # the second segment is not the first in its row
        end += len(ids)
        got = lm_head(hidden[end - 1][None], rt.model.text)[0]
        want = runtime_logits(rt, image, ids, adapter)
        assert_close(got, want, rel=0.0002)
    if adapter is not None:  # the adapter changed the answer's logits: it was applied
        base = runtime_logits(rt, image, prompts[0], None)
        assert (runtime_logits(rt, image, prompts[0], adapter) - base).abs().max() > 1e-2


def test_moe_adapter_mlp_pairs_are_ignored_and_gradients_flow(rt, image) -> None:
    prompts = [prompt_ids(rt, QUESTIONS[0])]
    a = LoraAdapter.from_tensors("a", random_adapter(5, moe_mlp_seed=1), CONFIG)
    b = LoraAdapter.from_tensors("b", random_adapter(5, moe_mlp_seed=2), CONFIG)
    with torch.no_grad():
        assert torch.equal(packed_hidden(rt, image, prompts, a)[1],
                           packed_hidden(rt, image, prompts, b)[1])  # fmt: skip
    x, hidden = packed_hidden(rt, image, prompts, a, grad=True)
    hidden[-1].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
