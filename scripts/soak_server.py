"""Memory soak: the server's resident size (RSS) under a conversation load, sampled over time.

Starts ``kestrel serve`` (the embedded kestrel-tiny unless ``--model``), measures its idle RSS
once it answers, then runs ``--clients`` threads for ``--seconds``, each holding conversations
of ``--turns`` turns through ``POST /v1/chat/completions`` (the first turn brings one of
``--images`` fresh pictures, so images are decoded all the time), and samples the server's
``VmRSS`` from ``/proc`` every ``--every`` seconds. It prints:

- idle: RSS after start, before any request;
- plateau: the median RSS over the last third of the run;
- peak: the largest sample, and peak / idle;
- slope: MB per minute, a least-squares line through the second half of the run;
- the requests served and failed.

This is a memory measurement, not a timing one: the figures do not depend on the machine being
idle (the request count does). ``--malloc system`` runs the server with glibc's default
allocator settings (``KESTREL_MALLOC=system``), for comparison with the bounded arenas
``kestrel serve`` sets by default. ``--csv`` writes every sample.

    python scripts/soak_server.py                          # 16 clients, 300 s
    python scripts/soak_server.py --smoke                  # 1 client, 1 s, 2-turn chats
    python scripts/soak_server.py --malloc system          # glibc's defaults, for comparison

Linux only (``/proc``); loopback only.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

QUESTIONS = ["What is in the picture?", "What colour is the biggest shape?",
             "How many shapes are there?", "Describe the scene.", "Is there a circle?",
             "What is at the top left?"]  # fmt: skip
MAX_SECONDS, MAX_CLIENTS = 3600.0, 128


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def images(n: int, seed: int = 0) -> list[str]:
    """``n`` JPEG data URLs of noisy pictures with shapes, of a few camera-like sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = [(640, 480), (1024, 768), (800, 800), (1280, 720)][i % 4]
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        pixels[y0 : y0 + h // 3, x0 : x0 + w // 3] = rng.integers(0, 255, 3, dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


@dataclass(slots=True)
class Tally:
    ok: int = 0
    failed: int = 0


class Conversations:
    """One client: conversations of ``turns`` turns on a keep-alive connection."""

    def __init__(self, port: int, pictures: list[str], args: argparse.Namespace) -> None:
        self.port, self.pictures, self.args = port, pictures, args
        self.tally = Tally()

    def _post(self, conn: http.client.HTTPConnection, body: dict) -> dict | None:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        data = response.read()
        return json.loads(data) if response.status == 200 else None

    def run(self, client: int, stop: float) -> None:
        rng = random.Random(client)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while time.monotonic() < stop:
            picture = rng.choice(self.pictures)
            first = [{"type": "image_url", "image_url": {"url": picture}},
                     {"type": "text", "text": rng.choice(QUESTIONS)}]  # fmt: skip
            messages: list[dict] = [{"role": "user", "content": first}]
            for _ in range(self.args.turns):
                if time.monotonic() >= stop:
                    break
                body = {"model": "soak", "messages": messages, "temperature": 0,
                        "max_tokens": self.args.max_tokens}  # fmt: skip
                try:
                    answer = self._post(conn, body)
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                    answer = None
                if answer is None:
                    self.tally.failed += 1
                    break
                self.tally.ok += 1
                messages += [answer["choices"][0]["message"],
                             {"role": "user", "content": rng.choice(QUESTIONS)}]  # fmt: skip
        conn.close()


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "kestrel", "serve", "--port", "0", "--log-level", "warning",
           "--device", args.device]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if args.malloc == "system":
        env["KESTREL_MALLOC"] = "system"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if found:
            port = int(found.group(1))
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/health")
                if conn.getresponse().status == 200:
                    return proc, port
            except OSError:
                pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"kestrel serve did not start:\n{log.read_text(errors='replace')}")


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return float("nan")
    t = np.array([s[0] for s in half])
    r = np.array([s[1] for s in half])
    return float(np.polyfit(t / 60.0, r, 1)[0])


def soak(args: argparse.Namespace, port: int, pid: int) -> tuple[float, list, list[Tally]]:
    time.sleep(0.2 if args.smoke else 2.0)  # let start-up work (and the first trim) settle
    idle = rss_mb(pid)
    pictures = images(args.images)
    clients = [Conversations(port, pictures, args) for _ in range(args.clients)]
    start = time.monotonic()
    stop = start + args.seconds
    threads = [threading.Thread(target=c.run, args=(i, stop), daemon=True)
               for i, c in enumerate(clients)]  # fmt: skip
    for th in threads:
        th.start()
    samples = []
    while time.monotonic() < stop:
        samples.append((time.monotonic() - start, rss_mb(pid)))
        time.sleep(args.every)
    for th in threads:
        th.join(timeout=150)
    return idle, samples, [c.tally for c in clients]


def report(args, idle: float, samples: list, tallies: list[Tally]) -> None:
    rss = [r for _, r in samples]
    plateau = float(np.median(rss[-max(1, len(rss) // 3) :]))
    peak = max(rss)
    ok, failed = sum(t.ok for t in tallies), sum(t.failed for t in tallies)
    allocator = "glibc defaults" if args.malloc == "system" else "kestrel serve's bounded arenas"
    print(f"soak: {args.clients} clients x {args.seconds:.0f} s of {args.turns}-turn "
          f"conversations over {args.images} images; allocator: {allocator}")  # fmt: skip
    print(f"  requests: {ok} served, {failed} failed")
    print(f"  RSS idle    {idle:8.1f} MB")
    print(f"  RSS plateau {plateau:8.1f} MB  (median of the last third)")
    print(f"  RSS peak    {peak:8.1f} MB  ({peak / idle:.2f} x idle)")
    print(f"  slope       {slope_mb_per_min(samples):+8.2f} MB/min (second half)")
    minutes = {}
    for t, r in samples:
        minutes.setdefault(int(t // 30), []).append(r)
    print("  RSS by 30 s: " + ", ".join(f"{max(v):.0f}" for _, v in sorted(minutes.items())))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--every", type=float, default=1.0, help="sampling period in seconds")
    p.add_argument("--malloc", choices=("kestrel", "system"), default="kestrel")
    p.add_argument("--csv", type=Path, default=None, help="write (seconds, rss_mb) samples")
    p.add_argument("--smoke", action="store_true", help="1 client for 1 s, 2-turn chats")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.seconds, args.turns, args.images = 1, 1.0, 2, 1
        args.max_tokens, args.every = 2, 0.25
    if not (0 < args.seconds <= MAX_SECONDS and 0 < args.clients <= MAX_CLIENTS):
        p.error(f"--seconds in (0, {MAX_SECONDS:.0f}], --clients in [1, {MAX_CLIENTS}]")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not Path("/proc/self/status").exists():
        sys.exit("soak_server.py reads /proc: Linux only")
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(args, Path(tmp) / "server.log")
        try:
            idle, samples, tallies = soak(args, port, proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    report(args, idle, samples, tallies)
    if args.csv:
        args.csv.write_text("seconds,rss_mb\n" + "".join(f"{t:.1f},{r:.1f}\n" for t, r in samples))


if __name__ == "__main__":
    main()
