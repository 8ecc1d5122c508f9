"""Adapter overhead: 4 adapters x 8 images x questions through the Engine, cache on.

    python scripts/bench_adapters.py [--model DIR] [--questions 4] [--max-tokens 8] [--rounds 5]

Three variants of the same requests in one process, each measurement on a fresh engine,
interleaved round by round through the harness (``harness.py``):
- base:          no adapter (the four copies of each request share one cache namespace);
- base + salts:  no adapter, but each copy in its own namespace (cache_salt), so the cache
                 behaves exactly as with four adapters: the ratio to it is the LoRA compute;
- 4 adapters:    each copy with its own adapter, all mixed in the same batches.
Prints requests/s (median, min-max over the rounds) and the ratios. The adapters are the
model's fixture adapter with its B matrices scaled differently (same shapes and rank,
different weights).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import harness
import numpy as np
from safetensors.torch import load_file, save_file

from kestrel import Engine

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "md2-tiny-a"
QUESTIONS = ["What is it?", "How many?", "Which color?", "Where is it?", "Why?", "Who?"]


def make_adapters(src: Path, out: Path, n: int) -> list[Path]:
    tensors = load_file(str(src))
    paths = []
    for i in range(n):
        scaled = {k: v * (0.5 + 0.5 * i) if k.endswith(".B") else v for k, v in tensors.items()}
        paths.append(out / f"adapter{i}.safetensors")
        save_file(scaled, str(paths[-1]))
    return paths


def run(engine: Engine, images, questions, variants: list[dict]) -> dict[str, float]:
    prepared = [engine.prepare_image(im) for im in images]
    settings = {"temperature": 0.0, "max_tokens": ARGS.max_tokens}
    engine.query(None, "warm up", settings={"max_tokens": 1})
    t0 = time.perf_counter()
    futures = [
        engine.submit_query(img, q, settings=settings, **extra)
        for img in prepared
        for extra in variants
        for q in questions
    ]
    for f in futures:
        f.result()
    wall = time.perf_counter() - t0
    return {"rps": len(futures) / wall, "hit_rate": engine.stats().hit_rate}


def main() -> None:
    bench = harness.start(ARGS, "Adapters (bench_adapters.py)")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(8)]
    questions = QUESTIONS[: ARGS.questions]
    opts = {"device": "cpu", "dtype": "float32", "max_batch_size": 16, "kv_cache_pages": 60_000}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(FIXTURE / "adapter" / "adapter.safetensors", Path(tmp), 4)

        def base() -> dict[str, float]:
            with Engine(ARGS.model, **opts) as engine:
                return run(engine, images, questions, [{}] * 4)

        def salted() -> dict[str, float]:
            with Engine(ARGS.model, **opts) as engine:
                return run(engine, images, questions, [{"cache_salt": f"s{i}"} for i in range(4)])

        def adapters() -> dict[str, float]:
            with Engine(ARGS.model, **opts) as engine:
                for i, p in enumerate(paths):
                    engine.load_adapter(f"a{i}", p)
                return run(engine, images, questions, [{"adapter": f"a{i}"} for i in range(4)])

        runs = bench.run(
            {
                "base (the four copies share one namespace)": base,
                "base + 4 cache salts (same cache structure as 4 adapters)": salted,
                "4 adapters, mixed in every batch": adapters,
            }
        )
    n = 8 * 4 * len(questions)
    bench.emit(
        f"\n{n} requests each (8 images x 4 copies x {len(questions)} questions), "
        f"{ARGS.max_tokens} greedy tokens, cache on, CPU float32, model {Path(ARGS.model).name}"
    )
    names = list(runs)
    metrics = {"rps": "requests/s", "hit_rate": "hit rate"}
    bench.table(runs, metrics, baseline=names[-1])
    bench.emit("")
    salts, lora = ([r["rps"] for r in runs[k]] for k in names[1:])
    bench.ratio_line("adapter compute overhead (base + salts / adapters)", salts, lora)
    bench.finish()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(FIXTURE))
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    harness.add_arguments(p, rounds=5)
    ARGS = p.parse_args()
    main()
