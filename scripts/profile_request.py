"""Where the time of a miss, a hit and a decode step goes, through the public Engine.

    python scripts/profile_request.py [--model DIR] [--repeats 3] [--batch 16] [--rounds 3]
    python scripts/profile_request.py --smoke    # kestrel-tiny, 1 repeat, batch 2, small peak

Times are wall-clock, taken by wrapping the model functions and cache methods wherever the
package refers to them (inclusive timers; nested ones are subtracted so every row is
exclusive). "Python / scheduling" is what is left of the request's wall time: the engine's
queueing, the scheduler loop, skill logic and tensor bookkeeping. Achieved GFLOP/s for the
vision encoder and the prefill are compared with this machine's float32 matmul peak, measured
in each round. Through the benchmark harness (``harness.py``): idle check, ``--rounds`` rounds,
each figure the median over the rounds (min-max). Default model: the random-weight bench
checkpoint (Moondream-2 structure sized for a 2-core CPU), written on first use to
~/.cache/kestrel-bench/cpu.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import harness
import numpy as np
import torch
from timing import bench_model, instrumented, measure

from kestrel import Engine
from kestrel.crops.overlap import overlap_crops
from kestrel.tiny import MODEL_DIR


def matmul_peak(sizes: tuple[int, ...] = (512, 1024, 2048)) -> float:
    """Best float32 matmul rate over a few square sizes and trials (GFLOP/s)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(3):
            reps = max(1, 2**31 // n**3)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def vision_flops(cfg, crops: int) -> float:
    v = cfg.vision
    n, d = v.n_patches, v.enc_dim
    block = 2 * n * (4 * d * d + 2 * d * v.enc_ff_dim) + 4 * n * n * d
    return crops * (v.enc_n_layers * block + 2 * n * v.patch_dim * d)


def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of the decoder blocks (attention scores are timed apart)."""
    t = cfg.text
    return t.n_layers * 2 * tokens * (4 * t.dim * t.dim + 2 * t.dim * t.ff_dim)


PARTS = ("miss", "hit", "decode step")


def profile_round(engine, images, questions, batch: int, repeats: int) -> dict[str, dict]:
    """One round: a miss, a hit and a batched decode, each broken down by part (seconds)."""
    one = {"temperature": 0.0, "max_tokens": 1}
    img = next(images)
    miss = measure("miss", lambda: engine.query(next(images), "What is it?", settings=one), repeats)
    engine.query(img, "prime", settings=one)
    hit = measure("hit", lambda: engine.query(img, next(questions), settings=one), repeats)
    dec = {"temperature": 0.0, "max_tokens": 32}

    def decode_batch() -> None:
        fs = [engine.submit_query(None, f"story {i}", settings=dec) for i in range(batch)]
        for f in fs:
            f.result()

    before = engine.decode_steps
    decode = measure("decode", decode_batch, 1)
    n_steps = engine.decode_steps - before
    return {"miss": miss, "hit": hit, "decode step": {k: v / n_steps for k, v in decode.items()}}


def report(bench: harness.Bench, rounds: list[dict[str, dict]], batch: int) -> None:
    """Each part's median ms (min-max over the rounds) for a miss, a hit and a decode step."""
    names = {k for r in rounds for rows in r.values() for k in rows if k != "total"}
    parts = sorted(names, key=lambda k: -statistics.median([r["miss"].get(k, 0.0) for r in rounds]))
    bench.emit(f"\n| part | {PARTS[0]} (ms) | {PARTS[1]} (ms) | decode step at batch {batch} (ms) |"
               "\n|---|---|---|---|")  # fmt: skip
    for k in [*parts, "total"]:
        cells = []
        for what in PARTS:
            ms = harness.spread([r[what].get(k, 0.0) * 1e3 for r in rounds])
            cells.append(ms.fmt() if ms.hi > 0 else "-")
            bench.figures.setdefault(what, {})[k] = harness.s_dict(ms)
        bench.emit(f"| {k} | " + " | ".join(cells) + " |")
    bench.ratio_line("hit / miss TTFT", [r["hit"]["total"] for r in rounds],
                     [r["miss"]["total"] for r in rounds])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--repeats", type=int, default=3, help="requests per figure and round")
    p.add_argument("--batch", type=int, default=16)
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.repeats, args.batch = MODEL_DIR, 1, 2
    bench = harness.start(args, "Where one request's time goes (profile_request.py)")
    with instrumented():
        run(bench, args)


def run(bench: harness.Bench, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    images = iter([rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(256)])
    questions = iter(f"Question number {i}?" for i in range(10_000))
    rounds, peaks = [], []
    with Engine(
        bench_model(args.model),
        device="cpu",
        dtype="float32",
        kv_cache_pages=40_000,
        max_batch_size=args.batch,
    ) as engine:
        cfg = engine.config
        engine.query(next(images), "warm up", settings={"temperature": 0.0, "max_tokens": 1})
        for r in range(args.rounds):
            peaks.append(matmul_peak((64, 128) if args.smoke else (512, 1024, 2048)))
            t0 = time.perf_counter()
            rounds.append(profile_round(engine, images, questions, args.batch, args.repeats))
            bench.progress(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.1f} s)")
    report(bench, rounds, args.batch)
    crops = overlap_crops(next(images), cfg.vision).crops.shape[0]
    vis = [vision_flops(cfg, crops) / r["miss"]["vision encoder"] / 1e9 for r in rounds]
    pre_flops = prefill_flops(cfg, cfg.prefix_len + 8)
    pre = [pre_flops / r["miss"]["decoder (matmuls, norms, rope)"] / 1e9 for r in rounds]
    bench.emit(f"\nmatmul peak (float32, best of 512-2048 sizes, measured each round): "
               f"{harness.spread(peaks).fmt('.1f')} GFLOP/s")  # fmt: skip
    for label, rates in (("vision encoder", vis), ("miss prefill decoder matmuls", pre)):
        share = harness.ratio(rates, peaks)
        bench.emit(f"{label}: {harness.spread(rates).fmt('.1f')} GFLOP/s, "
                   f"{share.fmt('.0%')} of peak")  # fmt: skip
    bench.finish()


if __name__ == "__main__":
    main()
