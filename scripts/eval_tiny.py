"""Accuracy of kestrel-tiny on unseen synthetic scenes, through the public Engine.

    python scripts/eval_tiny.py --seed 1 --n 500 [--json] [--model DIR] [--adapter PATH]
    python scripts/eval_tiny.py --smoke [--adapter french]    # 2 scenes

Targets on any seed other than the training stream: query >= 85%, point >= 80%,
detect >= 70%. ``--json`` prints one line {"query_acc", "point_acc", "detect_acc", "n"}.
With ``--adapter`` (the bundled French adapter by default when given as "french") colour
answers are expected in French.
"""

from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from kestrel import Engine
from kestrel.engine.setup import DEFAULT_MODEL_DIR
from kestrel.tiny import synthetic
from kestrel.tiny.eval import evaluate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1, help="scene stream (not the training seed 0)")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    p.add_argument("--adapter", default=None, help="LoRA adapter path ('french': bundled one)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="2 scenes")
    args = p.parse_args(argv)
    if args.smoke:
        args.n = 2

    cases = synthetic.eval_cases(args.seed, args.n)
    expect = None
    with Engine(args.model, device="cpu", max_batch_size=args.max_batch_size) as engine:
        name = None
        if args.adapter:
            path = DEFAULT_MODEL_DIR / "lora-french" if args.adapter == "french" else args.adapter
            engine.load_adapter("eval", path)
            name = "eval"
            expect = lambda a: synthetic.FRENCH_COLORS.get(a, a)  # noqa: E731
        t0 = time.perf_counter()
        with tqdm(total=len(cases), desc="eval", unit="scene", disable=args.json) as bar:
            rep = evaluate(engine, cases, adapter=name, expect=expect, progress=bar.update)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    if args.json:
        print(json.dumps(rep.to_dict()))
        return
    print(
        f"\nkestrel-tiny eval: seed {args.seed}, {rep.n} scenes, {wall:.1f} s "
        f"({3 * rep.n / wall:.1f} requests/s, hit rate {stats.hit_rate:.1%})"
    )
    print(f"{'metric':<10}{'accuracy':>10}{'target':>8}")
    for key, target in (("query", 0.85), ("point", 0.80), ("detect", 0.70)):
        acc = getattr(rep, f"{key}_acc")
        print(f"{key:<10}{acc:>10.1%}{target:>8.0%}")
    print("query by kind: " + ", ".join(f"{k} {r}/{a}" for k, (r, a) in rep.by_kind.items()))


if __name__ == "__main__":
    main()
