"""HTTP serving benchmark: N concurrent clients for T seconds against ``kestrel serve`` over
loopback, then the same workload through ``Engine`` in-process; the ratio is the HTTP overhead.

Each client keeps one keep-alive connection and loops over (image, question) pairs, streaming
each answer (``"stream": true``) so time to first token is measured where a user sees it: from
sending the request to the first ``data: {"chunk"}`` event. Latency runs to the ``completed``
event. The in-process run uses the same engine options, images (as encoded bytes, so decoding
and hashing are paid on both sides), questions and settings, with one thread per client
iterating ``engine.query(..., stream=True)``. Both runs warm the cache with one pass over the
images first, so they compare steady state. The two run interleaved through the harness
(``harness.py``), one HTTP run and one Engine run per round; the server stays up between its
runs but is idle while the Engine runs (its scheduler thread blocks on its inbox), and each
Engine run gets a fresh engine. Figures are medians (min-max) over ``--rounds`` rounds.

    python scripts/bench_server.py                                   # fixture model, own server
    python scripts/bench_server.py --clients 16 --seconds 20 --max-tokens 32 --rounds 5
    python scripts/bench_server.py --url http://127.0.0.1:2020/v1 --model path/to/moondream2
    python scripts/bench_server.py --smoke    # kestrel-tiny, 1 client x 0.5 s, one image

Bounded: at most 256 clients and 300 seconds, loopback addresses only.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import ipaddress
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import harness
import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "md2-tiny-a"
QUESTIONS = [f"Question {i}: what is in the picture?" for i in range(16)]
MAX_CLIENTS, MAX_SECONDS = 256, 300.0


@dataclass(frozen=True, slots=True)
class Sample:
    ok: bool
    ttft_s: float  # nan when no chunk arrived
    latency_s: float


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    errors: int
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float


def summarize(samples: list[Sample], wall_s: float) -> Summary:
    good = [s for s in samples if s.ok]
    ttft = np.array([s.ttft_s for s in good if not math.isnan(s.ttft_s)]) * 1000
    lat = np.array([s.latency_s for s in good]) * 1000

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if a.size else math.nan

    return Summary(
        requests=len(samples),
        errors=len(samples) - len(good),
        requests_per_s=len(good) / wall_s,
        ttft_p50_ms=pct(ttft, 50),
        ttft_p99_ms=pct(ttft, 99),
        latency_p50_ms=pct(lat, 50),
        latency_p99_ms=pct(lat, 99),
    )


def workload(image_paths: list[Path]) -> list[tuple[bytes, str]]:
    images = [p.read_bytes() for p in image_paths]
    return [(img, q) for q in QUESTIONS for img in images]


def run_clients(n: int, seconds: float, one: Callable[[int, int], Sample]) -> tuple[list, float]:
    """``n`` threads calling ``one(client, i)`` until ``seconds`` have passed."""
    samples: list[Sample] = []
    lock = threading.Lock()
    start = time.perf_counter()
    stop_at = start + seconds

    def loop(client: int) -> None:
        i = client
        while time.perf_counter() < stop_at:
            s = one(client, i)
            i += n
            with lock:
                samples.append(s)

    threads = [threading.Thread(target=loop, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - start


# ---------------------------------------------------------------------- over HTTP
class HttpClient:
    def __init__(self, url: str, bodies: list[bytes]) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port, parts.path.rstrip("/")
        self.bodies = bodies
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        return conn

    def one(self, _client: int, i: int) -> Sample:
        t0 = time.perf_counter()
        ttft, ok = math.nan, False
        try:
            conn = self._conn()
            conn.request("POST", f"{self.path}/query", self.bodies[i % len(self.bodies)],
                         {"Content-Type": "application/json"})  # fmt: skip
            response = conn.getresponse()
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "chunk" in event and math.isnan(ttft):
                    ttft = time.perf_counter() - t0
                ok = ok or bool(event.get("completed"))
            ok = ok and response.status == 200
        except (OSError, http.client.HTTPException):
            self._local.conn = None  # reconnect on the next request
        return Sample(ok, ttft, time.perf_counter() - t0)


def http_bodies(pairs: list[tuple[bytes, str]], settings: dict) -> list[bytes]:
    out = []
    for image, question in pairs:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        body = {"image_url": url, "question": question, "stream": True, "settings": settings}
        out.append(json.dumps(body).encode())
    return out


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kestrel", "serve", "--port", "0", "--log-level", "warning",
           *engine_flags(args), "--max-queue", str(max(64, 2 * args.clients))]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text(errors="replace"))
        if found:
            return proc, found.group(0)
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"kestrel serve did not start:\n{log.read_text(errors='replace')}")


def bench_http(args: argparse.Namespace, url: str, pairs, settings) -> Summary:
    client = HttpClient(url, http_bodies(pairs, settings))
    warm = [client.one(0, i) for i in range(len(args.images))]  # one miss per image
    if not all(s.ok for s in warm):
        sys.exit(f"warm-up requests failed against {url}")
    samples, wall = run_clients(args.clients, args.seconds, client.one)
    return summarize(samples, wall)


# ---------------------------------------------------------------------- in-process
def bench_engine(args: argparse.Namespace, pairs, settings) -> Summary:
    from kestrel import Engine

    with Engine(args.model, **engine_kwargs(args)) as engine:

        def one(_client: int, i: int) -> Sample:
            image, question = pairs[i % len(pairs)]
            t0 = time.perf_counter()
            ttft = math.nan
            try:
                stream = engine.query(image, question, settings=settings, stream=True)
                for _delta in stream:
                    if math.isnan(ttft):
                        ttft = time.perf_counter() - t0
                stream.result()
            except Exception:
                return Sample(False, ttft, time.perf_counter() - t0)
            return Sample(True, ttft, time.perf_counter() - t0)

        for i in range(len(args.images)):
            one(0, i)
        samples, wall = run_clients(args.clients, args.seconds, one)
    return summarize(samples, wall)


# ---------------------------------------------------------------------- options and report
def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"device": args.device, "dtype": args.dtype, "kv_cache_pages": args.kv_cache_pages,
            "max_batch_size": args.max_batch_size}  # fmt: skip


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", str(args.model), "--device", args.device]
    flags += ["--max-batch-size", str(args.max_batch_size)]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if args.kv_cache_pages:
        flags += ["--kv-cache-pages", str(args.kv_cache_pages)]
    return flags


def report(bench: harness.Bench, runs: harness.Runs, args: argparse.Namespace) -> None:
    bench.emit(
        f"\n{args.clients} clients x {args.seconds:g} s, streaming query, max_tokens "
        f"{args.max_tokens}, {len(args.images)} images x {len(QUESTIONS)} questions"
    )
    metrics = {"requests_per_s": "requests/s", "ttft_p50_ms": "TTFT p50 ms",
               "ttft_p99_ms": "TTFT p99 ms", "latency_p50_ms": "latency p50 ms",
               "latency_p99_ms": "latency p99 ms", "errors": "errors"}  # fmt: skip
    bench.table(runs, metrics, fmt=".1f")
    http, direct = runs["HTTP (kestrel serve)"], runs["Engine (in-process)"]
    bench.emit("")
    bench.ratio_line(
        "HTTP overhead, throughput (Engine / HTTP requests/s)",
        [r["requests_per_s"] for r in direct],
        [r["requests_per_s"] for r in http],
    )
    bench.ratio_line(
        "HTTP overhead, latency p50 (HTTP / Engine)",
        [r["latency_p50_ms"] for r in http],
        [r["latency_p50_ms"] for r in direct],
    )


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server's .../v1 (default: start one)")
    p.add_argument("--model", default=str(FIXTURE), help="checkpoint (the server's, with --url)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--images", nargs="+", type=Path,
                   default=sorted((FIXTURE / "images").glob("*.png")))  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-pages", type=int, default=20_000)
    p.add_argument("--max-batch-size", type=int, default=16)
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    if args.smoke:
        from kestrel.tiny import MODEL_DIR

        args.model = str(MODEL_DIR) if args.model == str(FIXTURE) else args.model
        args.clients, args.seconds, args.max_tokens, args.images = 1, 0.5, 2, args.images[:1]
        args.kv_cache_pages = 2_000
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds in (0, {MAX_SECONDS:g}]")
    if args.url and not _loopback(args.url):
        p.error("--url must be a loopback address (127.0.0.0/8, ::1 or localhost)")
    return args


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """``--url``, or a ``kestrel serve`` of our own for the benchmark's lifetime."""
    if args.url:
        yield args.url
        return
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args, Path(tmp) / "server.log")
        try:
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = harness.start(args, "HTTP server against the in-process Engine (bench_server.py)")
    settings = {"temperature": 0, "max_tokens": args.max_tokens}
    pairs = workload(args.images)
    with server_url(args) as url:
        runs = bench.run(
            {
                "HTTP (kestrel serve)": lambda: asdict(bench_http(args, url, pairs, settings)),
                "Engine (in-process)": lambda: asdict(bench_engine(args, pairs, settings)),
            }
        )
    report(bench, runs, args)
    bench.finish()


if __name__ == "__main__":
    main()
