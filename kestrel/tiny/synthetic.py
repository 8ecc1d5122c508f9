"""Synthetic scenes: simple coloured shapes with questions, captions and region targets.

The tiny bundled model (``kestrel/tiny/assets/model``) is trained on these scenes, and the eval, the
demo and the oracle tests draw unseen ones from other seeds. Everything is a pure function of
``(seed, index)``: ``make_scene(seed, i)`` always gives the same pixels and the same questions.

A scene holds 1-4 non-overlapping shapes (circle, square, triangle) in one of five colours and
three sizes, on a plain or noisy light background; images are 96-144 px a side, some not square.
Coordinates are image fractions in [0, 1]: ``center`` (the point target) and ``box``
(x_min, y_min, x_max, y_max, the detect target). Questions are only asked when their answer is
unambiguous (e.g. "What color is the circle?" only when there is exactly one circle); answers are
lower-case words or digits, compared after ``normalize_answer``.

Seed ``TRAIN_SEED`` is the training stream; evaluations must use any other seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "COLORS",
    "FRENCH_COLORS",
    "SHAPES",
    "TRAIN_SEED",
    "EvalCase",
    "QAItem",
    "RegionItem",
    "Scene",
    "Shape",
    "box_iou",
    "boxes_match",
    "eval_cases",
    "make_scene",
    "normalize_answer",
    "points_match",
    "scenes",
]

TRAIN_SEED = 0
SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (230, 195, 20),
    "purple": (140, 55, 175),
}
FRENCH_COLORS = {
    "red": "rouge",
    "green": "vert",
    "blue": "bleu",
    "yellow": "jaune",
    "purple": "violet",
}
# Half-extent of a shape as a fraction of the image's short side.
SIZES = {"small": 0.12, "medium": 0.16, "large": 0.21}
# (width, height); the short side is at most 112 px, so the tiny model sees one local crop.
IMAGE_SIZES = ((112, 112), (112, 112), (144, 112), (112, 144), (128, 96), (96, 128))
BACKGROUNDS = ((250, 250, 250), (225, 225, 225), (245, 235, 215), (215, 230, 240))
NUMBERS = ("0", "1", "2", "3", "4")
_MIN_DX = 0.06  # left/right questions skip shapes closer than this horizontally


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str
    color: str
    size: str
    center: tuple[float, float]  # (x, y) image fractions
    box: tuple[float, float, float, float]  # (x_min, y_min, x_max, y_max) image fractions

    @property
    def name(self) -> str:
        return f"{self.color} {self.kind}"


@dataclass(frozen=True, slots=True)
class QAItem:
    kind: str  # color | shape | count | count_kind | exists | left | right
    question: str
    answer: str


@dataclass(frozen=True, slots=True)
class RegionItem:
    """Every shape an object name refers to, left to right (empty when there is none)."""

    obj: str
    points: tuple[tuple[float, float], ...]
    boxes: tuple[tuple[float, float, float, float], ...]


@dataclass(frozen=True, slots=True, eq=False)
class Scene:
    seed: int
    index: int
    width: int
    height: int
    background: str  # plain | noisy
    shapes: tuple[Shape, ...]  # sorted left to right by center x
    image: np.ndarray  # H x W x 3 uint8, read-only

    def pil(self) -> Image.Image:
        return Image.fromarray(self.image)

    def queries(self) -> tuple[QAItem, ...]:
        """Every unambiguous question about the scene, in a fixed order."""
        return _queries(self.shapes)

    def caption(self, length: str = "normal") -> str:
        """``short``: the shapes left to right; ``normal`` / ``long``: with sizes and background."""
        return _caption(self, length)

    def region(self, obj: str) -> RegionItem:
        """Targets of ``obj`` ("circle" or "red circle"): every matching shape, left to right."""
        match = [s for s in self.shapes if obj in (s.kind, s.name)]
        return RegionItem(obj, tuple(s.center for s in match), tuple(s.box for s in match))

    def region_items(self) -> tuple[RegionItem, ...]:
        """Regions of every kind and colour+kind present, then the absent kinds (empty)."""
        names = sorted({s.kind for s in self.shapes}) + sorted({s.name for s in self.shapes})
        absent = [k for k in SHAPES if all(s.kind != k for s in self.shapes)]
        return tuple(self.region(n) for n in [*names, *absent])


@dataclass(frozen=True, slots=True, eq=False)
class EvalCase:
    """One scene with one question, one point request and one detect request (objects present)."""

    scene: Scene
    query: QAItem
    point: RegionItem
    detect: RegionItem


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, index]))


def _place(rng: np.random.Generator, w: int, h: int, n: int) -> list[tuple[str, str, str, tuple]]:
    """Draw up to ``n`` shapes whose pixel boxes keep a gap from each other and the border."""
    placed: list[tuple[str, str, str, tuple]] = []
    short = min(w, h)
    for _ in range(n):
        kind = SHAPES[rng.integers(len(SHAPES))]
        color = list(COLORS)[rng.integers(len(COLORS))]
        size = list(SIZES)[rng.integers(len(SIZES))]
        r = SIZES[size] * short
        for _attempt in range(60):
            cx, cy = rng.uniform(r + 2, w - r - 2), rng.uniform(r + 2, h - r - 2)
            px = (cx - r, cy - r, cx + r, cy + r)
            if all(_gap(px, q[3]) for q in placed):
                placed.append((kind, color, size, px))
                break
    return placed


def _gap(a: tuple, b: tuple, gap: float = 4.0) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _draw(draw: ImageDraw.ImageDraw, kind: str, rgb: tuple[int, int, int], px: tuple) -> None:
    x0, y0, x1, y1 = px
    if kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=rgb)
    elif kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=rgb)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=rgb)


def _background(rng: np.random.Generator, w: int, h: int) -> tuple[str, np.ndarray]:
    base = np.array(BACKGROUNDS[rng.integers(len(BACKGROUNDS))], dtype=np.float32)
    img = np.broadcast_to(base, (h, w, 3)).copy()
    if rng.random() < 0.5:
        return "plain", img.astype(np.uint8)
    noise = rng.normal(0.0, rng.uniform(8, 24), size=(h, w, 1)).astype(np.float32)
    return "noisy", np.clip(img + noise, 0, 255).astype(np.uint8)


def make_scene(seed: int, index: int = 0) -> Scene:
    """The scene number ``index`` of stream ``seed`` (deterministic)."""
    rng = _rng(seed, index)
    w, h = IMAGE_SIZES[rng.integers(len(IMAGE_SIZES))]
    background, pixels = _background(rng, w, h)
    placed = _place(rng, w, h, int(rng.integers(1, 5)))
    canvas = Image.fromarray(pixels)
    draw = ImageDraw.Draw(canvas)
    shapes = []
    for kind, color, size, px in placed:
        _draw(draw, kind, COLORS[color], px)
        box = (px[0] / w, px[1] / h, px[2] / w, px[3] / h)
        center = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        shapes.append(Shape(kind, color, size, center, box))
    shapes.sort(key=lambda s: s.center)
    image = np.asarray(canvas, dtype=np.uint8).copy()
    image.flags.writeable = False
    return Scene(seed, index, w, h, background, tuple(shapes), image)


def scenes(seed: int, n: int, start: int = 0) -> Iterator[Scene]:
    """Scenes ``start .. start + n - 1`` of stream ``seed``."""
    for i in range(start, start + n):
        yield make_scene(seed, i)


def _plural(kind: str) -> str:
    return kind + "s"


def _side_answer(shapes: tuple[Shape, ...], ref: Shape, side: str) -> str | None:
    """The one shape left/right of ``ref`` ("nothing" if none); None when ambiguous."""
    sign = -1.0 if side == "left" else 1.0
    others = [s for s in shapes if s is not ref]
    if any(abs(s.center[0] - ref.center[0]) < _MIN_DX for s in others):
        return None
    found = [s for s in others if sign * (s.center[0] - ref.center[0]) > 0]
    if not found:
        return "nothing"
    return found[0].name if len(found) == 1 else None


def _queries(shapes: tuple[Shape, ...]) -> tuple[QAItem, ...]:
    kinds = [s.kind for s in shapes]
    colors = [s.color for s in shapes]
    names = [s.name for s in shapes]
    out = [QAItem("count", "How many shapes are there?", NUMBERS[len(shapes)])]
    for k in SHAPES:
        out.append(
            QAItem("count_kind", f"How many {_plural(k)} are there?", NUMBERS[kinds.count(k)])
        )
        out.append(QAItem("exists", f"Is there a {k}?", "yes" if k in kinds else "no"))
        if kinds.count(k) == 1:
            out.append(QAItem("color", f"What color is the {k}?", colors[kinds.index(k)]))
    for c in COLORS:
        if colors.count(c) == 1:
            out.append(QAItem("shape", f"What shape is {c}?", kinds[colors.index(c)]))
        for k in SHAPES:
            answer = "yes" if f"{c} {k}" in names else "no"
            out.append(QAItem("exists", f"Is there a {c} {k}?", answer))
    for s in shapes:
        if names.count(s.name) != 1:
            continue
        for side in ("left", "right"):
            answer = _side_answer(shapes, s, side)
            if answer is not None:
                out.append(QAItem(side, f"What is {side} of the {s.name}?", answer))
    return tuple(out)


_COUNT_WORDS = ("no shapes", "one shape", "two shapes", "three shapes", "four shapes")


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _caption(scene: Scene, length: str) -> str:
    if length == "short":
        return _join([f"a {s.name}" for s in scene.shapes]) + "."
    parts = [f"a {s.size} {s.name}" for s in scene.shapes]
    where = f"on a {scene.background} background"
    return f"{_COUNT_WORDS[len(scene.shapes)]} {where}: {_join(parts)}."


def normalize_answer(text: str) -> str:
    """Lower-case, trimmed, without a final period: the form exact match compares."""
    return text.strip().lower().rstrip(".").strip()


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _one_to_one(n_pred: int, n_true: int, ok) -> bool:
    """True when the counts agree and each truth gets its own matching prediction (greedy)."""
    if n_pred != n_true:
        return False
    free = set(range(n_pred))
    for t in range(n_true):
        hit = next((p for p in sorted(free) if ok(p, t)), None)
        if hit is None:
            return False
        free.discard(hit)
    return True


def points_match(pred, truth, tol: float = 0.05) -> bool:
    """Every true center has its own predicted point within ``tol`` (Euclidean), same count."""
    return _one_to_one(
        len(pred), len(truth), lambda p, t: np.hypot(*np.subtract(pred[p], truth[t])) <= tol
    )


def boxes_match(pred, truth, iou: float = 0.5) -> bool:
    """Every true box has its own predicted box with IoU >= ``iou``, same count."""
    return _one_to_one(len(pred), len(truth), lambda p, t: box_iou(pred[p], truth[t]) >= iou)


def eval_cases(seed: int, n: int) -> list[EvalCase]:
    """``n`` evaluation cases of stream ``seed`` (must not be TRAIN_SEED): one question chosen
    uniformly over question kinds, one point and one detect request for objects present."""
    if seed == TRAIN_SEED:
        raise ValueError(f"seed {TRAIN_SEED} is the training stream; evaluate on another seed")
    out = []
    for scene in scenes(seed, n):
        rng = _rng(seed, 1_000_000_000 + scene.index)
        qs = scene.queries()
        kinds = sorted({q.kind for q in qs})
        kind = kinds[rng.integers(len(kinds))]
        pool = [q for q in qs if q.kind == kind]
        present = [r for r in scene.region_items() if r.points]
        point = present[rng.integers(len(present))]
        detect = present[rng.integers(len(present))]
        out.append(EvalCase(scene, pool[rng.integers(len(pool))], point, detect))
    return out
