"""Batch image-QA through the Engine: requests/s, TTFT, and where the time goes.

    python scripts/bench_batch_qa.py [--model DIR] [--images 4] [--questions 8] [--rounds 3]
    python scripts/bench_batch_qa.py --smoke    # kestrel-tiny, 1 image x 2 questions

The workload: N images x Q questions, 8-token greedy answers (the bench checkpoint never emits
eos, so every answer has the same length), every request submitted at once. Three variants,
interleaved round by round through the harness (``harness.py``), each round on fresh state:
- the Engine with the prefix cache (one vision encode per image, batched decode);
- the Engine with the cache off (the batching alone);
- the eager path one request at a time, encoding each image once and reusing it for its
  questions: the structure of the reference implementation used at its best (a proxy for it
  here; ``bench_reference.py`` runs the reference itself).
Both sides run the vision encoder once per image, so the ratio to eager is bounded by that
shared cost: only the text side (prefill of the questions, decode) is batched.
Prints median (min-max) per variant, the ratios and the Engine's phase breakdown (last round).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness
import numpy as np
from timing import bench_model, instrumented, measure, table

from kestrel import Engine
from kestrel.reference.eager import EagerMoondream
from kestrel.tiny import MODEL_DIR

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


def run_engine(model: Path, reqs, cache: bool, keep: dict, tokens: int = TOKENS) -> dict:
    settings = {"temperature": 0.0, "max_tokens": tokens}
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
    keep.update(
        rows=rows, answers=[r.tokens for r in results], skipped=stats.vision_encodes_skipped
    )
    return {
        "rps": len(reqs) / rows["total"],
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "hit_rate": stats.hit_rate,
    }


def run_eager(model: Path, reqs, keep: dict, tokens: int = TOKENS) -> dict[str, float]:
    from kestrel.moondream import MoondreamModel, MoondreamTokenizer

    m = MoondreamModel.from_pretrained(model, device="cpu")
    eager = EagerMoondream(m, MoondreamTokenizer.for_checkpoint(model))
    warm = eager.encode_image(np.full((378, 378, 3), 127, dtype=np.uint8))
    eager.query(warm, "warm up", max_tokens=1)
    t0 = time.perf_counter()
    encoded, answers = {}, []
    for img, q in reqs:
        if id(img) not in encoded:
            encoded[id(img)] = eager.encode_image(img)
        answers.append(eager.query(encoded[id(img)], q, max_tokens=tokens).token_ids)
    keep.update(answers=answers)
    return {"rps": len(reqs) / (time.perf_counter() - t0)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    harness.add_arguments(p, rounds=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.images, args.questions = MODEL_DIR, 1, 2
    bench = harness.start(args, "Batch image-QA through the Engine (bench_batch_qa.py)")
    with instrumented():
        run(bench, args, bench_model(args.model))


def run(bench: harness.Bench, args: argparse.Namespace, model: Path) -> None:
    reqs = workload(args.images, args.questions)
    tokens = 2 if args.smoke else TOKENS
    kept: dict[str, dict] = {"eager": {}, "off": {}, "on": {}}
    answers: list = []

    def remember(name: str, figures: dict[str, float]) -> dict[str, float]:
        answers.append(kept[name]["answers"])
        return figures

    runs = bench.run(
        {
            "eager, image encoded once per image": lambda: remember(
                "eager", run_eager(model, reqs, kept["eager"], tokens)
            ),
            "Engine, cache off": lambda: remember(
                "off", run_engine(model, reqs, False, kept["off"], tokens)
            ),
            "Engine, cache on": lambda: remember(
                "on", run_engine(model, reqs, True, kept["on"], tokens)
            ),
        }
    )
    same = all(a == answers[0] for a in answers)
    bench.emit(
        f"\n{len(reqs)} requests ({args.images} images x {args.questions} questions, "
        f"{tokens}-token greedy answers), CPU float32, {Path(model).name} checkpoint"
    )
    eager = "eager, image encoded once per image"
    bench.table(runs, {"rps": "requests/s"}, baseline=eager)
    engines = {k: v for k, v in runs.items() if k != eager}
    bench.table(engines, {"ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms"}, fmt=".0f")
    on, off = runs["Engine, cache on"], runs["Engine, cache off"]
    bench.emit("")
    bench.ratio_line("cache on / off, requests/s", [r["rps"] for r in on], [r["rps"] for r in off])
    bench.emit(
        f"hit rate {on[-1]['hit_rate']:.1%}; vision encodes skipped {kept['on']['skipped']}; "
        f"greedy answers identical on all three paths, every round: {same}"
    )
    if not args.json:
        title = "Engine, cache on, last round: where the batch's time goes"
        table(title, kept["on"]["rows"], out=bench.emit)
    bench.finish({"answers_identical": same, "requests": len(reqs)})


if __name__ == "__main__":
    main()
