"""Write the sample scenes `kestrel demo` ships with: kestrel/tiny/assets/demo/*.png + scenes.json.

    python scripts/make_demo_assets.py
    python scripts/make_demo_assets.py --smoke [--out DIR]   # the same scenes, to DIR or a temp dir

Scenes come from ``kestrel.tiny.synthetic`` (seed DEMO_SEED, never the training stream). The JSON
keeps, per scene, the questions with their true answers and the point / detect objects with
their true centers and boxes, so the demo can show what the model got right.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kestrel.tiny import DEMO_DIR, synthetic

DEMO_SEED = 2026
N_SCENES = 6
OUT = DEMO_DIR


def scene_entry(scene: synthetic.Scene, name: str) -> dict:
    by_kind: dict[str, synthetic.QAItem] = {}
    for q in scene.queries():
        by_kind.setdefault(q.kind, q)
    picked = [by_kind[k] for k in ("count", "color", "shape", "left", "exists") if k in by_kind]
    regions = [r for r in scene.region_items() if r.points]
    point, detect = regions[0], regions[-1]
    return {
        "file": name,
        "caption": scene.caption("short"),
        "questions": [{"question": q.question, "answer": q.answer} for q in picked[:3]],
        "point": {"object": point.obj, "points": [list(p) for p in point.points]},
        "detect": {"object": detect.obj, "boxes": [list(b) for b in detect.boxes]},
    }


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for scene in synthetic.scenes(DEMO_SEED, N_SCENES):
        name = f"scene_{scene.index}.png"
        scene.pil().save(out / name, optimize=True)
        entries.append(scene_entry(scene, name))
    (out / "scenes.json").write_text(json.dumps({"seed": DEMO_SEED, "scenes": entries}, indent=1))
    print(f"wrote {len(entries)} scenes to {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help=f"default: {OUT}")
    p.add_argument("--smoke", action="store_true",
                   help="write them to --out, or a temp dir: not into the package")  # fmt: skip
    args = p.parse_args(argv)
    if args.out is not None or not args.smoke:
        write(args.out or OUT)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))


if __name__ == "__main__":
    main()
