"""Conversations through the Engine (workload W4): time to first token by turn, requests/s.

    python scripts/bench_chat.py [--model DIR] [--conversations 16] [--turns 6] [--images 8]

W4: 16 conversations of 6 turns over 8 images (two conversations per image, the image in the
first turn), 8-token greedy answers, each reply sent back as the client would. A turn is
submitted for every conversation at once and answered before the next turn starts (the users
read the answers). TTFT is the Engine's (submit to the first token decided, queueing
included). Three variants, interleaved round by round through the harness (``harness.py``),
each round on a fresh Engine:
- cache on: turn n+1 hits through turn n's prompt and its retained answer;
- on, no retention (``retain_decoded=False``): it hits through turn n's prompt only and
  recomputes turn n's answer;
- cache off.
Goal (docs/chat.md): turns 2..6 at <= 0.1x the cache-off TTFT. ``--png`` draws the median
TTFT of each turn per variant (last round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import harness
import numpy as np

from kestrel import Engine

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "md2-tiny-a"
TOKENS = 8
ASKS = ("What is in the picture?", "What colour is it?", "How many are there?",
        "Where is the biggest one?", "Is anything on the left?", "Describe the background.",
        "Anything else?", "Thank you. One more look?")  # fmt: skip
VARIANTS = {  # name -> Engine options
    "cache on": {"enable_prefix_cache": True},
    "on, no retention": {"enable_prefix_cache": True, "retain_decoded": False},
    "cache off": {"enable_prefix_cache": False},
}


def images(n: int, side: int = 378) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(n)]


def converse(engine: Engine, pictures: Sequence[np.ndarray], n_conv: int, turns: int) -> dict:
    """W4 once: the TTFT of every request by turn (ms), requests and wall time, cached share."""
    settings = {"temperature": 0.0, "max_tokens": TOKENS}
    chats: list[list[dict]] = [[] for _ in range(n_conv)]
    ttft: list[list[float]] = [[] for _ in range(turns)]
    cached = prompt = 0
    t0 = time.perf_counter()
    for t in range(turns):
        futures = []
        for c, messages in enumerate(chats):
            text = f"{ASKS[(t + c) % len(ASKS)]} (conversation {c})"
            content = [{"type": "image", "image": pictures[c % len(pictures)]},
                       {"type": "text", "text": text}] if t == 0 else text  # fmt: skip
            messages.append({"role": "user", "content": content})
            futures.append(engine.submit_chat(messages, settings=settings))
        for messages, future in zip(chats, futures, strict=True):
            r = future.result()
            messages.append(r.message)
            ttft[t].append(r.metrics.ttft_ms)
            cached, prompt = cached + r.metrics.cached_tokens, prompt + r.metrics.input_tokens
    wall = time.perf_counter() - t0
    return {"ttft": ttft, "requests": n_conv * turns, "wall_s": wall, "hit": cached / prompt}


def run_variant(args: argparse.Namespace, options: dict, last: dict, name: str) -> dict:
    pictures = images(args.images)
    with Engine(args.model, device="cpu", dtype="float32", kv_cache_pages=40_000,
                max_batch_size=16, **options) as engine:  # fmt: skip
        engine.chat([{"role": "user", "content": "warm up"}], settings={"max_tokens": 1})
        w = converse(engine, pictures, args.conversations, args.turns)
        engine.check_integrity()
    last[name] = w
    out = {"rps": w["requests"] / w["wall_s"], "hit": 100 * w["hit"]}
    for t, xs in enumerate(w["ttft"], start=1):
        out[f"turn{t}"] = statistics.median(xs)
    out["later"] = statistics.median([x for xs in w["ttft"][1:] for x in xs])
    return out


def plot(last: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, w in last.items():
        turns = range(1, len(w["ttft"]) + 1)
        ax.plot(turns, [statistics.median(xs) for xs in w["ttft"]], "o-", label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("W4: 16 conversations x 6 turns over 8 images")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=FIXTURE, help="checkpoint (default: fixture)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--png", type=Path, default=Path("bench_out/ttft_chat_w4.png"))
    harness.add_arguments(ap, rounds=3)
    args = ap.parse_args(argv)
    if args.turns < 2 or args.conversations < 1 or args.images < 1:
        raise SystemExit("need at least 2 turns, 1 conversation and 1 image")
    bench = harness.start(args, "Conversations, workload W4 (bench_chat.py)")
    last: dict = {}
    runs = bench.run({name: lambda o=o, n=name: run_variant(args, o, last, n)
                      for name, o in VARIANTS.items()})  # fmt: skip
    bench.emit(f"\nW4: {args.conversations} conversations x {args.turns} turns over "
               f"{args.images} images, {TOKENS}-token greedy answers")  # fmt: skip
    bench.table(runs, {"later": "TTFT turns 2+ ms", "rps": "requests/s", "hit": "cached %"},
                baseline="cache off", fmt=".1f")  # fmt: skip
    bench.table(runs, {f"turn{t}": f"turn {t}" for t in range(1, args.turns + 1)}, fmt=".1f")
    for name in ("cache on", "on, no retention"):
        q = harness.ratio([r["later"] for r in runs[name]], [r["later"] for r in runs["cache off"]])
        bench.figures[f"TTFT turns 2+, {name} / cache off"] = harness.s_dict(q)
        bench.emit(f"TTFT turns 2..{args.turns}, {name} / cache off: {q.fmt('.3g', 'x')} -> "
                   f"goal <= 0.1x {'met' if q.median <= 0.1 else 'NOT met'}")  # fmt: skip
    if not args.json:
        path = plot(last, args.png)
        if path:
            bench.emit(f"plot (last round): {path}")
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
