"""A flood of large uploads cannot take the server's memory (docs/images.md): decoded image
bytes in flight are held under the engine's budget; a request whose decode finds no room in
time is answered 503 with Retry-After, never dropped, and every byte comes back."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the test extra)")
pytest.importorskip("prometheus_client", reason='needs the serve extra: "kestrel[serve]"')

from starlette.testclient import TestClient

from kestrel.cli import build_parser, common
from kestrel.server import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL, data_url

BUDGET_LINE = 'kestrel_image_memory_bytes{kind="budget"}'
SIDE = 700  # a palette PNG this large is decoded whole by Pillow: ~8 MB at its peak
ONE_TOKEN = {"temperature": 0, "max_tokens": 1}


def palette_png(seed: int) -> bytes:
    """A 700 x 700 palette PNG (a kind no decoder shrinks on load), a few kB on the wire."""
    image = Image.new("P", (SIDE, SIDE), seed % 200)
    image.putpalette(list(np.random.default_rng(seed).integers(0, 256, 768)))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_image_memory_is_an_engine_option_and_a_flag() -> None:
    args = build_parser().parse_args(["serve", "--image-memory-mb", "64"])
    assert common.engine_kwargs(args)["image_memory_mb"] == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--image-memory-mb", "0"])


def test_a_flood_is_held_under_the_budget_and_answered_200_or_503() -> None:
    from kestrel import Engine

    peak = SIDE * SIDE * 16
    with Engine(MODEL, **ENGINE_OPTIONS, image_memory_mb=2.5 * peak / (1 << 20)) as engine:
        budget = engine.image_budget
        urls = [data_url(palette_png(seed)) for seed in range(12)]
        budget.wait_s = 0.2
        with TestClient(create_app(engine)) as client:

            def ask(seed: int):
                url = urls[seed] if seed < len(urls) else data_url(palette_png(seed))
                body = {"image_url": url, "question": "What is it?", "settings": ONE_TOKEN}
                return client.post("/v1/query", json=body)

            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(12)))
            held = budget.take(budget.limit)  # the budget is full: one more is refused
            refused = ask(99)
            held.release()
            retried = ask(99)
            stats = client.get("/v1/stats").json()
            metrics = client.get("/metrics").text
        gc.collect()
        in_use = budget.in_use
    statuses = [a.status_code for a in answers]
    print(f"12 concurrent {SIDE}x{SIDE} palette PNGs: {statuses.count(200)} answered 200, "
          f"{statuses.count(503)} 503; peak {budget.peak / 2**20:.0f} of "
          f"{budget.limit / 2**20:.0f} MiB")  # fmt: skip
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0
    for answer in answers:
        if answer.status_code == 503:
            assert answer.headers["Retry-After"] == "1"
            assert answer.json()["error"]["type"] == "overloaded"
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert retried.status_code == 200
    assert budget.peak <= budget.limit and in_use == 0
    assert (
        stats["image_decodes_refused"] >= 1 and stats["image_memory_budget_bytes"] == budget.limit
    )
    line = next(x for x in metrics.splitlines() if x.startswith(BUDGET_LINE))
    assert float(line.split()[-1]) == budget.limit
    assert 'kestrel_image_decodes_delayed_total{outcome="refused"}' in metrics


def test_the_flood_script_reports_every_request_and_the_memory() -> None:
    pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')
    script = Path(__file__).parents[2] / "scripts" / "flood_images.py"
    out = subprocess.run(
        [sys.executable, str(script), "--requests", "6", "--side", "1500", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] + result["overloaded"] == 6 and result["dropped"] == 0
    assert result["peak_rss_mb"] >= result["idle_rss_mb"] > 0
