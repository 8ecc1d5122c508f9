"""kestrel.tiny.synthetic: deterministic scenes whose answers and targets match their pixels."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel.tiny import synthetic
from kestrel.tiny.synthetic import COLORS, SHAPES, make_scene, scenes

SCENES = list(scenes(7, 60))


def test_same_seed_same_scene_and_other_seeds_differ():
    a, b = make_scene(7, 3), make_scene(7, 3)
    assert np.array_equal(a.image, b.image)
    assert a.shapes == b.shapes and a.queries() == b.queries()
    assert a.caption("normal") == b.caption("normal")
    others = [make_scene(8, 3), make_scene(7, 4)]
    assert all(not np.array_equal(a.image, o.image) or a.shapes != o.shapes for o in others)


def test_image_layout():
    sizes = set()
    for s in SCENES:
        assert s.image.dtype == np.uint8 and s.image.shape == (s.height, s.width, 3)
        assert not s.image.flags.writeable
        assert 1 <= len(s.shapes) <= 4
        sizes.add((s.width, s.height))
    assert any(w != h for w, h in sizes), "some images must not be square"
    assert {s.background for s in SCENES} == {"plain", "noisy"}


def test_targets_inside_image_and_disjoint():
    for s in SCENES:
        for sh in s.shapes:
            x0, y0, x1, y1 = sh.box
            assert 0.0 <= x0 < sh.center[0] < x1 <= 1.0
            assert 0.0 <= y0 < sh.center[1] < y1 <= 1.0
        for i, a in enumerate(s.shapes):
            for b in s.shapes[i + 1 :]:
                assert synthetic.box_iou(a.box, b.box) == 0.0


def test_shape_colour_is_drawn_at_its_centre():
    for s in SCENES:
        for sh in s.shapes:
            px = s.image[int(sh.center[1] * s.height), int(sh.center[0] * s.width)]
            assert tuple(int(v) for v in px) == COLORS[sh.color], (s.index, sh)


def _check(scene: synthetic.Scene, q: synthetic.QAItem) -> None:
    kinds = [s.kind for s in scene.shapes]
    names = [s.name for s in scene.shapes]
    words = q.question.rstrip("?").split()
    if q.kind == "count":
        assert q.answer == str(len(scene.shapes))
    elif q.kind == "count_kind":
        assert q.answer == str(kinds.count(words[2][:-1]))
    elif q.kind == "exists":
        target = " ".join(words[3:])
        assert q.answer == ("yes" if target in kinds or target in names else "no")
    elif q.kind == "color":
        assert kinds.count(words[-1]) == 1  # unambiguous
        assert q.answer == scene.shapes[kinds.index(words[-1])].color
    elif q.kind == "shape":
        colors = [s.color for s in scene.shapes]
        assert colors.count(words[-1]) == 1
        assert q.answer == scene.shapes[colors.index(words[-1])].kind
    else:
        ref = scene.shapes[names.index(" ".join(words[-2:]))]
        sign = -1 if q.kind == "left" else 1
        side = [s.name for s in scene.shapes if sign * (s.center[0] - ref.center[0]) > 0]
        assert q.answer == (side[0] if side else "nothing") and len(side) <= 1


def test_answers_match_ground_truth():
    seen = set()
    for s in SCENES:
        for q in s.queries():
            _check(s, q)
            seen.add(q.kind)
    assert seen == {"count", "count_kind", "exists", "color", "shape", "left", "right"}


def test_regions_and_captions():
    for s in SCENES:
        for r in s.region_items():
            match = [sh for sh in s.shapes if r.obj in (sh.kind, sh.name)]
            assert r.points == tuple(sh.center for sh in match)
            assert r.boxes == tuple(sh.box for sh in match)
            assert list(r.points) == sorted(r.points)  # left to right
        assert all(sh.name in s.caption("short") for sh in s.shapes)
        assert all(f"{sh.size} {sh.name}" in s.caption("normal") for sh in s.shapes)
    assert {k for s in SCENES for r in s.region_items() if not r.points for k in [r.obj]} <= set(
        SHAPES
    )


def test_eval_cases_are_deterministic_and_never_the_training_stream():
    with pytest.raises(ValueError):
        synthetic.eval_cases(synthetic.TRAIN_SEED, 3)
    a, b = synthetic.eval_cases(5, 12), synthetic.eval_cases(5, 12)
    assert [(c.query, c.point, c.detect) for c in a] == [(c.query, c.point, c.detect) for c in b]
    for c in a:
        assert c.query in c.scene.queries() and c.point.points and c.detect.boxes


def test_scoring_helpers():
    truth = ((0.2, 0.2), (0.8, 0.5))
    assert synthetic.points_match([(0.81, 0.52), (0.2, 0.23)], truth)
    assert not synthetic.points_match([(0.2, 0.2), (0.2, 0.21)], truth)  # both on one centre
    assert not synthetic.points_match([(0.2, 0.2)], truth)
    box = (0.1, 0.1, 0.5, 0.5)
    assert synthetic.box_iou(box, box) == pytest.approx(1.0)
    assert synthetic.box_iou(box, (0.3, 0.1, 0.7, 0.5)) == pytest.approx(1 / 3)
    assert synthetic.boxes_match([(0.12, 0.1, 0.5, 0.52)], [box])
    assert not synthetic.boxes_match([(0.3, 0.1, 0.7, 0.5)], [box])
    assert synthetic.normalize_answer(" Blue. ") == "blue"
