"""ChartQA-shaped image QA through the Engine: requests/s and median latency by batch size.

    python scripts/bench_gpu.py [--model DIR] [--batches 1,4,16,64] [--requests N[,N..]] [--json]
    python scripts/bench_gpu.py --smoke [--allow-busy]       # CPU proof: kestrel-tiny, tiny counts
    python scripts/bench_gpu.py --batches 1,64 --cot-tokens 64 --rounds 1 --summary  # gpu_check
    python scripts/bench_gpu.py --family md3 --batches 1,64 --requests 16,64  # Moondream 3

The workload is shaped like ChartQA: generated charts (bar and line charts with a title, axes
and labels, 640-900 x 480-640 PNGs, sent as encoded bytes the way a client sends them), about
1.66 questions per chart (each chart's questions one after the other), questions of 12-20
tokens of the model's own tokenizer, asked three ways: ``direct`` (a short answer, at most 4
tokens), ``cot`` (``reasoning=True``, at most ``--cot-tokens``) and ``cot30`` (below); each
``--requests`` per run, one count or one per batch. Each runs greedy and with
Moondream's default sampling (temperature 0.5, top-p 0.3), as a closed loop of ``batch``
requests in flight (a new one is submitted as one finishes) for batch 1, 4, 16 and 64.
requests/s = requests / wall time; latency = submit (the image decoded and hashed on the
caller's thread included) to result. Every run uses charts never seen before, so cache hits
come only from a chart's own questions. Variants run interleaved through the harness
(``harness.py``): median (min-max) over the rounds.

``cot30`` asks the same way as ``cot`` with 14 thinking and 14 answer tokens: ~30 tokens out,
the length of Kestrel's published CoT answers (~28 for Moondream 2, ~31 for Moondream 3; its
direct answers average ~3), where CoT-64's 130 steps compare with nothing. ``--family``:
``md2`` (below), ``md3`` -- a random Moondream 3 of the published dimensions (24 layers of
2048, 64 experts of 1024, top 8, from layer 4, FP8 experts as published), its weights made on
the device while the Engine loads (``bench_gpu_models.py``: a ~10 GB checkpoint would not fit
the GPU check's budget), the same tokenizer widening; on ``--smoke`` the md3-tiny-a fixture's
widths -- or ``both``, one Engine after the other (the first closed and its memory freed).
Kestrel's published figures for the family's direct and cot30 rows are printed beside them.

The model: ``--model DIR`` (a Moondream 2 checkpoint), else a random-weight checkpoint of
Moondream 2's dimensions (1.9 B parameters, 729 image tokens), written once to ``--model-dir``
with a tokenizer widened to its 51,200 ids: it answers gibberish and never stops early, so
every answer is exactly ``max_tokens`` long, a fixed and slightly pessimistic load. Kestrel's
published ChartQA figures for Moondream 2 on an H100 (41.9 requests/s at batch 1, 57.0 at
batch 64) and our last H100 measurement (11.7 / 17.2, the runtime-level loop of
``bench_gpu_runtime.py``) are printed beside the direct rows.

Traffic from the first moment: ``--startup-threads`` threads (default 16) start before the
Engine does, pin and upload host memory while it starts (what once broke its graph captures)
and submit ``--startup-requests`` queries each the moment it exists. A failed request never
stops the bench: it is counted (``failed`` per row, ``failed_requests`` in all), as are the
decode graphs that failed to capture. ``--summary`` prints one JSON line at the end: the
device, requests/s per row, failed requests, failed captures (``scripts/gpu_check.sh``);
with ``--family both``, Moondream 2's under the same keys and Moondream 3's under ``md3``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import bench_gpu_models as models
import harness
import numpy as np
import torch
from chart_workload import (
    QUESTIONS_PER_IMAGE,
    SUBJECTS,
    TEMPLATES,
    Query,
    chart_png,
    chart_workload,
)

from kestrel import Engine
from kestrel_kernels import fused

PUBLISHED_REQ_S = {1: 41.9, 64: 57.0}  # Kestrel, Moondream 2, ChartQA, one H100
OURS_BEFORE_REQ_S = {1: 11.7, 64: 17.2}  # bench_gpu_runtime.py, one H100 (docs/kernels.md)
# Kestrel's published ChartQA figures on one H100, requests/s by batch, per family and mode:
# Moondream 3 (preview, FP8 experts, prefix cache on) direct and CoT; Moondream 2's CoT. Their
# CoT answers average ~28 (Moondream 2) / ~31 (Moondream 3) tokens: the ``cot30`` rows' length
PUBLISHED = {
    ("md2", "direct"): PUBLISHED_REQ_S,
    ("md2", "cot30"): {1: 16.2, 64: 48.8},
    ("md3", "direct"): {1: 34.62, 64: 53.03},
    ("md3", "cot30"): {1: 13.53, 64: 41.54},
}
COT30_TOKENS = 14  # thinking and answer each: ~30 tokens out, as Kestrel's CoT answers
SMOKE_MD3 = "md3-tiny-a"  # the smoke run's Moondream 3: the fixture's widths, FP8 experts
SAMPLING = {"greedy": {"temperature": 0.0}, "default": {"temperature": 0.5, "top_p": 0.3}}
DIRECT_TOKENS = 4
# where a lone request's time goes (p50 ms): the caller's submit (decode and hash), and apart
# for a chart sent the first time and again (no decode: images/known.py), time to first token
# of a miss and of a hit, a miss's wait for admission and its prefill step (the crops awaited,
# the vision encoder, the prefill), and the decode after the first token
PARTS = ("submit_ms", "submit_new_ms", "submit_again_ms", "ttft_miss_ms", "ttft_hit_ms",
         "queue_miss_ms", "prefill_miss_ms", "decode_ms")  # fmt: skip


def measure(engine: Engine, queries: list[Query], batch: int, settings: dict, cot: bool) -> dict:
    """Run ``queries`` with ``batch`` in flight; requests/s, p50 latency, mean tokens out, and
    where a request's time went (p50 ms, ``PARTS``)."""
    slots, done, lock = threading.Semaphore(batch), threading.Event(), threading.Lock()
    latency, tokens, errors, submit = [], [], [], []
    parts: dict[str, list[float]] = {k: [] for k in PARTS if k != "submit_ms"}

    def finished(future, t0: float) -> None:  # on the scheduler thread: keep it short
        latency.append(time.perf_counter() - t0)
        if future.exception() is not None:
            errors.append(future.exception())
        else:
            m = future.result().metrics
            tokens.append(m.output_tokens + m.reasoning_tokens)  # CoT: thinking + answer
            parts["ttft_hit_ms" if m.cache_tier != "none" else "ttft_miss_ms"].append(m.ttft_ms)
            parts["decode_ms"].append(m.decode_ms)
            if m.cache_tier == "none":  # a miss's time to first token, split
                parts["queue_miss_ms"].append(m.queue_ms)
                parts["prefill_miss_ms"].append(m.prefill_ms)
        slots.release()
        with lock:
            if len(latency) == len(queries):
                done.set()

    start, sent = time.perf_counter(), set()
    for q in queries:
        slots.acquire()
        t0 = time.perf_counter()
        future = engine.submit_query(q.image, q.question, settings=settings, reasoning=cot)
        submit.append(time.perf_counter() - t0)
        parts["submit_again_ms" if q.image in sent else "submit_new_ms"].append(1e3 * submit[-1])
        sent.add(q.image)
        future.add_done_callback(partial(finished, t0=t0))
    done.wait()
    wall = time.perf_counter() - start
    if errors:
        print(f"{len(errors)} of {len(queries)} requests failed: {errors[0]!r}", flush=True)
    p50 = {k: statistics.median(v) if v else float("nan") for k, v in parts.items()}
    return {"rps": (len(queries) - len(errors)) / wall,
            "p50_ms": 1e3 * statistics.median(latency),
            "tokens": statistics.mean(tokens) if tokens else 0.0,
            "failed": float(len(errors)),
            "submit_ms": 1e3 * statistics.median(submit), **p50}  # fmt: skip


class StartupTraffic:
    """``threads`` clients started before the Engine: until it exists each pins and uploads
    host memory (on CUDA), then submits ``per_thread`` queries about fresh charts."""

    def __init__(self, threads: int, per_thread: int, cuda: bool) -> None:
        self.ready, self.engine = threading.Event(), None
        self.failed, self.done, self.lock = 0, 0, threading.Lock()
        self.per_thread, self.cuda = per_thread, cuda
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def serve(self, engine: Engine | None) -> None:
        """The engine is up (None: it failed to start; the clients stop)."""
        self.engine = engine
        self.ready.set()

    def join(self) -> tuple[int, int]:
        """(requests that succeeded, requests that failed)."""
        for t in self.threads:
            t.join()
        return self.done, self.failed

    def _client(self, seed: int) -> None:
        rng = np.random.default_rng(1000 + seed)
        charts = [chart_png(rng) for _ in range(2)]
        while not self.ready.wait(0.002):
            if self.cuda:
                torch.ones(1 << 16).pin_memory().to("cuda", non_blocking=True)
        if self.engine is None:
            return
        futures = []
        for i in range(self.per_thread):
            words = str(rng.choice(TEMPLATES)).format(s=rng.choice(SUBJECTS), a="2019", b="2020")
            futures.append(self.engine.submit_query(
                charts[i % 2], words, settings={"temperature": 0.0, "max_tokens": DIRECT_TOKENS}
            ))  # fmt: skip
        for f in futures:
            ok = f.exception(timeout=600) is None
            with self.lock:
                self.done += ok
                self.failed += not ok


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("md2", "md3", "both"), default="md2",
                   help="Moondream 2, Moondream 3 (made on the device) or both")  # fmt: skip
    p.add_argument("--model", help="a Moondream 2 checkpoint (default: random weights, below)")
    p.add_argument("--model-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "kestrel-bench-md2-random")  # fmt: skip
    p.add_argument("--md3-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "kestrel-bench-md3-random",
                   help="where Moondream 3's config and tokenizer are written")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="CPU proof: kestrel-tiny, batches 1,4, 4 requests each")  # fmt: skip
    p.add_argument("--batches", help="requests in flight (default 1,4,16,64; smoke 1,4)")
    p.add_argument("--requests", help="per run: one count, or one per batch "
                   "(default max(32, 4 x batch); smoke 4)")  # fmt: skip
    p.add_argument("--modes", default="direct,cot,cot30",
                   help="any of direct, cot (--cot-tokens) and cot30 (14 + 14 tokens)")  # fmt: skip
    p.add_argument("--sampling", default="greedy,default", help="greedy, default or both")
    p.add_argument("--cot-tokens", type=int, help="cot answers' max_tokens (default 128; smoke 8)")
    p.add_argument("--compile", action="store_true",
                   help="Engine(compile=True): decode and prefill through torch.compile "
                   "(the warm-up compiles most shapes: use --rounds 3)")  # fmt: skip
    p.add_argument("--no-lookahead", action="store_true",
                   help="Engine(lookahead=False): read each decode step back before queueing "
                   "the next (the default on CUDA queues it first)")  # fmt: skip
    p.add_argument("--startup-threads", type=int, default=16,
                   help="clients submitting while the Engine starts (0: none)")  # fmt: skip
    p.add_argument("--startup-requests", type=int, default=4, help="queries per such client")
    p.add_argument("--summary", action="store_true",
                   help="print one JSON line at the end: req/s per row, failures")  # fmt: skip
    harness.add_arguments(p, rounds=2)
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: --smoke runs the CPU proof")
    batches = args.batches or ("1,4" if args.smoke else "1,4,16,64")
    args.batches = [int(b) for b in batches.split(",")]
    counts = [int(n) for n in args.requests.split(",")] if args.requests else []
    if len(counts) not in (0, 1, len(args.batches)):
        p.error("--requests: one count, or one per batch of --batches")
    default = [4 if args.smoke else max(32, 4 * b) for b in args.batches]
    args.requests = dict(zip(args.batches, counts * len(args.batches) if len(counts) == 1
                             else counts or default, strict=True))  # fmt: skip
    args.cot_tokens = args.cot_tokens or (8 if args.smoke else 128)
    return args


def variants(engine: Engine, args: argparse.Namespace, n_tokens) -> dict:
    """One harness variant per (mode, sampling, batch); each run on charts never seen before."""
    seeds = itertools.count(1)
    out = {}
    for mode in args.modes.split(","):
        cot = {"direct": False, "cot": True, "cot30": True}[mode]
        max_tokens = {"direct": DIRECT_TOKENS, "cot": args.cot_tokens, "cot30": COT30_TOKENS}[mode]
        for name in args.sampling.split(","):
            settings = {**SAMPLING[name], "max_tokens": max_tokens}
            for b, n in args.requests.items():

                def run(b=b, n=n, settings=settings, cot=cot) -> dict:
                    queries = chart_workload(n, n_tokens, seed=next(seeds))
                    return measure(engine, queries, b, settings, cot)

                out[f"{mode}, {name}, batch {b}"] = run
    return out


def compare(bench, runs: dict, family: str) -> None:
    """The rows at batch 1 and 64 that Kestrel published (and our earlier H100 figures for
    Moondream 2's direct rows) beside ours."""
    rows = [(name, mode, b) for name in runs for (fam, mode), by in PUBLISHED.items()
            for b in by if fam == family and name.startswith(f"{mode},")
            and name.endswith(f"batch {b}")]  # fmt: skip
    if not rows:
        return
    bench.emit("\n| workload | requests/s (median) | Kestrel published (H100) | "
               "ours before (H100) |\n|---|---|---|---|")  # fmt: skip
    for name, mode, b in rows:
        rps = statistics.median(r["rps"] for r in runs[name])
        before = OURS_BEFORE_REQ_S[b] if (family, mode) == ("md2", "direct") else "-"
        bench.emit(f"| {family} {name} | {rps:.1f} | {PUBLISHED[family, mode][b]} | {before} |")


def _launch(config) -> list[int] | None:
    if config is None:
        return None
    return [config.heads, config.block_n, config.num_warps, config.target_programs]


def summary(engine: Engine, runs: dict, startup: tuple[int, int], device: str) -> dict:
    """The one-line result: req/s per row (median), failed requests, failed captures."""
    graphs, prefill = engine.runtime.decode_graphs, engine.runtime.prefill_graphs
    failed = sum(int(r["failed"]) for rounds in runs.values() for r in rounds) + startup[1]
    rps = {
        name: round(statistics.median(r["rps"] for r in rounds), 2) for name, rounds in runs.items()
    }
    breakdown = {  # batch 1: where a lone request's time goes (p50 ms, median over rounds)
        name: {k: round(statistics.median(r[k] for r in rounds), 2) for k in PARTS}
        for name, rounds in runs.items() if name.endswith("batch 1")
    }  # fmt: skip
    return {
        "device": device,
        "req_s": rps,
        "batch1_ms": breakdown,
        "failed_requests": failed,
        "startup_requests": sum(startup),
        "failed_captures": len(graphs.failures) if graphs is not None else 0,
        "captured": list(graphs.captured) if graphs is not None else [],
        "failed_prefill_captures": len(prefill.failures) if prefill is not None else 0,
        "prefill_captured": len(prefill.captured) if prefill is not None else 0,
        "crops_on_device": engine.runtime.crops.on_device,  # a lone new image's (kernels.md)
        "decode_kernels": {  # the start-up choice per bucket (decode_tune.py): ms fa / triton,
            # Triton's fastest launch (heads, block_n, num_warps, target_programs)
            t.batch: [t.choice, t.fa_ms, t.triton_ms, _launch(t.config)]
            for t in engine.runtime.decode_trials
        },
    }


def start_engine(args: argparse.Namespace, device: str, family: str) -> tuple[Engine, object]:
    """The Engine, started while ``--startup-threads`` clients wait to submit."""
    if family == "md3":  # weights made on the device (bench_gpu_models.py)
        sections = None
        if args.smoke:
            from kestrel.moondream.config import MoondreamConfig
            from kestrel.testing.random_checkpoint import config_to_dict

            small = MoondreamConfig.from_json_file(models.FIXTURES["md3"] / "config.json")
            sections = {k: v for k, v in config_to_dict(small).items() if k != "tokenizer"}
        source = models.md3_folder(args.md3_dir, sections)
    elif args.model or args.smoke:
        source = args.model
    else:
        source = models.random_md2_checkpoint(args.model_dir)
    traffic = StartupTraffic(args.startup_threads, args.startup_requests, device == "cuda")
    try:
        with models.md3_on_device(args.md3_dir):
            engine = Engine(
                source,
                device=device,
                max_batch_size=max(args.batches),
                compile=args.compile,
                lookahead=False if args.no_lookahead else None,
            )
    except BaseException:
        traffic.serve(None)
        raise
    traffic.serve(engine)
    return engine, traffic


def run_family(args: argparse.Namespace, device: str, family: str) -> dict | None:
    """One family's bench (its own Engine, closed before the next starts): its table, the
    published figures beside it, and its summary line."""
    engine, traffic = start_engine(args, device, family)
    line = None
    try:
        encode = engine.runtime.tokenizer.encode
        n_tokens = lambda text: len(encode(text))  # noqa: E731
        bench = harness.start(args, f"ChartQA-shaped image QA through the Engine ({family})")
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        sample = chart_workload(64, n_tokens, seed=0)
        lengths = [n_tokens(q.question) for q in sample]
        bench.emit(f"device: {name}; model: {family}, {engine.model_path}; dtype "
                   f"{engine.runtime.dtype}; question tokens {min(lengths)}-{max(lengths)} "
                   f"(mean {statistics.mean(lengths):.1f}); {QUESTIONS_PER_IMAGE} questions per "
                   f"chart; direct max {DIRECT_TOKENS} tokens, cot max {args.cot_tokens}, "
                   f"cot30 max {COT30_TOKENS} + {COT30_TOKENS}; torch.compile "
                   f"{'on' if args.compile else 'off'}; decode look-ahead "
                   f"{'on' if engine.lookahead else 'off'}; fused ops "
                   f"{fused.fused_backend(torch.device(device))}")  # fmt: skip
        startup = traffic.join()
        bench.emit(f"start-up traffic: {startup[0]} requests served, {startup[1]} failed")
        for b in args.batches:  # warm: allocator, attention kernels of each shape
            measure(engine, sample[:b], b, {"temperature": 0.0, "max_tokens": 2}, False)
        runs = bench.run(variants(engine, args, n_tokens))
        metrics = {"rps": "requests/s", "p50_ms": "p50 latency ms",
                   "tokens": "tokens out (thinking + answer)", "failed": "failed"}  # fmt: skip
        bench.table(runs, metrics, fmt=".1f")
        compare(bench, runs, family)
        engine.check_integrity()
        line = {"family": family, **summary(engine, runs, startup, name)}
    finally:
        engine.close()  # its memory goes back once main collects it (its frame gone)
    bench.finish({"published": {f"{f} {m}": by for (f, m), by in PUBLISHED.items()},
                  "ours_before_req_s": OURS_BEFORE_REQ_S, "summary": line})  # fmt: skip
    return line


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = "cpu" if args.smoke else "cuda"
    families = ("md2", "md3") if args.family == "both" else (args.family,)
    lines = {}
    for family in families:  # each engine freed before the next is built: its KV pool is
        lines[family] = run_family(args, device, family)  # sized from the free memory
        gc.collect()  # the closed engine's reference cycles
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.summary:  # the first family's keys at the top, any second one under its name
        first, *rest = families
        print(json.dumps({**(lines[first] or {}), **{f: lines[f] for f in rest}}), flush=True)


if __name__ == "__main__":
    main()
