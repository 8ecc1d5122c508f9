"""`kestrel demo`: batch image-QA over the sample scenes bundled with the package.

Every question, caption, point and detect request of every scene is submitted at once through
the public Engine; the answers are printed next to the truth, the points and boxes are drawn on
the scenes into one PNG, and a cache summary closes the run.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from kestrel.tiny import DEMO_DIR, synthetic

__all__ = ["DEMO_DIR", "DemoSummary", "draw_results", "load_scenes", "run_demo"]

GREEDY = {"temperature": 0.0, "max_tokens": 24}
SCALE = 3  # the drawing upscales the small scenes


@dataclass(frozen=True, slots=True)
class DemoSummary:
    requests: int
    correct: int
    graded: int
    wall_s: float
    hit_rate: float
    prefill_tokens_saved: int
    vision_encodes_skipped: int
    png: Path

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


def load_scenes(folder: Path = DEMO_DIR) -> list[dict[str, Any]]:
    return json.loads((folder / "scenes.json").read_text())["scenes"]


def _submit(engine, folder: Path, scene: dict) -> dict[str, Any]:
    image = engine.prepare_image(folder / scene["file"])  # decode + hash once per scene
    return {
        "image": image,
        "questions": [
            engine.submit_query(image, q["question"], settings=GREEDY) for q in scene["questions"]
        ],
        "caption": engine.submit_caption(image, length="short", settings=GREEDY),
        "point": engine.submit_point(image, scene["point"]["object"]),
        "detect": engine.submit_detect(image, scene["detect"]["object"]),
    }


def _report(scene: dict, got: dict[str, Any], out) -> tuple[int, int]:
    """Print one scene's answers next to the truth; returns (right, graded)."""
    right = graded = 0
    print(
        f"\n{scene['file']}: {got['caption'].result().caption.strip()!r} "
        f"(truth: {scene['caption']!r})",
        file=out,
    )
    for q, fut in zip(scene["questions"], got["questions"], strict=True):
        answer = fut.result().answer
        ok = synthetic.normalize_answer(answer) == q["answer"]
        right, graded = right + ok, graded + 1
        print(
            f"  {'✓' if ok else '✗'} {q['question']:<34} {answer.strip():<10} "
            f"(truth: {q['answer']})",
            file=out,
        )
    points = [(p["x"], p["y"]) for p in got["point"].result().points]
    ok = synthetic.points_match(points, [tuple(p) for p in scene["point"]["points"]])
    right, graded = right + ok, graded + 1
    shown = ", ".join(f"({x:.2f}, {y:.2f})" for x, y in points) or "none"
    print(f"  {'✓' if ok else '✗'} point {scene['point']['object']!r}: {shown}", file=out)
    boxes = [
        (b["x_min"], b["y_min"], b["x_max"], b["y_max"]) for b in got["detect"].result().objects
    ]
    ok = synthetic.boxes_match(boxes, [tuple(b) for b in scene["detect"]["boxes"]])
    right, graded = right + ok, graded + 1
    shown = ", ".join("(" + ", ".join(f"{v:.2f}" for v in b) + ")" for b in boxes) or "none"
    print(f"  {'✓' if ok else '✗'} detect {scene['detect']['object']!r}: {shown}", file=out)
    return right, graded


def draw_results(folder: Path, scenes: list[dict], results: list[dict], png: Path) -> Path:
    """One row of scenes, upscaled, with the predicted points (dots) and boxes drawn."""
    tiles = []
    for scene, got in zip(scenes, results, strict=True):
        img = Image.open(folder / scene["file"]).convert("RGB")
        img = img.resize((img.width * SCALE, img.height * SCALE), Image.Resampling.NEAREST)
        draw = ImageDraw.Draw(img)
        w, h = img.size
        for b in got["detect"].result().objects:
            box = (b["x_min"] * w, b["y_min"] * h, b["x_max"] * w, b["y_max"] * h)
            draw.rectangle(box, outline=(0, 0, 0), width=2)
        for p in got["point"].result().points:
            x, y, r = p["x"] * w, p["y"] * h, 5
            draw.ellipse((x - r, y - r, x + r, y + r), fill=(255, 255, 255), outline=(0, 0, 0))
        tiles.append(img)
    pad = 8
    sheet = Image.new(
        "RGB",
        (
            sum(t.width for t in tiles) + pad * (len(tiles) + 1),
            max(t.height for t in tiles) + 2 * pad,
        ),
        (255, 255, 255),
    )
    x = pad
    for t in tiles:
        sheet.paste(t, (x, pad))
        x += t.width + pad
    png.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(png)
    return png


def run_demo(engine, png: Path, *, folder: Path = DEMO_DIR, out=None) -> DemoSummary:
    """Run the demo on ``engine``; prints to ``out`` (stdout by default)."""
    import sys

    out = out or sys.stdout
    scenes = load_scenes(folder)
    before = engine.stats()
    t0 = time.perf_counter()
    results = [_submit(engine, folder, s) for s in scenes]
    futures: list[Future] = [
        f
        for r in results
        for k, v in r.items()
        if k != "image"
        for f in (v if isinstance(v, list) else [v])
    ]
    for f in futures:
        f.exception()  # wait for all; errors surface in _report
    wall = time.perf_counter() - t0
    right = graded = 0
    for scene, got in zip(scenes, results, strict=True):
        r, g = _report(scene, got, out)
        right, graded = right + r, graded + g
    after = engine.stats()
    return DemoSummary(
        requests=len(futures),
        correct=right,
        graded=graded,
        wall_s=wall,
        hit_rate=after.hit_rate,
        prefill_tokens_saved=after.prefill_tokens_saved - before.prefill_tokens_saved,
        vision_encodes_skipped=after.vision_encodes_skipped - before.vision_encodes_skipped,
        png=draw_results(folder, scenes, results, png),
    )
