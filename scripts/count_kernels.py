"""Count what the CUDA code path asks of the GPU, on a CPU: launches, syncs, uploads, host time.

    python scripts/count_kernels.py            # the table
    python scripts/count_kernels.py --sites    # plus the source line of every sync and upload
    python scripts/count_kernels.py --json     # last line: one JSON object

    python scripts/count_kernels.py --family md3  # one family (default both)
    python scripts/count_kernels.py --smoke       # md2 at 2 layers, batch 1, torch forms: no figure

The models are each family's structure at small widths with random bf16 weights (Moondream 3:
tau attention, 64 experts top 8 from layer 4, FP8 experts as published), built by
``kernel_counts.py``: launch, sync and upload counts depend on the structure, not on the
widths. The runtime runs the branches a GPU takes: the ``fa`` attention backend
(FlashAttention's binding replaced by its torch model, counted as one launch per call, as the
contract test does), the static decode step that CUDA graphs capture (run uncaptured; its
launches are the graph body), the fused Triton kernels under ``TRITON_INTERPRET=1`` when
Triton is installed (one launch each), Hopper's FP8 grouped GEMM for FP8 experts. Requests go
through the Engine's own pieces (request factory, scheduler, executor) on this thread.

Rows (Moondream 2; Moondream 3 has the greedy decode rows and the two prefills, ``md3_*`` in
the JSON): a decode step at batch 1 and 64, greedy and with Moondream's default sampling
(temperature 0.5, top-p 0.3), and greedy with every row under a grammar (``JSON_ANSWER``: an
object holding one string of 40-60 characters; its mask filled on the host and uploaded without
blocking; needs llguidance, the row is left out without it): launches inside the graph body and
outside it, syncs, blocking uploads; a hit prefill (13 new positions after a cached image), a
miss prefill (9 crops and ~743 positions, crops and encoder included), the vision encoder on 9
crops (its crops included) -- for these three the graph bodies (run uncaptured) and the
launches outside them, a graph launch counted as one (``*_eager`` in the JSON) --, the crops
alone as a CUDA runtime cuts them (``crops/device.py``) for a new image size and a seen one,
and the host microseconds of one scheduler decode step at batch 64 with the model math stubbed
(fixed logits over 16 ids stand in for the forward: the sampler's ops pay their per-op host
cost, no arithmetic to speak of; sampling, skills, streams and bookkeeping run). Take the host
time on an idle machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from kernel_counts import (  # noqa: E402
    GREEDY,
    JSON_ANSWER,
    QUESTION,
    SAMPLED,
    build,
    decode_rows,
    eager,
    forward_syncs,
    gpu_branches,
    pictures,
    prefill_rows,
    readbacks,
    submit,
)

from kestrel_kernels import fused  # noqa: E402

STUB_VOCAB = 16
PRE_ROWS = ("prefill_hit", "prefill_miss", "vision_9", "crops_new_size", "crops_seen_size")
MD3_PRE_ROWS = ("prefill_hit", "prefill_miss")


def host_us(
    batch: int, settings: dict, steps: int = 30, layers: int = 24, small: bool = False
) -> float:
    """Median host time of one scheduler decode step, the forward replaced by fixed logits
    (the setup's prefills use the torch forms: the interpreter is slow, and it is not timed)."""
    fused.set_fused_backend("torch")
    rt, _executor, sched, factory = build(batch, layers=layers, small=small)
    image = pictures(small)(1)
    for i in range(batch):
        submit(sched, factory, image, f"{QUESTION} {i}", {**settings, "max_tokens": 400})
    while sched.waiting or len(sched.running) < batch:
        sched.step()
    # The stand-in logits cover 16 ids (every id the skills ban or stop on is below 10): the
    # sampler's ops still pay their per-op host cost, its arithmetic (device work) is negligible.
    dim = rt.config.text.dim
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, STUB_VOCAB, generator=gen).to(rt.dtype)
    logits[:, rt.config.tokenizer.eos_id] = -1e4  # keep every row running
    rt.decode_graphs = FixedLogits(torch.zeros(batch, dim, dtype=rt.dtype), logits)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step_decode()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[5:])


class FixedLogits:
    """Stands in for the runtime's decode graphs (``DecodeGraphs.run``): fixed hidden states
    and logits for the rows asked, no model math."""

    def __init__(self, hidden_BC: torch.Tensor, logits_BV: torch.Tensor) -> None:
        self.hidden_BC, self.logits_BV = hidden_BC, logits_BV

    def run(self, rows, lengths, tokens, ids_B=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden_BC[: len(rows)], self.logits_BV[: len(rows)]


def measure(sites: bool, families: tuple[str, ...], smoke: bool = False) -> tuple[list, dict, dict]:
    """The decode rows (Moondream 2: batch 1 and 64, greedy and sampled; Moondream 3: batch 1
    and 64, greedy), the prefill (and, Moondream 2, vision and crop) counts per family, and
    every row's sync/upload sites. ``smoke``: 2 layers, one-crop images, batch 1, the torch
    forms (no interpreted Triton kernels): the rows' shape, not their figures."""
    rows, pre, all_sites = [], {}, {}
    layers, batches = (2, (1,)) if smoke else (24, (1, 64))
    with gpu_branches(triton=not smoke):
        for family in families:
            modes = (("greedy", GREEDY), ("sampled", SAMPLED))[: 2 if family == "md2" else 1]
            shapes = [(name, settings, None) for name, settings in modes]
            if family == "md2" and importlib.util.find_spec("llguidance") is not None:
                shapes.append(("constrained", GREEDY, JSON_ANSWER))
            for batch in batches:
                for name, settings, shape in shapes:
                    r = decode_rows(batch, settings, sites, family, layers, smoke, shape)
                    rows.append((f"{family} decode b{batch} {name}", r))
                    all_sites[rows[-1][0]] = r.pop("sites")
            pre[family] = prefill_rows(family, layers, smoke)
            keys = PRE_ROWS if family == "md2" else MD3_PRE_ROWS
            all_sites.update((f"{family} {k}", pre[family][k].sites) for k in keys)
    return rows, pre, all_sites


def print_table(rows: list, pre: dict) -> None:
    table = [("row", "graph body", "outside", "syncs", "deferred reads", "blocking up", "async up")]
    keys = ("graph_body", "outside", "syncs", "deferred", "uploads_blocking", "uploads_nonblocking")
    table += [(name, *(r[k] for k in keys)) for name, r in rows]
    for family, counts in pre.items():
        for key in PRE_ROWS if family == "md2" else MD3_PRE_ROWS:
            c = counts[key]
            counts_row = (c.graph_body, eager(c), c.syncs, c.deferred_reads, c.uploads_blocking)
            table.append((f"{family} {key}", *counts_row, c.uploads_nonblocking))
    widths = [max(len(str(r[i])) for r in table) for i in range(len(table[0]))]
    for r in table:
        cells = enumerate(zip(r, widths, strict=True))
        print("  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in cells))
    for family, counts in pre.items():
        print(f"({family} hit prefill: {counts['hit_positions']} new positions)")


def md2_summary(by: dict, pre: dict) -> dict:
    return {
        "decode_b1": by["md2 decode b1 greedy"]["graph_body"],
        "decode_b64": by["md2 decode b64 greedy"]["graph_body"],
        "decode_b1_outside": by["md2 decode b1 greedy"]["outside"],
        "decode_b64_outside_sampled": by["md2 decode b64 sampled"]["outside"],
        "prefill_hit": pre["prefill_hit"].launches,
        "prefill_miss": pre["prefill_miss"].launches,
        "vision_9": pre["vision_9"].launches,
        "prefill_hit_eager": eager(pre["prefill_hit"]),
        "prefill_miss_eager": eager(pre["prefill_miss"]),
        "vision_9_eager": eager(pre["vision_9"]),
        "crops_new_size": pre["crops_new_size"].launches,
        "crops_seen_size": pre["crops_seen_size"].launches,
        "syncs_per_decode_step": by["md2 decode b64 greedy"]["syncs"],
        "syncs_per_decode_step_sampled": by["md2 decode b64 sampled"]["syncs"],
        "uploads_per_prefill": max(
            pre["prefill_hit"].uploads_blocking, pre["prefill_miss"].uploads_blocking
        ),
        **constrained_summary(by),
    }


def constrained_summary(by: dict) -> dict:
    """The grammar row's figures against the greedy row's (empty without llguidance)."""
    row = by.get("md2 decode b64 constrained")
    if row is None:
        return {}
    return {
        "decode_b64_constrained": row["graph_body"],
        "decode_b64_outside_constrained": row["outside"],
        "syncs_per_decode_step_constrained": row["syncs"],
        "uploads_blocking_per_decode_step_constrained": row["uploads_blocking"],
        "uploads_nonblocking_per_decode_step_constrained": row["uploads_nonblocking"],
    }


def md3_summary(by: dict, pre: dict) -> dict:
    b1, b64 = by["md3 decode b1 greedy"], by["md3 decode b64 greedy"]
    hit, miss = pre["prefill_hit"], pre["prefill_miss"]
    return {
        "md3_decode_b1": b1["graph_body"],
        "md3_decode_b64": b64["graph_body"],
        "md3_decode_b1_outside": b1["outside"],
        "md3_decode_b64_outside": b64["outside"],
        "md3_prefill_hit": hit.launches,
        "md3_prefill_miss": miss.launches,
        "md3_prefill_hit_eager": eager(hit),
        "md3_prefill_miss_eager": eager(miss),
        "md3_syncs_per_decode_step": max(b1["syncs"], b64["syncs"]),
        "md3_syncs_per_prefill": max(forward_syncs(hit), forward_syncs(miss)),
        "md3_prefill_token_reads": max(readbacks(hit), readbacks(miss)),
        "md3_uploads_per_prefill": max(hit.uploads_blocking, miss.uploads_blocking),
    }


def summary(rows: list, pre: dict, host: dict) -> dict:
    """The figures as one JSON-ready dict (``--json``; a smoke run's batch-1 rows stand in
    for batch 64's)."""
    by = dict(rows)
    for name in list(by):
        by.setdefault(name.replace(" b1 ", " b64 "), by[name])
    out = md2_summary(by, pre["md2"]) if "md2" in pre else {}
    if "md3" in pre:
        out.update(md3_summary(by, pre["md3"]))
    return {**out, **{k: round(v) for k, v in host.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", action="store_true", help="name the source line of each sync/upload")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--no-host", action="store_true", help="skip the host-time rows (timing)")
    p.add_argument("--family", choices=("md2", "md3", "both"), default="both")
    p.add_argument("--smoke", action="store_true",
                   help="Moondream 2 at 2 layers, batch 1, torch forms (no figure)")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.family = "md2" if args.family == "both" else args.family
    torch.manual_seed(0)
    families = ("md2", "md3") if args.family == "both" else (args.family,)
    rows, pre, all_sites = measure(args.sites, families, args.smoke)
    print_table(rows, pre)
    if args.sites:
        for name, sites in all_sites.items():
            for (kind, site), n in sorted(sites.items()):
                print(f"  {name}: {kind} x{n} at {site}")
    host = {}
    if not args.no_host and "md2" in families:
        batch, steps, layers = (2, 8, 2) if args.smoke else (64, 30, 24)
        with gpu_branches(triton=not args.smoke):
            host["host_us_step_b64"] = host_us(batch, GREEDY, steps, layers, args.smoke)
            host["host_us_step_b64_sampled"] = host_us(batch, SAMPLED, steps, layers, args.smoke)
        for k, v in host.items():
            print(f"{k}: {v:.0f} us")
    if args.json:
        print(json.dumps(summary(rows, pre, host)))


if __name__ == "__main__":
    main()
