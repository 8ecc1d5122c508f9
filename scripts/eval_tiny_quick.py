"""Quick accuracy of kestrel-tiny through the eager reference path (no Engine needed).

    python scripts/eval_tiny_quick.py [--model DIR] [--seed 1] [--n 100]   # default: kestrel-tiny
    python scripts/eval_tiny_quick.py --state bench_out/tiny_train   # a checkpoint mid-training
    python scripts/eval_tiny_quick.py --smoke    # 2 scenes

Metrics as in ``synthetic``: query exact match (``normalize_answer``), point = every true centre
has its own predicted point within 0.05, detect = every true box has its own box with IoU >= 0.5
(same counts). ``--adapter`` also reports how often colour answers come back in French.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kestrel.moondream import MoondreamModel, MoondreamTokenizer, load_adapter
from kestrel.reference.eager import EagerMoondream
from kestrel.tiny import MODEL_DIR, synthetic


def export_state(state_dir: Path, out: Path) -> Path:
    """Write the model of a training state (state.pt + tokenizer.json) as a checkpoint dir."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_data

    from kestrel.testing.random_checkpoint import config_to_dict

    saved = torch.load(state_dir / "state.pt", weights_only=False)
    tok = MoondreamTokenizer.from_file(state_dir / "tokenizer.json")
    config = tiny_data.make_config(tok)
    tensors = {f"model.{k}": v.to(torch.bfloat16) for k, v in saved["params"].items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"config": config_to_dict(config)}))
    (out / "tokenizer.json").write_text((state_dir / "tokenizer.json").read_text())
    print(f"state: {saved['state']['phase']} step {saved['state']['step']}")
    return out


def evaluate(model_dir: Path, seed: int, n: int, adapter: Path | None = None) -> dict:
    model = MoondreamModel.from_pretrained(model_dir)
    eager = EagerMoondream(model, MoondreamTokenizer.from_dir(model_dir), backend="torch")
    lora = None if adapter is None else load_adapter(adapter, model.config, dtype=model.dtype)
    hits = {"query": 0, "point": 0, "detect": 0, "french": 0, "color_q": 0}
    by_kind: dict[str, list[int]] = {}
    for case in synthetic.eval_cases(seed, n):
        img = case.scene.image
        enc = eager.encode_image(img, adapter=lora)
        ans = synthetic.normalize_answer(eager.query(enc, case.query.question, adapter=lora).answer)
        ok = ans == case.query.answer
        hits["query"] += ok
        by_kind.setdefault(case.query.kind, []).append(ok)
        if case.query.kind == "color":
            hits["color_q"] += 1
            hits["french"] += ans == synthetic.FRENCH_COLORS[case.query.answer]
        pts = eager.point(enc, case.point.obj, max_objects=8, adapter=lora).objects
        hits["point"] += synthetic.points_match([(p.x, p.y) for p in pts], case.point.points)
        boxes = eager.detect(enc, case.detect.obj, max_objects=8, adapter=lora).objects
        pred = [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes]
        hits["detect"] += synthetic.boxes_match(pred, case.detect.boxes)
    out = {f"{k}_acc": round(hits[k] / n, 3) for k in ("query", "point", "detect")}
    out["french_color_rate"] = round(hits["french"] / max(1, hits["color_q"]), 3)
    out["by_kind"] = {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_kind.items())}
    out["n"] = n
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--state", type=Path, default=None, help="training state dir instead")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--adapter", type=Path, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="2 scenes, this process's threads")
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.threads = 2, torch.get_num_threads()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_state(args.state, Path(tmp)) if args.state else args.model
        print(json.dumps(evaluate(model_dir, args.seed, args.n, args.adapter)))


if __name__ == "__main__":
    main()
