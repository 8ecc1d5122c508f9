"""Wall-clock timers for the benchmark scripts: where an Engine's time goes, by part.

``instrumented()`` wraps the model functions and cache methods wherever the package refers
to them (inclusive timers) while it is active; ``measure`` turns them into exclusive rows plus
"Python / scheduling", the rest of the wall time. ``bench_model`` writes the random-weight bench
checkpoint.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import kestrel_kernels
from kestrel.crops import overlap
from kestrel.crops.pool import CropPool
from kestrel.kv.page_table import PageTable
from kestrel.moondream import region, text, vision
from kestrel.prefix_cache.radix_cache import RadixPrefixCache
from kestrel.runtime.heads import ModelHeads

__all__ = ["TIMERS", "bench_model", "instrumented", "measure", "table"]

TIMERS: dict[str, float] = defaultdict(float)
WRAPPED: list[tuple[object, str, Callable]] = []  # (owner, attribute, original), in order
# label -> labels of timers that run inside it (subtracted to make rows exclusive)
NESTED = {"decoder (matmuls, norms, rope)": ("attention (gather + sdpa)", "kv write")}


def _timed(fn: Callable, label: str) -> Callable:
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            TIMERS[label] += time.perf_counter() - t0

    wrapper.__wrapped__ = fn
    return wrapper


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Inside, each target function is wrapped in every kestrel module that refers to it, and
    each target method in its class; all put back on the way out."""
    instrument()
    try:
        yield
    finally:
        while WRAPPED:
            owner, attr, original = WRAPPED.pop()
            setattr(owner, attr, original)


def _wrap(owner: object, attr: str, wrapper: Callable) -> None:
    WRAPPED.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, wrapper)


def instrument() -> None:
    """Wrap each target function in every kestrel module that refers to it."""
    targets = {
        overlap.overlap_crops: "image crops (host)",
        vision.normalize_pixels: "image crops (host)",
        vision.encode_image: "vision encoder",
        region.embed_tokens: "embedding",
        text.text_forward: "decoder (matmuls, norms, rope)",
        text.lm_head: "lm head",
        kestrel_kernels.paged_attention: "attention (gather + sdpa)",
        kestrel_kernels.write_kv: "kv write",
    }
    wrapped = {id(f): _timed(f, label) for f, label in targets.items()}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("kestrel"):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in wrapped:
                _wrap(mod, attr, wrapped[id(value)])
    for cls, methods, label in (
        (ModelHeads, ("sample", "coord_token", "size_token"), "sampling"),
        (RadixPrefixCache, ("match_prefix", "insert", "lock", "unlock", "evict"), "cache ops"),
        # the crops are made off the scheduler thread; this is what it waits for them
        (CropPool, ("pixels",), "image crops (host)"),
        (PageTable, ("allocate", "allocate_pages", "map_pages", "erase"), "cache ops"),
    ):
        for m in methods:
            _wrap(cls, m, _timed(getattr(cls, m), label))


def measure(label: str, fn: Callable[[], None], repeats: int) -> dict[str, float]:
    TIMERS.clear()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    wall = (time.perf_counter() - t0) / repeats
    rows = {k: v / repeats for k, v in TIMERS.items()}
    for outer, inner in NESTED.items():
        if outer in rows:
            rows[outer] -= sum(rows.get(i, 0.0) for i in inner)
    rows["Python / scheduling"] = wall - sum(rows.values())
    rows["total"] = wall
    return rows


def table(
    title: str, rows: dict[str, float], per: str = "", out: Callable[[str], None] = print
) -> None:
    """Print ``rows`` (from ``measure``) as a table through ``out`` (a harness's ``emit``)."""
    total = rows["total"]
    out(f"\n{title}\n| part | ms{per} | share |\n|---|---|---|")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        if k != "total":
            out(f"| {k} | {v * 1e3:.2f} | {v / total:.0%} |")
    out(f"| **total** | **{total * 1e3:.2f}** | 100% |")


def bench_model(path: Path) -> Path:
    """The bench checkpoint at ``path``, written first if missing (random weights, Moondream-2
    structure with 729 image tokens, narrow enough for a 2-core CPU)."""
    if (path / "config.json").exists():
        return path
    import shutil

    from kestrel.moondream.config import MoondreamConfig
    from kestrel.testing.random_checkpoint import write_random_checkpoint

    fixture = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny-a"
    tok = MoondreamConfig.from_json_file(fixture / "config.json").tokenizer
    cfg = MoondreamConfig.from_dict(
        {
            "text": {
                "dim": 512,
                "ff_dim": 2048,
                "n_layers": 8,
                "n_heads": 8,
                "n_kv_heads": 8,
                "vocab_size": 1024,
            },
            "vision": {
                "enc_dim": 192,
                "enc_ff_dim": 768,
                "enc_n_heads": 3,
                "proj_out_dim": 512,
                "proj_inner_dim": 2048,
            },
            "region": {"dim": 512, "inner_dim": 2048},
            "tokenizer": {"templates": {k: dict(v) for k, v in tok.templates.items()}},
        }
    )
    write_random_checkpoint(path, cfg)
    shutil.copy(fixture / "tokenizer.json", path / "tokenizer.json")
    return path
