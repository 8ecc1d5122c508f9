"""Decode throughput against batch size: tokens/s of one batched decode step at B = 1..16.

    python scripts/bench_decode.py [--model DIR] [--steps 16] [--batches 1,2,4,8,16] [--rounds 3]
    python scripts/bench_decode.py --smoke    # kestrel-tiny, 2 steps at B = 1, 2

B sequences are prefilled (image prompts of ~750 positions: an image and a short question),
then ``--steps`` decode steps run over all B at once through the runtime (the step the
engine's scheduler runs). Two layouts: every row asks about the same image (its 729 image
positions are one cached prefix that all rows share: the batch image-QA case) and every row
about its own image (nothing shared). Tokens/s = B x steps / time; the ratio to B = 1 is
taken round by round: every (layout, B) variant runs once per round, interleaved through the
harness (``harness.py``), and the table gives median (min-max) over the rounds. Default model:
the random-weight bench checkpoint (Moondream-2 structure, 729 image tokens, sized for a 2-core
CPU).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import harness
import numpy as np
import torch
from timing import bench_model

from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tiny import MODEL_DIR
from kestrel.tokens import TextToken


def prompt(rt: MoondreamRuntime, question: str) -> list[TextToken]:
    t = rt.config.tokenizer
    q = t.templates["query"]
    ids = [t.bos_id, *q["prefix"], *rt.tokenizer.encode(question), *q["suffix"]]
    return [TextToken(i) for i in ids]


def tokens_per_s(rt: MoondreamRuntime, images: list, batch: int, steps: int) -> float:
    states = []
    for b in range(batch):
        s, _ = rt.start_sequence(
            prompt(rt, f"question {b}?"), images[b % len(images)], max_new_tokens=steps + 2
        )
        states.append(s)
    feed = [TextToken(11)] * batch
    rt.decode_step(states, feed)  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps):
        rt.decode_step(states, feed)
    elapsed = time.perf_counter() - t0
    for s in states:
        rt.release_sequence(s)
    return batch * steps / elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batches", default="1,2,4,8,16")
    harness.add_arguments(p, rounds=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.batches = MODEL_DIR, 2, "1,2"
    bench = harness.start(args, "Decode against batch size (bench_decode.py)")
    batches = [int(b) for b in args.batches.split(",")]
    rt = MoondreamRuntime.from_pretrained(
        bench_model(args.model), device="cpu", dtype=torch.float32,
        max_batch_size=max(batches), kv_cache_pages=max(batches) * 900 + 64,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    own = [rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(max(batches))]
    layouts = {"same image": own[:1], "own image": own}

    def measure(imgs: list, b: int) -> dict[str, float]:
        with torch.inference_mode():
            return {"tps": tokens_per_s(rt, imgs, b, args.steps)}

    variants = {
        f"{n}, B={b}": partial(measure, imgs, b) for n, imgs in layouts.items() for b in batches
    }
    baselines = {f"{n}, B={b}": f"{n}, B={batches[0]}" for n in layouts for b in batches}
    runs = bench.run(variants)
    bench.emit(
        f"\n{args.steps} decode steps per batch, ~750-position image prompts, CPU float32, "
        f"{args.model.name} checkpoint"
    )
    bench.table(runs, {"tps": "tokens/s"}, baseline=baselines, fmt=".1f")
    bench.finish()


if __name__ == "__main__":
    main()
