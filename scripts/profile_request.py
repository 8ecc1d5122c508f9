"""Where the time of a miss, a hit and a decode step goes, through the public Engine.

    python scripts/profile_request.py [--model DIR] [--repeats 3] [--batch 16]

Times are wall-clock, taken by wrapping the model functions and cache methods wherever the
package refers to them (inclusive timers; nested ones are subtracted so every row is
exclusive). "Python / scheduling" is what is left of the request's wall time: the engine's
queueing, the scheduler loop, skill logic and tensor bookkeeping. Achieved GFLOP/s for the
vision encoder and the prefill are compared with this machine's float32 matmul peak, measured
in the same run. Default model: the random-weight bench checkpoint (Moondream-2 structure sized
for a 2-core CPU), written on first use to ~/.cache/kestrel-bench/profile.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from timing import bench_model, instrument, measure, table

from kestrel import Engine
from kestrel.moondream import image_crops


def matmul_peak() -> float:
    """Best float32 matmul rate over a few square sizes and trials (GFLOP/s)."""
    best = 0.0
    for n in (512, 1024, 2048):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    instrument()
    peak = matmul_peak()
    rng = np.random.default_rng(0)
    with Engine(
        bench_model(args.model),
        device="cpu",
        dtype="float32",
        kv_cache_pages=40_000,
        max_batch_size=args.batch,
    ) as engine:
        cfg = engine.config
        one = {"temperature": 0.0, "max_tokens": 1}
        images = iter([rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(64)])
        engine.query(next(images), "warm up", settings=one)
        img = next(images)
        miss = measure(
            "miss", lambda: engine.query(next(images), "What is it?", settings=one), args.repeats
        )
        engine.query(img, "prime", settings=one)
        qs = iter(f"Question number {i}?" for i in range(1000))
        hit = measure("hit", lambda: engine.query(img, next(qs), settings=one), args.repeats)
        steps = 32
        dec = {"temperature": 0.0, "max_tokens": steps}
        counters = engine._scheduler.counters

        def decode_batch():
            fs = [engine.submit_query(None, f"story {i}", settings=dec) for i in range(args.batch)]
            for f in fs:
                f.result()

        before = counters.decode_steps
        decode = measure("decode", decode_batch, 1)
        n_steps = counters.decode_steps - before
    table("Miss (new image, 1 generated token: vision + full prefill), per request", miss)
    table("Hit (cached image, new question, 1 token), per request", hit)
    decode = {k: v / n_steps for k, v in decode.items()}
    table(
        f"Decode at batch {args.batch} (text-only prompts; prefills included), per step",
        decode,
        " / step",
    )
    crops = image_crops.overlap_crops(
        rng.integers(0, 256, (378, 378, 3), dtype=np.uint8), cfg.vision
    ).crops.shape[0]
    vis = vision_flops(cfg, crops) / miss.get("vision encoder", float("nan")) / 1e9
    pre = prefill_flops(cfg, cfg.prefix_len + 8)
    pre_rate = pre / miss.get("decoder (matmuls, norms, rope)", float("nan")) / 1e9
    print(f"\nmatmul peak (float32, best of 512-2048 sizes, this run): {peak:.1f} GFLOP/s")
    print(f"vision encoder: {vis:.1f} GFLOP/s ({vis / peak:.0%} of peak)")
    print(f"miss prefill decoder matmuls: {pre_rate:.1f} GFLOP/s ({pre_rate / peak:.0%} of peak)")


if __name__ == "__main__":
    main()
