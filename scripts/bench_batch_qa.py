"""Batch image-QA through the Engine: requests/s, TTFT, and where the time goes.

    python scripts/bench_batch_qa.py [--model DIR] [--images 4] [--questions 8] [--json]

The workload: N images x Q questions, 8-token greedy answers (the bench checkpoint never emits
eos, so every answer has the same length), every request submitted at once. Measured in one
run, on the same checkpoint:
- the Engine with the prefix cache (one vision encode per image, batched decode);
- the Engine with the cache off (the batching alone);
- the eager path one request at a time, encoding each image once and reusing it for its
  questions: the structure of the reference implementation used at its best (a proxy for it
  here; the reference itself is compared by a separate comparator run).
Prints the table, the ratios and the Engine's phase breakdown; ``--json`` prints one line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from timing import bench_model, instrument, measure, table

from kestrel import Engine
from kestrel.reference.eager import EagerMoondream

QUESTIONS = [
    "What is in the picture?",
    "What color is the largest shape?",
    "How many shapes are there?",
    "Is there a circle?",
    "Where is the square?",
    "Describe the background.",
    "What is on the left?",
    "What is on the right?",
]
TOKENS = 8


def workload(n_images: int, n_questions: int) -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(n_images)]
    return [(img, q) for img in images for q in (QUESTIONS * 4)[:n_questions]]


def run_engine(model: Path, reqs, cache: bool) -> dict:
    settings = {"temperature": 0.0, "max_tokens": TOKENS}
    with Engine(
        model,
        device="cpu",
        dtype="float32",
        kv_cache_pages=40_000,
        max_batch_size=16,
        enable_prefix_cache=cache,
    ) as engine:
        engine.query(None, "warm up", settings={"max_tokens": 1})
        prepared = {}

        def once() -> list:
            futures = []
            for img, q in reqs:  # each image decoded and hashed once, as a batch job does
                key = id(img)
                prepared.setdefault(key, engine.prepare_image(img))
                futures.append(engine.submit_query(prepared[key], q, settings=settings))
            return [f.result() for f in futures]

        results: list = []
        rows = measure("batch", lambda: results.extend(once()), 1)
        stats = engine.stats()
    ttft = np.array([r.metrics.ttft_ms for r in results])
    return {
        "rps": len(reqs) / rows["total"],
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "hit_rate": stats.hit_rate,
        "vision_skipped": stats.vision_encodes_skipped,
        "rows": rows,
        "answers": [r.tokens for r in results],
    }


def run_eager(model: Path, reqs) -> dict:
    from kestrel.moondream import MoondreamModel, MoondreamTokenizer

    m = MoondreamModel.from_pretrained(model, device="cpu")
    eager = EagerMoondream(m, MoondreamTokenizer.for_checkpoint(model))
    t0 = time.perf_counter()
    encoded, answers = {}, []
    for img, q in reqs:
        enc = encoded.setdefault(id(img), None) or eager.encode_image(img)
        encoded[id(img)] = enc
        answers.append(eager.query(enc, q, max_tokens=TOKENS).token_ids)
    return {"rps": len(reqs) / (time.perf_counter() - t0), "answers": answers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model = bench_model(args.model)
    reqs = workload(args.images, args.questions)
    instrument()
    eager = run_eager(model, reqs)
    off = run_engine(model, reqs, cache=False)
    on = run_engine(model, reqs, cache=True)
    same = on["answers"] == off["answers"] == eager["answers"]
    out = {
        "requests": len(reqs),
        "engine_rps": round(on["rps"], 3),
        "engine_cache_off_rps": round(off["rps"], 3),
        "eager_best_rps": round(eager["rps"], 3),
        "engine_over_eager": round(on["rps"] / eager["rps"], 2),
        "cache_on_over_off": round(on["rps"] / off["rps"], 2),
        "ttft_p50_ms": round(on["ttft_p50_ms"], 1),
        "ttft_p99_ms": round(on["ttft_p99_ms"], 1),
        "hit_rate": round(on["hit_rate"], 3),
        "answers_identical": same,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"\n{len(reqs)} requests ({args.images} images x {args.questions} questions, "
        f"{TOKENS}-token greedy answers), CPU float32, one run\n"
    )
    print("| path | requests/s | TTFT p50 / p99 ms | vs eager best |\n|---|---|---|---|")
    print(f"| eager, image encoded once per image | {eager['rps']:.2f} | - | 1.00x |")
    for name, r in (("Engine, cache off", off), ("Engine, cache on", on)):
        print(
            f"| {name} | {r['rps']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['rps'] / eager['rps']:.2f}x |"
        )
    print(
        f"\ncache on / off: {out['cache_on_over_off']}x; hit rate {on['hit_rate']:.1%}; "
        f"vision encodes skipped {on['vision_skipped']}; greedy answers identical on all "
        f"three paths: {same}"
    )
    table("Engine, cache on: where the batch's time goes", on["rows"])


if __name__ == "__main__":
    main()
