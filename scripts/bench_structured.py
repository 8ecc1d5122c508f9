"""Constrained decoding's cost: decode steps with 0, half and all rows under a grammar, the
mask fill per row, and grammar compiles cold and cached (docs/structured.md).

    python scripts/bench_structured.py [--model DIR] [--batch 64] [--steps 48] [--json]
    python scripts/bench_structured.py --smoke        # CPU proof: kestrel-tiny, tiny counts

The schema is a 10-field object (enums, bounded integers and numbers, bounded strings, a
boolean, an array; every field required, so a grammar row keeps its mask busy). Decode: one
Engine (``max_batch_size`` = batch), ``batch`` queries at once with ``max_tokens`` = steps, of
which 0, batch/2 or batch carry the schema; every decode call of the executor is timed while
all rows run (median wall ms from one step's choice, ``executor.choose``, to the next), and so
is the host's mask work inside it (median us per step: ``token_masks.mask_table``, the bitmask
fill and its upload). Mask fill: ``batch``
rows of the schema walked through a valid answer token by token, all rows filled per step
(llguidance's thread pool) and one row at a time (us per row). Compile: a new ``Grammars``
(its tokenizer built first, timed apart) compiling the schema, then the same spec again.

Every variant runs in each of ``--rounds`` rounds, interleaved (0, half, all, then again), and a
figure is the median over the rounds (min-max beside it).

The model, unless ``--model`` names one: a random-weight Moondream 2 written once
(``bench_gpu_models``), whose rows run to ``max_tokens`` (random weights seldom choose the end
token), so every variant times the same steps: on CUDA of Moondream 2's dimensions, on the CPU
narrow (``CPU_MODEL``: a cheap step, the hard case for a mask's cost) but of its 51,200 ids.
``--bpe-ranks`` gives it a real byte-level BPE vocabulary (GPT-2's 50,256 tokens, as Moondream
2's tokenizer has, from tiktoken's ``gpt2.tiktoken``); without it the fixture's 1,014 tokens
are widened with placeholders, which a grammar's mask walks more cheaply. ``--smoke``: kestrel-tiny
(430 ids), tiny counts."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "size": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "label": {"type": "string", "maxLength": 8},
        "round": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "y": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": ["string", "null"], "enum": ["near", "far", None]},
    },
    "required": ["colour", "shape", "count", "size", "label", "round", "tags", "x", "y", "note"],
    "additionalProperties": False,
}
ANSWER = ('{"colour":"red","shape":"circle","count":3,"size":0.25,"label":"ball","round":true,'
          '"tags":["a","b"],"x":12,"y":40,"note":"near"}')  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}


CPU_MODEL = {  # Moondream 2's structure and vocabulary, narrow enough for a 2-core CPU
    "text": {"dim": 256, "ff_dim": 1024, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4},
    "vision": {"enc_dim": 32, "enc_ff_dim": 64, "enc_n_layers": 1, "enc_n_heads": 2,
               "proj_out_dim": 256, "proj_inner_dim": 512, "crop_size": 56, "max_crops": 2,
               "overlap_margin": 1},
    "region": {"dim": 256, "inner_dim": 512},
}  # fmt: skip


def _model(args: argparse.Namespace) -> str | None:
    """The checkpoint to serve (None: kestrel-tiny)."""
    if args.model or args.smoke:
        return args.model
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_gpu_models import gpt2_tokenizer, random_md2_checkpoint

    cuda = torch.cuda.is_available()
    tag = ("md2" if cuda else "cpu") + ("-gpt2" if args.bpe_ranks else "")
    folder = random_md2_checkpoint(Path(args.model_dir) / tag, None if cuda else CPU_MODEL)
    marker = folder / "tokenizer.gpt2"
    if args.bpe_ranks and not marker.exists():
        gpt2_tokenizer(Path(args.bpe_ranks), folder / "tokenizer.json", 51200)
        marker.write_text(str(args.bpe_ranks))
    return str(folder)


class _Timed:
    """Wraps a function; keeps each call's start, wall seconds and first argument's length
    (a step's rows)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.calls.append((t0, time.perf_counter() - t0, len(a[0])))


def decode_row(engine, batch: int, constrained: int, steps: int) -> dict:
    """Median decode step (ms) and mask host work per step (us) with ``constrained`` rows."""
    from kestrel.runtime import executor, heads

    step, masks = _Timed(executor.choose), _Timed(heads.mask_table)
    executor.choose, heads.mask_table = step, masks
    try:
        image = REPO / "kestrel" / "tiny" / "assets" / "demo" / "scene_0.png"
        settings = {"temperature": 0, "max_tokens": steps}
        futures = [engine.submit_query(image, "describe the scene", settings=settings,
                                       response_format=FORMAT if i < constrained else None)
                   for i in range(batch)]  # fmt: skip
        for f in futures:
            f.result()
    finally:
        executor.choose, heads.mask_table = step.fn, masks.fn
    full = [t0 for t0, _, rows in step.calls if rows == batch]  # every row running
    walls = [b - a for a, b in itertools.pairwise(full)] or [0.0]
    fills = [wall for _, wall, rows in masks.calls if rows == batch] or [0.0]
    return {
        "constrained": constrained,
        "steps": len(full),
        "step_ms": statistics.median(walls) * 1e3,
        "mask_host_us": statistics.median(fills) * 1e6 if constrained else 0.0,
    }


def _grammars(engine):
    from kestrel.grammar import Grammars

    tok, cfg = engine.runtime.tokenizer, engine.config
    return Grammars(tok.to_json, cfg.text.vocab_size, cfg.tokenizer.eos_id)


def fill_row(engine, batch: int) -> dict:
    """Mask fill per row (us): every row of ``batch`` walked through ``ANSWER``."""
    from kestrel.grammar import parse_response_format

    grammars = _grammars(engine)
    spec = parse_response_format(FORMAT)
    rows = [grammars.row(spec) for _ in range(batch)]
    ids = engine.runtime.tokenizer.encode(ANSWER)
    host = torch.empty((batch, grammars.width), dtype=torch.int32)
    together, alone = [], []
    for t in ids:
        t0 = time.perf_counter()
        type(rows[0]).fill_rows([(r, b) for b, r in enumerate(rows)], host)
        t1 = time.perf_counter()
        for b, r in enumerate(rows):
            r.fill(host[b])
        t2 = time.perf_counter()
        together.append((t1 - t0) / batch)
        alone.append((t2 - t1) / batch)
        for r in rows:
            r.accept(t)
    return {"tokens": len(ids), "pool_us_per_row": statistics.median(together) * 1e6,
            "serial_us_per_row": statistics.median(alone) * 1e6}  # fmt: skip


def compile_row(engine) -> dict:
    from kestrel.grammar import parse_response_format

    fresh = _grammars(engine)
    t0 = time.perf_counter()
    fresh.tokenizer()
    t1 = time.perf_counter()
    spec = parse_response_format(FORMAT)
    fresh.row(spec)
    t2 = time.perf_counter()
    fresh.row(spec)
    t3 = time.perf_counter()
    return {"vocab": fresh.vocab_size, "tokenizer_ms": (t1 - t0) * 1e3,
            "cold_ms": (t2 - t1) * 1e3, "cached_ms": (t3 - t2) * 1e3}  # fmt: skip


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict:
    from kestrel import Engine

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = "float32" if device == "cpu" else "bfloat16"
    batch = 4 if args.smoke else args.batch
    steps = 6 if args.smoke else args.steps
    rounds = 1 if args.smoke else args.rounds
    model = _model(args)
    with Engine(model, device=device, dtype=dtype, max_batch_size=batch) as engine:
        compiled = compile_row(engine)
        engine.query(None, "warm up", settings={"max_tokens": 2}, response_format=FORMAT)
        decode_row(engine, batch, 0, 4)  # the batch's first wave: graphs, pages, caches
        variants = (0, batch // 2, batch)
        runs: dict[int, list[dict]] = {k: [] for k in variants}
        for _ in range(rounds):  # interleaved: every variant once a round
            for k in variants:
                runs[k].append(decode_row(engine, batch, k, steps))
        decode = [{"constrained": k, "steps": min(r["steps"] for r in runs[k]),
                   "step_ms": _spread([r["step_ms"] for r in runs[k]]),
                   "mask_host_us": _spread([r["mask_host_us"] for r in runs[k]])}
                  for k in variants]  # fmt: skip
        fill = fill_row(engine, batch)
        vocab = "GPT-2 BPE" if args.bpe_ranks else ("kestrel-tiny" if model is None else "widened")
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "model": model or "kestrel-tiny", "vocabulary": vocab, "batch": batch,
            "rounds": rounds, "decode": decode, "fill": fill, "compile": compiled}  # fmt: skip


def _cell(f: dict, fmt: str) -> str:
    return f"{f['median']:{fmt}} ({f['min']:{fmt}}-{f['max']:{fmt}})"


def table(out: dict) -> str:
    base = out["decode"][0]["step_ms"]["median"]
    head = "| constrained rows | full-batch steps | step ms | vs none | mask host us / step |"
    lines = [f"{out['device']}, batch {out['batch']}, {out['model']} ({out['vocabulary']} "
             f"vocabulary), median (min-max) of {out['rounds']} interleaved rounds",
             head, "|---|---|---|---|---|"]  # fmt: skip
    for r in out["decode"]:
        ratio = r["step_ms"]["median"] / base
        lines.append(f"| {r['constrained']} | {r['steps']} | {_cell(r['step_ms'], '.2f')} "
                     f"| {ratio:.2f}x | {_cell(r['mask_host_us'], '.0f')} |")  # fmt: skip
    f, c = out["fill"], out["compile"]
    lines.append(
        f"mask fill: {f['pool_us_per_row']:.1f} us/row (all rows at once), "
        f"{f['serial_us_per_row']:.1f} us/row (one by one), over {f['tokens']} tokens"
    )
    lines.append(f"compile ({c['vocab']} ids): tokenizer {c['tokenizer_ms']:.0f} ms once, "
                 f"schema cold {c['cold_ms']:.2f} ms, cached {c['cached_ms']:.3f} ms")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Moondream checkpoint (default: see the module doc)")
    p.add_argument("--model-dir", default="/tmp/kestrel-bench-md2", help="the random model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the variants")
    p.add_argument("--bpe-ranks", help="GPT-2's BPE ranks (tiktoken format): a real vocabulary")
    p.add_argument("--smoke", action="store_true", help="kestrel-tiny on the CPU, tiny counts")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args(argv)
    out = run(args)
    print(json.dumps(out) if args.json else table(out))
    return out


if __name__ == "__main__":
    main()
