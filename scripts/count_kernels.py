"""Count what the CUDA code path asks of the GPU, on a CPU: launches, syncs, uploads, host time.

    python scripts/count_kernels.py            # the table
    python scripts/count_kernels.py --sites    # plus the source line of every sync and upload
    python scripts/count_kernels.py --json     # last line: one JSON object

The model is Moondream 2's structure (24 text layers, 27 vision layers, 729 patches per crop,
the 730-position BOS + image block) at small widths, with random bf16 weights: launch, sync and
upload counts depend on the structure, not on the widths. The runtime runs the branches a GPU
takes: the ``fa`` attention backend (FlashAttention's binding replaced by its torch model,
counted as one launch per call, as the contract test does), the static decode step that CUDA
graphs capture (run uncaptured; its launches are the graph body), the fused Triton kernels
under ``TRITON_INTERPRET=1`` when Triton is installed (one launch each). Requests go through
the Engine's own pieces (request factory, scheduler, runner) on this thread.

Rows: a decode step at batch 1 and 64, greedy and with Moondream's default sampling
(temperature 0.5, top-p 0.3): launches inside the graph body and outside it, syncs, blocking
uploads; a hit prefill (13 new positions after a cached image), a miss prefill (9 crops and
~743 positions, crops and encoder included), the vision encoder on 9 crops (its crops
included) -- for these three the graph bodies (run uncaptured) and the launches outside them,
a graph launch counted as one (``*_eager`` in the JSON) --, the crops alone as a CUDA runtime
cuts them (``device_crops.py``) for a new image size and a seen one, and the host microseconds
of one scheduler decode step at batch 64 with the model math stubbed (fixed logits over 16 ids
stand in for the forward: the sampler's ops pay their per-op host cost, no arithmetic to speak
of; sampling, skills, streams and bookkeeping run). Take the host time on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kestrel.engine.requests import RequestFactory  # noqa: E402
from kestrel.images import prepare_image  # noqa: E402
from kestrel.moondream.config import MoondreamConfig  # noqa: E402
from kestrel.moondream.tokenizer import MoondreamTokenizer  # noqa: E402
from kestrel.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from kestrel.runtime.heads import ModelHeads  # noqa: E402
from kestrel.runtime.prefill_graphs import PrefillGraphs  # noqa: E402
from kestrel.runtime.runner import BatchExecutor  # noqa: E402
from kestrel.runtime.runtime import MoondreamRuntime  # noqa: E402
from kestrel.runtime.vision_graphs import VisionGraphs  # noqa: E402
from kestrel.scheduler import Request, Scheduler  # noqa: E402
from kestrel.testing.random_weights import random_model  # noqa: E402
from kestrel_kernels import contract, fa_backend, fused  # noqa: E402
from kestrel_kernels.counting import LaunchCounter  # noqa: E402
from kestrel_kernels.torch_backend import varlen_paged_attention_torch  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "md2-tiny-a"
SAMPLED = {"temperature": 0.5, "top_p": 0.3, "max_tokens": 48}
GREEDY = {"temperature": 0.0, "max_tokens": 48}
STUB_VOCAB = 16
PRE_ROWS = ("prefill_hit", "prefill_miss", "vision_9", "crops_new_size", "crops_seen_size")


def fake_binding(
    q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, softmax_scale, causal, **unused
):
    """FlashAttention's varlen paged call, computed by its torch model (one launch)."""
    from kestrel_kernels.counting import opaque

    with opaque("flash_attn"):
        args = (page_table, 1, seqused_k, cu_seqlens_q, max_seqlen_q, causal, softmax_scale)
        out = varlen_paged_attention_torch(q, k[:, 0], v[:, 0], *args)
    return out, None


@contextlib.contextmanager
def gpu_branches():
    """The ``fa`` backend with the stand-in binding; host-side value checks (CPU only) paused."""
    saved = (
        fa_backend.probe,
        fa_backend.load_binding,
        contract._check_values,
        contract._check_regions,
    )
    fa_backend.probe = lambda device=None: fa_backend.FaProbe(True, "counting stand-in")
    fa_backend.load_binding = lambda: fake_binding
    contract._check_values = lambda *a, **k: None  # runs on CPU tensors only
    contract._check_regions = lambda *a, **k: None
    fused_before = fused.get_fused_backend()
    if importlib.util.find_spec("triton") is not None:
        fused.set_fused_backend("triton")  # the Triton kernels, interpreted: one launch each
    try:
        yield
    finally:
        fused.set_fused_backend(fused_before)
        (
            fa_backend.probe,
            fa_backend.load_binding,
            contract._check_values,
            contract._check_regions,
        ) = saved


def build(max_batch: int):
    base = MoondreamConfig.from_json_file(FIXTURE / "config.json")
    cfg = replace(base, text=replace(base.text, n_layers=24))
    model = random_model(cfg, device="cpu", dtype=torch.bfloat16, seed=0)
    rt = MoondreamRuntime(
        model,
        MoondreamTokenizer.for_checkpoint(FIXTURE),
        kv_cache_pages=max_batch * 900 + 4000,
        max_batch_size=max_batch,
        attention_backend="fa",
        device_crops=True,  # as on CUDA: the image's crops cut where the encoder runs
    )
    rt.decode_graphs = DecodeGraphs(
        model,
        rt.kv,
        rt.page_table.page_table,
        max_batch_size=max_batch,
        backend="fa",
        capture=False,
    )
    # the prefill and vision graphs, uncaptured: their launches are the graph bodies
    rt.prefill_graphs = PrefillGraphs(
        model, rt.kv, rt.page_table.page_table, max_batch_size=max_batch, backend="fa",
        capture=False,
    )  # fmt: skip
    rt.vision_graphs = VisionGraphs(model, capture=False)
    runner = BatchExecutor(rt, lookahead=True)  # as on CUDA
    factory = RequestFactory(ModelHeads(model, rt.tokenizer), cfg)
    return rt, runner, Scheduler(runner), factory


_ids = iter(range(1, 1 << 30))


def submit(sched: Scheduler, factory: RequestFactory, image, question: str, settings) -> Future:
    d = factory.query(image, question, settings, None, reasoning=False, spatial_refs=None)
    fut: Future = Future()
    sched.submit(
        Request(
            request_id=next(_ids),
            skill=d.skill,
            image=d.image,
            adapter=None,
            cache_salt=None,
            prompt_positions=d.prompt_positions,
            max_new_tokens=d.max_new_tokens,
            future=fut,
            build_result=d.build_result,
            submitted_at=time.perf_counter(),
        )
    )
    return fut


def picture(seed: int, h: int = 756, w: int = 1512):
    rng = np.random.default_rng(seed)
    return prepare_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


QUESTION = "What is the total revenue shown for the third quarter of the year in this chart?"


def counted(fn, sites: bool) -> tuple[LaunchCounter, object]:
    with LaunchCounter(sites=sites) as c:
        out = fn()
    return c, out


def graph_body_launches(rt: MoondreamRuntime, counter_box: list) -> None:
    """Wrap the static step so the launches of the (would-be captured) body are known."""
    graphs = rt.decode_graphs
    original = graphs._forward

    def forward(bucket):
        c = counter_box[0]
        before = c.launches if c is not None else 0
        original(bucket)
        if c is not None:
            c.graph_body = c.launches - before
            c.replays += 1

    graphs._forward = forward


def decode_rows(batch: int, settings: dict, sites: bool) -> dict:
    rt, _runner, sched, factory = build(max(batch, 1))
    image = picture(1)
    futures = [submit(sched, factory, image, f"{QUESTION} {i}", settings) for i in range(batch)]
    while sched.waiting or len(sched.running) < batch:
        sched.step()
    box: list = [None]
    graph_body_launches(rt, box)
    for _ in range(2):  # warm: every row decoding
        sched.step()
    with LaunchCounter(sites=sites) as c:
        box[0] = c
        c.graph_body = 0
        sched._decode()
    box[0] = None
    running = len(sched.running)
    for f in futures:
        f.cancel()
    return {
        "rows": running,
        "graph_body": c.graph_body,
        "outside": c.launches - c.graph_body,
        "syncs": c.syncs,
        "deferred": c.deferred_reads,
        "uploads_blocking": c.uploads_blocking,
        "uploads_nonblocking": c.uploads_nonblocking,
        "replays": c.replays,
        "sites": c.sites,
    }


def bodies(obj, name: str, box: list) -> None:
    """Count the launches of ``obj.name`` (a graph's body, run uncaptured) into the counter in
    ``box``: ``graph_body`` and ``replays`` (each body run stands for one graph launch)."""
    original = getattr(obj, name)

    def body(*args, **kwargs):
        c = box[0]
        before = c.launches if c is not None else 0
        out = original(*args, **kwargs)
        if c is not None:
            c.graph_body += c.launches - before
            c.replays += 1
        return out

    setattr(obj, name, body)


def counted_graphs(box: list, sites: bool) -> LaunchCounter:
    c = LaunchCounter(sites=sites)
    c.graph_body = c.replays = 0
    box[0] = c
    return c


def prefill_rows(sites: bool) -> dict:
    rt, _runner, sched, factory = build(4)
    box: list = [None]
    bodies(rt.prefill_graphs, "_step", box)
    bodies(rt.vision_graphs, "_encoder", box)
    out = {}
    with counted_graphs(box, sites) as c:
        submit(sched, factory, picture(2), QUESTION, GREEDY)
        sched._prefill(sched._schedule())
    out["prefill_miss"] = c
    before = {id(r) for r in sched.running}
    with counted_graphs(box, sites) as c:
        submit(sched, factory, picture(2), "How many bars are there?", GREEDY)
        sched._prefill(sched._schedule())
    out["prefill_hit"] = c
    state = next(r for r in sched.running if id(r) not in before).handle
    out["hit_positions"] = state.prompt_length - state.reused_page_count
    img = picture(3)
    with torch.inference_mode(), counted_graphs(box, sites) as c:
        rt._encode_image(img)
    out["vision_9"] = c
    for key, seed in (("crops_new_size", 4), ("crops_seen_size", 5)):  # 757 x 1513, 9 crops
        with torch.inference_mode(), counted_graphs(box, sites) as c:
            rt.crops.pixels(picture(seed, 757, 1513)).encoder_input(rt.dtype, rt.device)
        out[key] = c
    box[0] = None
    return out


def eager(c: LaunchCounter) -> int:
    """Launches outside any graph, each graph launch counted as one."""
    return c.launches - c.graph_body + c.replays


def host_us(batch: int, settings: dict, steps: int = 30) -> float:
    """Median host time of one scheduler decode step, the forward replaced by fixed logits
    (the setup's prefills use the torch forms: the interpreter is slow, and it is not timed)."""
    fused.set_fused_backend("torch")
    rt, _runner, sched, factory = build(batch)
    image = picture(1)
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
    hidden = torch.zeros(batch, dim, dtype=rt.dtype)
    rt._decode_forward = lambda states, tokens, ids_B=None: (
        hidden[: len(states)],
        logits[: len(states)],
    )
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched._decode()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[5:])


def measure(sites: bool) -> tuple[list, dict, dict]:
    """The decode rows (batch 1 and 64, greedy and sampled), the prefill and vision counts,
    and every row's sync/upload sites."""
    rows, all_sites = [], {}
    with gpu_branches():
        for batch in (1, 64):
            for name, settings in (("greedy", GREEDY), ("sampled", SAMPLED)):
                r = decode_rows(batch, settings, sites)
                rows.append((f"decode b{batch} {name}", r))
                all_sites[f"decode b{batch} {name}"] = r.pop("sites")
        pre = prefill_rows(sites)
    all_sites.update((k, pre[k].sites) for k in PRE_ROWS)
    return rows, pre, all_sites


def print_table(rows: list, pre: dict) -> None:
    table = [("row", "graph body", "outside", "syncs", "deferred reads", "blocking up", "async up")]
    keys = ("graph_body", "outside", "syncs", "deferred", "uploads_blocking", "uploads_nonblocking")
    table += [(name, *(r[k] for k in keys)) for name, r in rows]
    for key in PRE_ROWS:
        c = pre[key]
        up = (c.uploads_blocking, c.uploads_nonblocking)
        table.append((key, c.graph_body, eager(c), c.syncs, c.deferred_reads, *up))
    widths = [max(len(str(r[i])) for r in table) for i in range(len(table[0]))]
    for r in table:
        cells = enumerate(zip(r, widths, strict=True))
        print("  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in cells))
    print(f"(hit prefill: {pre['hit_positions']} new positions)")


def summary(rows: list, pre: dict, host: dict) -> dict:
    """The figures as one JSON-ready dict (``--json``)."""
    by = dict(rows)
    return {
        "decode_b1": by["decode b1 greedy"]["graph_body"],
        "decode_b64": by["decode b64 greedy"]["graph_body"],
        "decode_b1_outside": by["decode b1 greedy"]["outside"],
        "decode_b64_outside_sampled": by["decode b64 sampled"]["outside"],
        "prefill_hit": pre["prefill_hit"].launches,
        "prefill_miss": pre["prefill_miss"].launches,
        "vision_9": pre["vision_9"].launches,
        "prefill_hit_eager": eager(pre["prefill_hit"]),
        "prefill_miss_eager": eager(pre["prefill_miss"]),
        "vision_9_eager": eager(pre["vision_9"]),
        "crops_new_size": pre["crops_new_size"].launches,
        "crops_seen_size": pre["crops_seen_size"].launches,
        "syncs_per_decode_step": by["decode b64 greedy"]["syncs"],
        "syncs_per_decode_step_sampled": by["decode b64 sampled"]["syncs"],
        "uploads_per_prefill": max(
            pre["prefill_hit"].uploads_blocking, pre["prefill_miss"].uploads_blocking
        ),
        **{k: round(v) for k, v in host.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", action="store_true", help="name the source line of each sync/upload")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--no-host", action="store_true", help="skip the host-time rows (timing)")
    args = p.parse_args()
    torch.manual_seed(0)
    rows, pre, all_sites = measure(args.sites)
    print_table(rows, pre)
    if args.sites:
        for name, sites in all_sites.items():
            for (kind, site), n in sorted(sites.items()):
                print(f"  {name}: {kind} x{n} at {site}")
    host = {}
    if not args.no_host:
        with gpu_branches():
            host["host_us_step_b64"] = host_us(64, GREEDY)
            host["host_us_step_b64_sampled"] = host_us(64, SAMPLED)
        for k, v in host.items():
            print(f"{k}: {v:.0f} us")
    if args.json:
        print(json.dumps(summary(rows, pre, host)))


if __name__ == "__main__":
    main()
