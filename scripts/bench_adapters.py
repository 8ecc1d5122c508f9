"""Adapter overhead: 4 adapters x 8 images x questions through the Engine, cache on.

    python scripts/bench_adapters.py [--model DIR] [--questions 4] [--max-tokens 8]

Three runs of the same requests in one process, each on a fresh engine:
- base:          no adapter (the four copies of each request share one cache namespace);
- base + salts:  no adapter, but each copy in its own namespace (cache_salt), so the cache
                 behaves exactly as with four adapters: the ratio to it is the LoRA compute;
- 4 adapters:    each copy with its own adapter, all mixed in the same batches.
Prints requests/s and the ratios. The adapters are the model's fixture adapter with its B
matrices scaled differently (same shapes and rank, different weights).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

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


def run(engine: Engine, images, questions, variants: list[dict]) -> tuple[float, float]:
    prepared = [engine.prepare_image(im) for im in images]
    settings = {"temperature": 0.0, "max_tokens": ARGS.max_tokens}
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
    return len(futures) / wall, engine.stats().hit_rate


def main() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(8)]
    questions = QUESTIONS[: ARGS.questions]
    opts = {"device": "cpu", "dtype": "float32", "max_batch_size": 16, "kv_cache_pages": 60_000}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(FIXTURE / "adapter" / "adapter.safetensors", Path(tmp), 4)
        with Engine(ARGS.model, **opts) as engine:
            rows.append(("base", *run(engine, images, questions, [{}] * 4)))
        with Engine(ARGS.model, **opts) as engine:
            salts = [{"cache_salt": f"s{i}"} for i in range(4)]
            rows.append(("base + 4 salts", *run(engine, images, questions, salts)))
        with Engine(ARGS.model, **opts) as engine:
            for i, p in enumerate(paths):
                engine.load_adapter(f"a{i}", p)
            named = [{"adapter": f"a{i}"} for i in range(4)]
            rows.append(("4 adapters", *run(engine, images, questions, named)))
    n = 8 * 4 * len(questions)
    print(
        f"\n{n} requests each (8 images x 4 copies x {len(questions)} questions), "
        f"{ARGS.max_tokens} greedy tokens, cache on, CPU float32\n"
    )
    print("| run | requests/s | hit rate | vs 4 adapters |")
    print("|---|---|---|---|")
    adapters_rps = rows[-1][1]
    for name, rps, hit in rows:
        print(f"| {name} | {rps:.1f} | {hit:.1%} | {rps / adapters_rps:.2f}x |")
    print(f"\nadapter compute overhead (base + salts / adapters): {rows[1][1] / adapters_rps:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(FIXTURE))
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    ARGS = p.parse_args()
    main()
