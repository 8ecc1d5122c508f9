"""Online serving past one engine: ``kestrel serve --ray`` routed by image vs routed at random
vs one plain ``kestrel serve``, over HTTP, with many concurrent clients.

    python scripts/bench_serve_ray.py                      # 3 rounds, the defaults below
    python scripts/bench_serve_ray.py --smoke              # 2 scenes, 1 client, 1 replica
    python scripts/bench_serve_ray.py --smoke --variants "one serve"   # no Ray at all

The workload revisits: ``--images`` distinct synthetic scenes (``kestrel.tiny.synthetic``, an
unseen seed) x ``--questions`` questions, in a shuffled order, plus ``--chats`` conversations
of ``--turns`` turns each about one of the same scenes (``/v1/chat/completions``, each turn sends
the conversation so far). ``--clients`` threads take jobs from the shuffled list (a chat's turns
run in order on one client); every answer streams, and TTFT is measured where a user sees it:
sending the request -> the first text chunk. Greedy answers of ``--max-tokens``, the bundled
tiny model, CPU.

Variants, interleaved by the harness (``harness.py``), each measured on a freshly started server
(cold caches; starting it, loading the models and one text-only warm-up request per replica are
outside the clock):
- ``ray image``: ``kestrel serve --ray --replicas R`` (the ring on each image's digest);
- ``ray random``: the same with ``--routing random`` (any live replica: a cache-blind balancer);
- ``one serve``: plain ``kestrel serve``, one engine.

Figures per variant: requests/s over the timed workload, TTFT p50 / p99, the token-weighted
prefix hit rate and the vision encodes per distinct image, both counted from the answers'
metrics (an image request with no cached position ran the vision encoder). The targets: ``ray
image`` within 2 points of ``one serve``'s hit rate with ~1 encode per image; ``ray random``
measurably worse. On a machine with fewer cores than replicas x their CPUs the replicas share
the cores, so requests/s there says nothing about scaling.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import math
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import harness
import numpy as np

from kestrel.tiny.synthetic import make_scene

SEED = 5151  # any seed but the training one
QUESTIONS = (
    "How many shapes are there?",
    "Is there a circle?",
    "Is there a square?",
    "Is there a triangle?",
    "Is there a red circle?",
    "How many circles are there?",
    "How many squares are there?",
    "How many triangles are there?",
)
TURNS = ("What is in the picture?", "What colour is it?", "And its shape?", "How many?",
         "Is there anything else?", "Describe it again.")  # fmt: skip
MAX_CLIENTS = 256
STARTUP_S = 600


@dataclass(frozen=True, slots=True)
class Sample:
    ok: bool
    ttft_s: float  # nan when no text arrived
    input_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Job:
    image: int
    texts: tuple[str, ...]  # one question, or a chat's turns
    chat: bool


def scenes(n: int) -> list[str]:
    """``n`` distinct scenes as PNG data URLs."""
    urls = []
    for i in range(n):
        out = io.BytesIO()
        make_scene(SEED, i).pil().save(out, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(out.getvalue()).decode())
    return urls


def jobs(args: argparse.Namespace) -> list[Job]:
    questions = [(QUESTIONS * 8)[: args.questions]]
    out = [Job(i, (q,), False) for i in range(args.images) for q in questions[0]]
    turns = (TURNS * 8)[: args.turns]
    out += [Job(c % args.images, tuple(turns), True) for c in range(args.chats)]
    random.Random(SEED).shuffle(out)
    return out


# ---------------------------------------------------------------------- one client's requests
def _stream(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[Sample, str]:
    """POST a streaming request; the sample and the streamed text."""
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    ttft, text, metrics, ok = math.nan, [], None, False
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        piece = event.get("chunk")
        if event.get("choices"):
            piece = event["choices"][0].get("delta", {}).get("content")
        if piece:
            text.append(piece)
            if math.isnan(ttft):
                ttft = time.perf_counter() - t0
        if event.get("completed"):
            metrics, ok = event["metrics"], True
        if "usage" in event and event.get("choices") == []:
            u = event["usage"]
            metrics = {"input_tokens": u["prompt_tokens"],
                       "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip
            ok = True
    ok = ok and response.status == 200 and metrics is not None
    m = metrics or {"input_tokens": 0, "cached_tokens": 0}
    return Sample(ok, ttft, m["input_tokens"], m["cached_tokens"]), "".join(text)


def run_job(conn: http.client.HTTPConnection, path: str, job: Job, urls, settings) -> list[Sample]:
    if not job.chat:
        body = {"image_url": urls[job.image], "question": job.texts[0], "stream": True,
                "settings": settings}  # fmt: skip
        return [_stream(conn, f"{path}/query", body)[0]]
    image = {"type": "image_url", "image_url": {"url": urls[job.image]}}
    messages: list[dict] = []
    samples = []
    for i, text in enumerate(job.texts):
        content = [image, {"type": "text", "text": text}] if i == 0 else text
        messages.append({"role": "user", "content": content})
        body = {"model": "kestrel", "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0,
                "max_tokens": settings["max_tokens"]}  # fmt: skip
        sample, answer = _stream(conn, f"{path}/chat/completions", body)
        samples.append(sample)
        messages.append({"role": "assistant", "content": answer})
    return samples


def drive(url: str, work: list[Job], urls: list[str], clients: int, settings) -> dict:
    """``clients`` threads over the shuffled jobs; the figures of one measurement."""
    parts = urlsplit(url)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in work:
        todo.put(job)
    samples: list[Sample] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                break
            try:
                got = run_job(conn, parts.path.rstrip("/"), job, urls, settings)
            except (OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
                got = [Sample(False, math.nan, 0, 0)]
            with lock:
                samples.extend(got)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return figures(samples, wall, len(urls))


def figures(samples: list[Sample], wall_s: float, images: int) -> dict[str, float]:
    good = [s for s in samples if s.ok]
    ttft = np.array([s.ttft_s for s in good if not math.isnan(s.ttft_s)]) * 1000
    prompt = sum(s.input_tokens for s in good)
    encodes = sum(1 for s in good if s.cached_tokens == 0)  # every job here has an image

    def pct(q: float) -> float:
        return float(np.percentile(ttft, q)) if ttft.size else math.nan

    return {
        "rps": len(good) / wall_s,
        "ttft_p50_ms": pct(50),
        "ttft_p99_ms": pct(99),
        "hit_rate_pct": 100 * sum(s.cached_tokens for s in good) / prompt if prompt else 0.0,
        "encodes_per_image": encodes / images,
        "errors": float(len(samples) - len(good)),
    }


# ---------------------------------------------------------------------- servers
def server_cmd(args: argparse.Namespace, variant: str) -> list[str]:
    cmd = [sys.executable, "-m", "kestrel", "serve", "--port", "0", "--log-level", "warning",
           "--device", "cpu", "--dtype", "float32", "--max-batch-size", str(args.max_batch_size),
           "--max-queue", str(max(64, 4 * args.clients))]  # fmt: skip
    if variant != "one serve":
        cmd += ["--ray", "--replicas", str(args.replicas), "--routing", variant.split()[1]]
    return cmd


def measure(args: argparse.Namespace, variant: str, work, urls, settings) -> dict[str, float]:
    """Start a fresh server, warm it (untimed), run the workload, stop it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(server_cmd(args, variant), stdout=out,
                                    stderr=subprocess.STDOUT, env=env)  # fmt: skip
        try:
            url = _wait_for_url(proc, log)
            _warm(url, args.replicas * 4)
            return drive(url, work, urls, args.clients, settings)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_url(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text(errors="replace"))
        if found:
            return found.group(0)
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text(errors='replace')}")


def _warm(url: str, n: int) -> None:
    """Text-only requests (different texts reach different replicas): first-call costs paid."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    for i in range(n):
        body = {"question": f"Warm up {i}.", "stream": True, "settings": {"max_tokens": 2}}
        sample, _ = _stream(conn, f"{parts.path.rstrip('/')}/query", body)
        if not sample.ok:
            sys.exit(f"warm-up request failed against {url}")
    conn.close()


# ---------------------------------------------------------------------- main
VARIANTS = ("ray image", "ray random", "one serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--images", type=int, default=16, help="distinct scenes")
    p.add_argument("--questions", type=int, default=6, help="questions per scene")
    p.add_argument("--chats", type=int, default=8, help="conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--variants", default=",".join(VARIANTS), help="which, comma-separated")
    harness.add_arguments(p, rounds=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.replicas, args.images, args.questions, args.chats, args.turns = 1, 2, 1, 1, 2
        args.clients, args.max_tokens = 1, 2
    args.variants = tuple(v.strip() for v in args.variants.split(","))
    if not set(args.variants) <= set(VARIANTS):
        p.error(f"--variants: any of {', '.join(VARIANTS)}")
    if not 1 <= args.clients <= MAX_CLIENTS:
        p.error(f"--clients must be 1..{MAX_CLIENTS}")
    for name in ("replicas", "images", "questions", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.chats < 0:
        p.error("--chats must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = harness.start(args, "kestrel serve --ray: image vs random routing vs one serve "
                          "(bench_serve_ray.py)")  # fmt: skip
    urls, work = scenes(args.images), jobs(args)
    settings = {"temperature": 0, "max_tokens": args.max_tokens}
    variants = args.variants
    runs = bench.run({v: (lambda v=v: measure(args, v, work, urls, settings)) for v in variants})
    requests = sum(len(j.texts) for j in work)
    bench.emit(
        f"\n{requests} requests per run: {args.images} scenes x {args.questions} questions "
        f"(shuffled) + {args.chats} chats x {args.turns} turns; {args.clients} clients, "
        f"streaming, max_tokens {args.max_tokens}; {args.replicas} replicas; "
        f"{os.cpu_count()} cores on this machine"
    )
    metrics = {"rps": "requests/s", "ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms",
               "hit_rate_pct": "hit rate %", "encodes_per_image": "encodes / image",
               "errors": "errors"}  # fmt: skip
    base = "one serve" if "one serve" in variants else None
    bench.table(runs, metrics, baseline=base, fmt=".2f")
    hit = {v: [r["hit_rate_pct"] for r in runs[v]] for v in variants}
    if {"ray image", "one serve"} <= set(variants):
        gap = [a - b for a, b in zip(hit["ray image"], hit["one serve"], strict=True)]
        bench.emit(
            f"\nhit rate, ray image minus one serve: {harness.spread(gap).fmt(suffix=' pts')}"
        )
    bench.finish({"requests_per_run": requests})


if __name__ == "__main__":
    main()
