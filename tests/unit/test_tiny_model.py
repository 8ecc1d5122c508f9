"""The bundled kestrel-tiny checkpoint: it loads, answers unseen scenes through the eager path,
its adapter answers colours in French, and the training forward is the inference forward."""

from __future__ import annotations

import pytest
import torch

from kestrel.crops.overlap import overlap_crops
from kestrel.moondream import MoondreamModel, MoondreamTokenizer, load_adapter
from kestrel.moondream.text import lm_head
from kestrel.moondream.vision import normalize_pixels
from kestrel.reference.eager import EagerMoondream
from kestrel.tiny import MODEL_DIR, synthetic
from kestrel.tiny.train_forward import (
    NO_TARGET,
    Segment,
    dense_text_forward,
    embed_packed,
    image_embeddings,
    pack,
)
from kestrel.tokens import TextToken
from tests.tolerance import assert_close

TINY = MODEL_DIR
ADAPTER = TINY / "lora-french"
SEED = 424242  # an evaluation stream (never synthetic.TRAIN_SEED)


@pytest.fixture(scope="module")
def eager() -> EagerMoondream:
    model = MoondreamModel.from_pretrained(TINY)
    return EagerMoondream(model, MoondreamTokenizer.from_dir(TINY), backend="torch")


def test_config_is_small_everywhere(eager):
    cfg = eager.model.config
    assert cfg.vision.crop_size == 112 and cfg.image_tokens == 64 and cfg.prefix_len == 65
    assert eager.model.parameter_counts()["total"] < 5_000_000
    size = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert size < 10_000_000


def test_answers_unseen_scenes(eager):
    cases = synthetic.eval_cases(SEED, 24)
    query = point = detect = 0
    for case in cases:
        enc = eager.encode_image(case.scene.image)
        answer = eager.query(enc, case.query.question).answer
        query += synthetic.normalize_answer(answer) == case.query.answer
        pts = [(p.x, p.y) for p in eager.point(enc, case.point.obj, max_objects=8).objects]
        point += synthetic.points_match(pts, case.point.points)
        boxes = eager.detect(enc, case.detect.obj, max_objects=8).objects
        pred = [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes]
        detect += synthetic.boxes_match(pred, case.detect.boxes)
    n = len(cases)
    assert query / n >= 0.75 and point / n >= 0.65 and detect / n >= 0.55, (query, point, detect)


def test_captions_list_the_shapes(eager):
    scenes = list(synthetic.scenes(SEED, 16))
    exact = 0
    for scene in scenes:
        result = eager.caption(scene.image, "short", max_tokens=40)
        assert result.finish_reason == "eos"
        exact += synthetic.normalize_answer(result.answer) == scene.caption("short").rstrip(".")
    assert exact >= len(scenes) // 3, exact  # 7 of 16 when shipped


def test_adapter_answers_colours_in_french(eager):
    lora = load_adapter(ADAPTER, eager.model.config, dtype=eager.model.dtype)
    cases = [c for c in synthetic.eval_cases(SEED, 60) if c.query.kind == "color"][:6]
    french = english = 0
    for case in cases:
        q = case.query.question
        french += (
            eager.query(case.scene.image, q, adapter=lora).answer.strip()
            == (synthetic.FRENCH_COLORS[case.query.answer])
        )
        english += eager.query(case.scene.image, q).answer.strip() == case.query.answer
    assert french >= len(cases) - 1 and english >= len(cases) - 1, (french, english)


def test_training_forward_matches_the_eager_prefill(eager):
    """Same prompt after the same image: the packed dense forward reproduces the eager logits,
    including for a segment that is not the first one in its row."""
    model, scene = eager.model, synthetic.make_scene(SEED, 0)
    questions = ["How many shapes are there?", "Is there a circle?"]
    results = [eager.query(scene.image, q, record=True) for q in questions]
    segments = [
        Segment(
            tuple(TextToken(i) for i in r.prompt_ids),
            (NO_TARGET,) * len(r.prompt_ids),
            (NO_TARGET,) * len(r.prompt_ids),
            (None,) * len(r.prompt_ids),
        )
        for r in results
    ]
    crops = overlap_crops(scene.image, model.config.vision)
    pixels = normalize_pixels(crops.crops, model.dtype)
    batch = pack([segments], model.config)
    with torch.no_grad():
        img = image_embeddings([pixels], [tuple(crops.tiling)], model)
        x = embed_packed(batch, img, model, model.config.tokenizer.bos_id)
        hidden = dense_text_forward(
            x, model.text, model.config.text, positions_BT=batch.positions, mask_B1TT=batch.mask
        )[0]
    end = model.config.prefix_len
    for r in results:
        end += len(r.prompt_ids)
        logits = lm_head(hidden[end - 1][None], model.text)[0]
        assert_close(logits, r.phase.prefill_logits, rel=0.0002)
