"""Cache tiers through the Engine: a working set of images larger than the KV pool, revisited.

    python scripts/bench_tiers.py [--model DIR] [--images 32] [--pool-images 8] [--passes 3]
    python scripts/bench_tiers.py --json          # one JSON object (revisit_ttft_ratio, ...)
    python scripts/bench_tiers.py --smoke         # any machine: tiny counts, one round

``--images`` images are asked about round-robin, ``--passes`` times, by an Engine whose KV
pool holds ``--pool-images`` image prompts: by the time an image comes round again its KV has
been evicted. Each request is a new 12-20 word question (so nothing but the image could hit),
answered greedily in ``--tokens`` tokens, one request at a time. Pass 1 is cold; passes 2+ are
the revisits. Two variants, interleaved round by round through the harness (``harness.py``),
each round on a fresh Engine:
- tier on: the image-embedding tier with room for the whole working set;
- tier off: ``embedding_cache_mb=0`` (every revisit runs the crops and the vision encoder).
Reported: the revisits' median TTFT (the Engine's: submit to first token), revisit requests/s,
vision encoder runs per image. The two variants' answers must be equal (asserted). Goals
(docs/prefix_cache.md): revisit TTFT ratio <= 0.4, requests/s ratio >= 2, 1.0 encodes per
image with the tier.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import harness
import numpy as np

from kestrel import Engine

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "md2-tiny-a"
WORDS = ("what", "colour", "is", "the", "shape", "near", "left", "edge", "of", "this", "picture",
         "and", "how", "many", "small", "parts", "are", "there", "in", "top", "corner", "right",
         "does", "it", "look", "bright", "or", "dark", "from", "here")  # fmt: skip
VARIANTS = ("tier on", "tier off")


def images(n: int, side: int = 378) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(n)]


def questions(n: int, seed: int = 5) -> list[str]:
    """``n`` distinct questions of 12 to 20 words."""
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(11, 19))) + "?"
            for i in range(n)]  # fmt: skip


def pool_pages(engine_config, pool_images: int, tokens: int) -> int:
    """A KV pool for ``pool_images`` image prompts with their questions and answers."""
    per_prompt = engine_config.prefix_len + 48 + tokens
    return pool_images * per_prompt + 1


def embedding_mb(engine_config, n_images: int) -> float:
    """Room for every image's embedding (float32), with a little to spare."""
    per = engine_config.image_tokens * engine_config.vision.proj_out_dim * 4
    return 1.25 * n_images * per / (1 << 20)


def visit(engine: Engine, pictures: list, asks: list[str], passes: int, tokens: int) -> dict:
    """Round-robin ``passes`` times; the TTFT of each revisit, their wall time, the answers."""
    settings = {"temperature": 0.0, "max_tokens": tokens}
    prepared = [engine.prepare_image(p) for p in pictures]
    answers, revisit_ttft, tiers = [], [], []
    q = iter(asks)
    revisit_wall = 0.0
    for p in range(passes):
        t0 = time.perf_counter()
        for image in prepared:
            r = engine.query(image, next(q), settings=settings)
            answers.append(r.answer)
            if p:
                revisit_ttft.append(r.metrics.ttft_ms)
                tiers.append(r.metrics.cache_tier)
        if p:
            revisit_wall += time.perf_counter() - t0
    return {"answers": answers, "ttft": revisit_ttft, "wall": revisit_wall, "tiers": tiers}


def run_variant(args: argparse.Namespace, name: str, answers: dict) -> dict:
    from kestrel.moondream.config import MoondreamConfig

    cfg = MoondreamConfig.from_json_file(args.model / "config.json")
    budget = 0 if name == "tier off" else embedding_mb(cfg, args.images)
    pictures = images(args.images)
    asks = questions(args.images * args.passes)
    with Engine(args.model, device="cpu", dtype="float32", max_batch_size=4,
                kv_cache_pages=pool_pages(cfg, args.pool_images, args.tokens),
                embedding_cache_mb=budget) as engine:  # fmt: skip
        engine.query(None, "warm up", settings={"max_tokens": 1})
        w = visit(engine, pictures, asks, args.passes, args.tokens)
        engine.check_integrity()
        encodes = engine.stats().vision_encodes
    answers.setdefault(name, []).append(w["answers"])
    revisits = args.images * (args.passes - 1)
    return {
        "revisit_ttft": statistics.median(w["ttft"]),
        "rps": revisits / w["wall"],
        "encodes_per_image": encodes / args.images,
        "tier_share": w["tiers"].count("embedding") / len(w["tiers"]),
    }


def check_same_answers(answers: dict) -> None:
    for on, off in zip(answers["tier on"], answers["tier off"], strict=True):
        if on != off:
            bad = next(i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a != b)
            raise AssertionError(f"request {bad}: tier on {on[bad]!r} != tier off {off[bad]!r}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=FIXTURE, help="checkpoint (default: fixture)")
    ap.add_argument("--images", type=int, default=32, help="the working set")
    ap.add_argument("--pool-images", type=int, default=8, help="image prompts the KV pool holds")
    ap.add_argument("--passes", type=int, default=3, help="round-robin passes (first is cold)")
    ap.add_argument("--tokens", type=int, default=8, help="answer tokens (greedy)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny counts and one round, on any machine (a test runs it)")  # fmt: skip
    harness.add_arguments(ap, rounds=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.images, args.pool_images, args.passes, args.tokens = 4, 1, 2, 3
        args.rounds, args.allow_busy = 1, True
    if args.passes < 2 or args.images <= args.pool_images or args.pool_images < 1:
        raise SystemExit("need >= 2 passes and a working set larger than the pool (>= 1 image)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    bench = harness.start(args, "Cache tiers: revisits past the KV pool (bench_tiers.py)")
    answers: dict = {}
    runs = bench.run({name: lambda n=name: run_variant(args, n, answers) for name in VARIANTS})
    check_same_answers(answers)
    bench.emit(f"\n{args.images} images round-robin x {args.passes} passes, KV pool for "
               f"{args.pool_images} image prompts, 12-20 word questions, {args.tokens}-token "
               "greedy answers; same answers with the tier on and off (asserted)")  # fmt: skip
    bench.table(runs, {"revisit_ttft": "revisit TTFT ms", "rps": "revisit requests/s",
                       "encodes_per_image": "encodes per image",
                       "tier_share": "revisits served by the tier"},
                baseline="tier off", fmt=".2f")  # fmt: skip
    on, off = runs["tier on"], runs["tier off"]
    ttft = bench.ratio_line("revisit TTFT, tier on / off", [r["revisit_ttft"] for r in on],
                            [r["revisit_ttft"] for r in off])  # fmt: skip
    rps = bench.ratio_line("revisit requests/s, tier on / off", [r["rps"] for r in on],
                           [r["rps"] for r in off])  # fmt: skip
    encodes = statistics.median(r["encodes_per_image"] for r in on)
    met = ttft.median <= 0.4 and rps.median >= 2 and encodes == 1.0
    bench.emit(f"goals (TTFT <= 0.4x, requests/s >= 2x, 1.0 encodes per image): "
               f"{'met' if met else 'NOT met'}")  # fmt: skip
    bench.finish({"revisit_ttft_ratio": ttft.median, "rps_ratio": rps.median,
                  "encodes_per_image_on": encodes,
                  "encodes_per_image_off": statistics.median(r["encodes_per_image"] for r in off),
                  "same_answers": True})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
