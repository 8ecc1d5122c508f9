"""Adapter overhead: 4 adapters x 8 images x questions through the Engine, cache on.

    python scripts/bench_adapters.py [--model DIR] [--questions 4] [--max-tokens 8] [--rounds 5]
    python scripts/bench_adapters.py --smoke    # 1 image, 1 question, 2 tokens, one round

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


def run(
    engine: Engine, images, questions, variants: list[dict], max_tokens: int
) -> dict[str, float]:
    prepared = [engine.prepare_image(im) for im in images]
    settings = {"temperature": 0.0, "max_tokens": max_tokens}
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(FIXTURE))
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    if args.smoke:
        args.questions, args.max_tokens = 1, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    bench = harness.start(args, "Adapters (bench_adapters.py)")
    rng = np.random.default_rng(0)
    n_images = 1 if args.smoke else 8
    images = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(n_images)]
    questions = QUESTIONS[: args.questions]
    opts = {"device": "cpu", "dtype": "float32", "max_batch_size": 16, "kv_cache_pages": 60_000}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(FIXTURE / "adapter" / "adapter.safetensors", Path(tmp), 4)

        def measure(extras: list[dict], load: bool = False) -> dict[str, float]:
            with Engine(args.model, **opts) as engine:
                for i, p in enumerate(paths if load else ()):
                    engine.load_adapter(f"a{i}", p)
                return run(engine, images, questions, extras, args.max_tokens)

        def base() -> dict[str, float]:
            return measure([{}] * 4)

        def salted() -> dict[str, float]:
            return measure([{"cache_salt": f"s{i}"} for i in range(4)])

        def adapters() -> dict[str, float]:
            return measure([{"adapter": f"a{i}"} for i in range(4)], load=True)

        runs = bench.run(
            {
                "base (the four copies share one namespace)": base,
                "base + 4 cache salts (same cache structure as 4 adapters)": salted,
                "4 adapters, mixed in every batch": adapters,
            }
        )
    n = n_images * 4 * len(questions)
    bench.emit(
        f"\n{n} requests each ({n_images} images x 4 copies x {len(questions)} questions), "
        f"{args.max_tokens} greedy tokens, cache on, CPU float32, model {Path(args.model).name}"
    )
    names = list(runs)
    metrics = {"rps": "requests/s", "hit_rate": "hit rate"}
    bench.table(runs, metrics, baseline=names[-1])
    bench.emit("")
    salts, lora = ([r["rps"] for r in runs[k]] for k in names[1:])
    bench.ratio_line("adapter compute overhead (base + salts / adapters)", salts, lora)
    bench.finish()


if __name__ == "__main__":
    main()
