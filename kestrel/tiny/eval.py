"""Accuracy of a model on synthetic scenes, measured through the public Engine.

Shared by ``scripts/eval_tiny.py``, ``kestrel demo`` and the oracle tests. Every request of an
evaluation is submitted at once (the engine batches them) and scored with the rules of
``kestrel.tiny.synthetic``: a query is right on an exact match of the normalized answer; a point
request when every true center has its own predicted point within 0.05; a detect request when
every true box has its own predicted box with IoU >= 0.5 (counts must agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kestrel.tiny import synthetic

__all__ = ["EvalReport", "Outcome", "evaluate", "submit_case"]

GREEDY = {"temperature": 0.0, "max_tokens": 16}
REGIONS = {"max_objects": 8}


@dataclass(frozen=True, slots=True)
class Outcome:
    """The engine's answers for one EvalCase and whether each was right."""

    answer: str
    points: tuple[tuple[float, float], ...]
    boxes: tuple[tuple[float, float, float, float], ...]
    query_ok: bool
    point_ok: bool
    detect_ok: bool
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class EvalReport:
    n: int
    query_acc: float
    point_acc: float
    detect_acc: float
    by_kind: dict[str, tuple[int, int]]  # query kind -> (right, asked)
    outcomes: tuple[Outcome, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_acc": round(self.query_acc, 4),
            "point_acc": round(self.point_acc, 4),
            "detect_acc": round(self.detect_acc, 4),
            "n": self.n,
        }


def submit_case(
    engine, case: synthetic.EvalCase, *, adapter: str | None = None, image: Any = None
) -> tuple[Future, Future, Future]:
    """Submit the query, point and detect requests of one case (image prepared by the caller
    or here)."""
    img = image if image is not None else engine.prepare_image(case.scene.image)
    return (
        engine.submit_query(img, case.query.question, settings=GREEDY, adapter=adapter),
        engine.submit_point(img, case.point.obj, settings=REGIONS, adapter=adapter),
        engine.submit_detect(img, case.detect.obj, settings=REGIONS, adapter=adapter),
    )


def score(case: synthetic.EvalCase, q, p, d, *, expect: Callable[[str], str] | None = None):
    """Score one case's results; ``expect`` maps the true answer (e.g. to French)."""
    answer = synthetic.normalize_answer(q.answer)
    truth = case.query.answer if expect is None else expect(case.query.answer)
    points = tuple((pt["x"], pt["y"]) for pt in p.points)
    boxes = tuple((b["x_min"], b["y_min"], b["x_max"], b["y_max"]) for b in d.objects)
    return Outcome(
        answer=answer,
        points=points,
        boxes=boxes,
        query_ok=answer == truth,
        point_ok=synthetic.points_match(points, case.point.points),
        detect_ok=synthetic.boxes_match(boxes, case.detect.boxes),
        cached_tokens=q.metrics.cached_tokens,
    )


def evaluate(
    engine,
    cases: Sequence[synthetic.EvalCase],
    *,
    adapter: str | None = None,
    expect: Callable[[str], str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> EvalReport:
    """Run every case through ``engine`` concurrently and score it."""
    futures = [submit_case(engine, c, adapter=adapter) for c in cases]
    outcomes = []
    for case, (fq, fp, fd) in zip(cases, futures, strict=True):
        outcomes.append(score(case, fq.result(), fp.result(), fd.result(), expect=expect))
        if progress is not None:
            progress(1)
    return report(cases, outcomes)


def report(cases: Sequence[synthetic.EvalCase], outcomes: Sequence[Outcome]) -> EvalReport:
    n = len(outcomes)
    by_kind: dict[str, list[int]] = {}
    for case, o in zip(cases, outcomes, strict=True):
        right, asked = by_kind.get(case.query.kind, [0, 0])
        by_kind[case.query.kind] = [right + o.query_ok, asked + 1]
    return EvalReport(
        n=n,
        query_acc=sum(o.query_ok for o in outcomes) / max(n, 1),
        point_acc=sum(o.point_ok for o in outcomes) / max(n, 1),
        detect_acc=sum(o.detect_ok for o in outcomes) / max(n, 1),
        by_kind={k: (v[0], v[1]) for k, v in sorted(by_kind.items())},
        outcomes=tuple(outcomes),
    )
