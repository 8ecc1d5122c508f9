"""A flood of large uploads against ``kestrel serve``: every request answered 200 or 503, none
dropped, and the server's memory bounded (docs/images.md).

Starts ``kestrel serve`` at its defaults (the embedded kestrel-tiny unless ``--model``), reads
its idle RSS once it answers, then sends ``--requests`` concurrent ``POST /v1/query`` calls at
once, each a JSON body holding a ``--side`` x ``--side`` PNG of one flat colour (a few hundred
kB on the wire, 147 MB of RGB at 7,000 x 7,000). Every body is different bytes (a text chunk
names the request), so none is taken for an image the server decoded before. The server's
``VmRSS`` is sampled every 20 ms while the flood runs, and its ``VmHWM`` (the kernel's peak)
read at the end. It prints the requests answered 200 / 503 / anything else / dropped (no
answer: a reset or a timeout), idle and peak RSS, and the peak over idle.

    python scripts/flood_images.py                          # 256 x 49 MP, the issue's flood
    python scripts/flood_images.py --palette --requests 48  # decoded whole: the budget holds
    python scripts/flood_images.py --requests 8 --side 1500 --json   # a smoke run

Linux only (``/proc``); loopback only. A memory measurement: it does not need an idle machine.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import re
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from soak_server import rss_mb, start_server


def flat_png(side: int, palette: bool = False) -> bytes:
    """One flat colour, RGB (shrunk on load by libvips) or a palette PNG (Pillow decodes
    those whole: only the decode budget bounds them)."""
    out = io.BytesIO()
    image = Image.new("RGB", (side, side), (40, 120, 200))
    image = image.quantize(4) if palette else image
    image.save(out, "PNG", compress_level=9)
    return out.getvalue()


def named(png: bytes, name: str) -> bytes:
    """``png`` with a tEXt chunk naming it, right after IHDR: other bytes, the same picture."""
    data = b"Comment\0" + name.encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + data))
    return png[:33] + chunk + png[33:]


def peak_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def ask(port: int, body: bytes, timeout: float) -> str:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/query", body, {"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return str(status)
    except (OSError, http.client.HTTPException):
        return "dropped"


def bodies(args: argparse.Namespace) -> list[bytes]:
    png = flat_png(args.side, args.palette)
    out = []
    for i in range(args.requests):
        url = "data:image/png;base64," + base64.b64encode(named(png, f"flood-{i}")).decode()
        question = {"image_url": url, "question": "What colour is it?",
                    "settings": {"max_tokens": 4, "temperature": 0}}  # fmt: skip
        out.append(json.dumps(question).encode())
    return out


def flood(args: argparse.Namespace, port: int, pid: int) -> dict:
    payloads = bodies(args)
    idle = rss_mb(pid)
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(rss_mb(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    with ThreadPoolExecutor(args.requests) as pool:
        answers = list(pool.map(lambda b: ask(port, b, args.timeout), payloads))
    seconds = time.monotonic() - start
    done.set()
    sampler.join()
    counts = Counter(answers)
    peak = max(peak_mb(pid), max(samples, default=idle))
    return {
        "requests": args.requests, "side": args.side, "palette": args.palette,
        "body_kb": len(payloads[0]) / 1024,
        "ok": counts.pop("200", 0), "overloaded": counts.pop("503", 0),
        "dropped": counts.pop("dropped", 0), "other": dict(counts), "seconds": seconds,
        "idle_rss_mb": idle, "peak_rss_mb": peak, "peak_over_idle_mb": peak - idle,
    }  # fmt: skip


def report(r: dict) -> None:
    kind = "palette " if r["palette"] else ""
    print(f"{r['requests']} concurrent {r['side']} x {r['side']} {kind}PNGs "
          f"({r['body_kb']:.0f} kB bodies) in {r['seconds']:.1f} s:")  # fmt: skip
    print(f"  answered 200: {r['ok']}   503: {r['overloaded']}   dropped: {r['dropped']}   "
          f"other: {r['other'] or 0}")  # fmt: skip
    print(f"  RSS idle {r['idle_rss_mb']:.0f} MB, peak {r['peak_rss_mb']:.0f} MB "
          f"(+{r['peak_over_idle_mb']:.0f} MB)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--side", type=int, default=7000, help="pixels per side (default 7000)")
    p.add_argument("--palette", action="store_true",
                   help="palette PNGs, decoded whole: the budget alone bounds them")  # fmt: skip
    p.add_argument("--model", default=None, help="default: the embedded kestrel-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--malloc", choices=("kestrel", "system"), default="kestrel")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = p.parse_args()
    if not 1 <= args.requests <= 1024 or not 16 <= args.side <= 10000:
        p.error("--requests must be in 1..1024 and --side in 16..10000")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(args, Path(tmp) / "server.log")
        try:
            result = flood(args, port, proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    sys.exit(0 if result["dropped"] == 0 and not result["other"] else 1)


if __name__ == "__main__":
    main()
