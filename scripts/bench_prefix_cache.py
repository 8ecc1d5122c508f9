"""Prefix-cache benchmark: workloads W1-W3 of design.md section 7, cache on vs off.

Runs on a "bench" model: Moondream 2's structure (27x27 = 729 image tokens per crop grid, 378-px
overlapping crops, Phi-style decoder with partial rotary, region heads, 51200-token vocabulary)
with random weights and widths cut down so a 2-core CPU finishes in minutes (see BENCH_CONFIG).

The driver is a small stand-in for the scheduler: requests are admitted in arrival order, one
prefill at a time, and every running sequence advances in one batched decode step between
admissions. TTFT is measured per request from the start of its prefill to its first sampled
token (queueing excluded: every request of a workload arrives at once, so queueing would only
measure the arrival order). Requests/s is end to end: all requests / total wall time.

Cache off and cache on run interleaved through the harness (``harness.py``), each round on a
fresh runtime; every figure is the median (min-max) over ``--rounds`` rounds.

    python scripts/bench_prefix_cache.py --workload W1
    python scripts/bench_prefix_cache.py --workload W2 --rounds 5 --json
    python scripts/bench_prefix_cache.py --smoke    # kestrel-tiny, W1 at 2 x 2, no plot
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import numpy as np
import torch

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.random_checkpoint import write_random_checkpoint
from kestrel.tiny import MODEL_DIR
from kestrel.tokens import TextToken

BENCH_CONFIG = {
    "text": {"dim": 512, "ff_dim": 2048, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8},
    "vision": {"enc_dim": 256, "enc_ff_dim": 1024, "enc_n_layers": 4, "enc_n_heads": 4,
               "proj_out_dim": 512, "proj_inner_dim": 1024},
    "region": {"dim": 512, "inner_dim": 1024},
}  # fmt: skip
MAX_NEW_TOKENS = 8
MAX_BATCH = 8


@dataclass(frozen=True, slots=True)
class Request:
    tokens: tuple[int, ...]
    image: np.ndarray | None


@dataclass(frozen=True, slots=True)
class RunResult:
    ttft_s: list[float]
    hit: list[bool]
    wall_s: float
    prefill_tokens: int
    vision_encodes: int

    @property
    def rps(self) -> float:
        return len(self.ttft_s) / self.wall_s


def _query_tokens(rng: random.Random, cfg: MoondreamConfig, n: int) -> tuple[int, ...]:
    t = cfg.tokenizer
    q = [rng.randrange(16, cfg.text.vocab_size) for _ in range(n)]
    return (t.bos_id, *t.templates["query"]["prefix"], *q, t.answer_id, t.answer_id)


def _image(rng: random.Random, side: int) -> np.ndarray:
    g = np.random.default_rng(rng.randrange(1 << 30))
    return g.integers(0, 256, size=(side, side, 3), dtype=np.uint8)


def workload(name: str, cfg: MoondreamConfig, seed: int = 0, n: int = 8) -> list[Request]:
    """The workload at its size (``n`` 8), or a smaller one of its shape (a smoke run's 2)."""
    rng = random.Random(seed)
    side = cfg.vision.crop_size
    if name == "W1":  # 8 images x 8 questions, shuffled arrival
        images = [_image(rng, side) for _ in range(n)]
        reqs = [Request(_query_tokens(rng, cfg, rng.randint(8, 16)), im) for im in images
                for _ in range(n)]  # fmt: skip
        rng.shuffle(reqs)
        return reqs
    if name == "W2":  # ~1024-token shared system prompt, 32-128 unique suffix tokens, text-only
        system = [rng.randrange(16, cfg.text.vocab_size) for _ in range(128 * n)]
        out = []
        for _ in range(6 * n):
            suffix = [rng.randrange(16, cfg.text.vocab_size) for _ in range(rng.randint(32, 128))]
            out.append(Request((cfg.tokenizer.bos_id, *system, *suffix), None))
        return out
    if name == "W3":  # nothing shared: unique images and prompts
        return [Request(_query_tokens(rng, cfg, rng.randint(8, 16)), _image(rng, side))
                for _ in range(3 * n)]  # fmt: skip
    raise SystemExit(f"unknown workload {name!r} (W1, W2, W3)")


def run(rt: MoondreamRuntime, reqs: list[Request]) -> RunResult:
    before_prefill = rt.counters.prefill_tokens
    before_vision = rt.counters.vision_encodes
    ttft, hit = [], []
    running: list[list] = []  # [state, next_token, remaining]
    queue = list(reqs)
    t0 = time.perf_counter()
    while queue or running:
        if queue and len(running) < MAX_BATCH:
            r = queue.pop(0)
            s0 = time.perf_counter()
            state, logits = rt.start_sequence([TextToken(t) for t in r.tokens], r.image,
                                              max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
            tok = int(logits.argmax())
            ttft.append(time.perf_counter() - s0)
            hit.append(state.reused_page_count > 0)
            running.append([state, tok, MAX_NEW_TOKENS - 1])
        if running:
            logits = rt.decode_step([e[0] for e in running], [TextToken(e[1]) for e in running])
            nxt = logits.argmax(-1).tolist()
            for e, tok in zip(running, nxt, strict=True):
                e[1], e[2] = tok, e[2] - 1
            for e in [e for e in running if e[2] <= 0]:
                rt.release_sequence(e[0])
                running.remove(e)
    wall = time.perf_counter() - t0
    return RunResult(ttft, hit, wall, rt.counters.prefill_tokens - before_prefill,
                     rt.counters.vision_encodes - before_vision)  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def _plot(name: str, on: RunResult, off: RunResult, out_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t * 1e3 for t in off.ttft_s], "o-", ms=3, label="cache off")
    ax.plot([t * 1e3 for t in on.ttft_s], "o-", ms=3, label="cache on")
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{name}: per-request time to first token")
    ax.legend()
    path = out_dir / f"ttft_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(r: RunResult, workload_name: str) -> dict[str, float]:
    hits = [t for t, h in zip(r.ttft_s, r.hit, strict=True) if h]
    misses = [t for t, h in zip(r.ttft_s, r.hit, strict=True) if not h]
    out = {
        "rps": r.rps,
        "ttft_p50_ms": _pct(r.ttft_s, 50),
        "ttft_p99_ms": _pct(r.ttft_s, 99),
        "ttft_hit_p50_ms": _pct(hits, 50),
        "ttft_miss_p50_ms": _pct(misses, 50),
        "hits": len(hits),
        "prefill_tokens": r.prefill_tokens,
        "vision_encodes": r.vision_encodes,
    }
    if workload_name == "W2":  # requests 2..48: those that can hit the system prompt
        out["ttft_req2plus_p50_ms"] = _pct(r.ttft_s[1:], 50)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="W1", choices=["W1", "W2", "W3"])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: a random bench model)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    harness.add_arguments(ap, rounds=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = args.model or MODEL_DIR
    n = 2 if args.smoke else 8
    bench = harness.start(args, f"Prefix cache, workload {args.workload} (bench_prefix_cache.py)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            cfg = MoondreamConfig.from_dict(BENCH_CONFIG)
            model_dir = write_random_checkpoint(Path(tmp) / "bench", cfg, seed=0)
        model = MoondreamModel.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    cfg = model.config
    reqs = workload(args.workload, cfg, n=n)
    pages = MAX_BATCH * (cfg.text.max_context // 2) + 1
    last: dict[str, RunResult] = {}

    def variant(label: str, enabled: bool) -> dict[str, float]:
        rt = MoondreamRuntime(model, kv_cache_pages=pages, max_batch_size=MAX_BATCH,
                              enable_prefix_cache=enabled)  # fmt: skip
        run(rt, workload(args.workload, cfg, seed=99, n=n)[:2])  # warm-up, different content
        last[label] = run(rt, reqs)
        rt.check_integrity()
        return figures(last[label], args.workload)

    runs = bench.run({"cache off": lambda: variant("off", False),
                      "cache on": lambda: variant("on", True)})  # fmt: skip
    on = last["on"]
    bench.emit(f"\n{args.workload}: {len(reqs)} requests, {sum(on.hit)} hits / "
               f"{len(on.hit) - sum(on.hit)} misses with the cache on")  # fmt: skip
    bench.table(runs, {"rps": "requests/s", "ttft_p50_ms": "TTFT p50 ms",
                       "ttft_p99_ms": "TTFT p99 ms"}, baseline="cache off", fmt=".1f")  # fmt: skip
    counts = {"prefill_tokens": "prefill tokens computed", "vision_encodes": "vision encoder calls"}
    bench.table(runs, counts, fmt=".0f")
    _targets(bench, args.workload, runs)
    if not args.json and not args.smoke:
        plot = _plot(args.workload, last["on"], last["off"], args.out)
        if plot:
            bench.emit(f"plot (last round): {plot}")
    bench.finish()
    return 0


def _targets(bench: harness.Bench, w: str, runs: harness.Runs) -> None:
    """The design targets of this workload: each ratio with its per-round range, met or not
    (judged on the ratio of the medians)."""

    def col(variant: str, key: str) -> list[float]:
        return [r[key] for r in runs[variant]]

    def check(what: str, q: harness.Spread, ok: bool) -> None:
        bench.emit(f"target {what}: {q.fmt('.3g')} -> {'met' if ok else 'NOT met'}")

    bench.emit("")
    if w == "W1":
        q = harness.ratio(col("cache on", "ttft_hit_p50_ms"), col("cache on", "ttft_miss_p50_ms"))
        check("hit TTFT p50 / miss TTFT p50 <= 0.05 (cache on)", q, q.median <= 0.05)
        q = harness.ratio(col("cache on", "rps"), col("cache off", "rps"))
        check("requests/s on / off >= 5", q, q.median >= 5)
    elif w == "W2":
        key = "ttft_req2plus_p50_ms"
        q = harness.ratio(col("cache off", key), col("cache on", key))
        check("TTFT p50 of requests 2..48, off / on >= 10", q, q.median >= 10)
    else:
        q = harness.ratio(col("cache off", "rps"), col("cache on", "rps"))
        check("requests/s off / on <= 1.01 (cache-on overhead)", q, q.median <= 1.01)


if __name__ == "__main__":
    sys.exit(main())
