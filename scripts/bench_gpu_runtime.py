"""GPU benchmark on a Moondream-2-shaped model with random bf16 weights made on the device.

Real dimensions (1.9 B parameters, 729 image tokens, 24 decoder layers of 32 x 64 heads), so the
speed is that of the real model without needing its checkpoint. Reports:

- decode tokens/s at batch 1, 8, 32 and 64 (graph-captured steps over ~760-position contexts),
  and the fraction of HBM bandwidth a step achieves: (decoder weights + the batch's K/V) bytes per
  step / step time, against the device's measured copy bandwidth and its datasheet figure;
- TTFT of a cache miss (new image: vision encoder + the whole prompt) and of a hit (same image,
  new question: only the question is prefilled), medians;
- with ``--overlap``: whether the vision encoder runs beside batch-64 decode steps on a second
  stream (``bench_overlap.py``'s variants, one JSON line);
- requests/s on short-answer image QA (ChartQA-like: a new 800 x 600 image per request, a short
  question, 6 generated tokens) at batch 1 and 64. The loop admits requests (one prefill each)
  while the batch has room, then advances every running sequence by one batched decode step.

Kestrel's published H100 figures for Moondream 2 on ChartQA are about 42 requests/s at batch 1
and 57 at batch 64; the table prints them beside ours.

    python scripts/bench_gpu_runtime.py [--json out.json] [--kv-memory-fraction 0.9] [--profile]
    python scripts/bench_gpu_runtime.py --smoke    # decode at batch 1 and 8, a few requests

``bench_gpu.py`` measures the same model through the Engine on a ChartQA-shaped workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import bench_overlap
import numpy as np
import torch

import kestrel_kernels
import kestrel_kernels.fused
from kestrel.crops.overlap import overlap_crops
from kestrel.images import image_digest, load_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.vision import encode_image, normalize_pixels
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.random_weights import random_model
from kestrel.tokens import TextToken

PUBLISHED_REQ_S = {1: 42.0, 64: 57.0}  # Kestrel, H100, Moondream 2, ChartQA short answers
DATASHEET_TB_S = {"H100": 3.35, "H200": 4.8}  # HBM bandwidth, SXM parts
DECODE_BATCHES = (1, 8, 32, 64)
QUESTION = [TextToken(i) for i in (1, 15, 817, 1241, 2099, 286, 262, 8262, 30, 3, 3)]
ANSWER_TOKENS = 6  # the prefill's token + 5 decode steps


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def copy_bandwidth_tb_s() -> float:
    """Device-to-device copy, bytes read + written per second (the attainable HBM figure)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() / t / 1e12


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (600, 800, 3), dtype=np.uint8)


def prompt(rt: MoondreamRuntime, variant: int = 0) -> list[TextToken]:
    bos = TextToken(rt.config.tokenizer.bos_id)
    return [bos, TextToken(100 + variant), *QUESTION]


def decode_rate(rt: MoondreamRuntime, batch: int, steps: int = 48) -> dict:
    """Tokens/s and bandwidth of graph-captured decode steps at ``batch`` rows."""
    img = image(1)
    states = [rt.start_sequence(prompt(rt, i), img, max_new_tokens=steps + 8)[0]
              for i in range(batch)]  # fmt: skip
    feed = [TextToken(500 + i) for i in range(batch)]
    for _ in range(4):  # capture + warm
        rt.decode_step(states, feed)
    mean_k = statistics.mean(s.length for s in states) + steps / 2
    t = timed(lambda: [rt.decode_step(states, feed) for _ in range(steps)]) / steps
    for s in states:
        rt.release_sequence(s)
    text = rt.model.text
    weights = sum(p.numel() * p.element_size() for p in _tensors(text) if p is not text.wte)
    kv = int(batch * mean_k * (rt.kv.bytes // rt.kv.n_pages))  # every K/V position read once
    return {"batch": batch, "step_ms": 1e3 * t, "tokens_s": batch / t,
            "bytes_per_step": weights + kv, "tb_s": (weights + kv) / t / 1e12}  # fmt: skip


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if hasattr(obj, "__slots__"):
        return [t for s in obj.__slots__ for t in _tensors(getattr(obj, s))]
    return []


def ttft(rt: MoondreamRuntime, trials: int = 10) -> dict:
    """Median time to first token: a miss (new image) and a hit (cached image, new question)."""
    out = {}
    for kind in ("miss", "hit"):
        times = []
        for i in range(trials):
            img = image(1000 + i) if kind == "miss" else image(1)
            holder = []

            def first(img=img, i=i, holder=holder):
                state, logits = rt.start_sequence(prompt(rt, 50 + i), img, max_new_tokens=2)
                holder.append(state)
                return int(logits.argmax())  # the host has the token: a real TTFT

            times.append(timed(first))
            rt.release_sequence(holder[0])
        out[kind] = 1e3 * statistics.median(times)
    return out


def profile_request(rt: MoondreamRuntime) -> None:
    """Where a request's time goes: image crops (host), vision encoder, prefill host overhead."""
    cfg = rt.config
    img = image(777)
    crops = overlap_crops(load_image(img), cfg.vision)
    t_crops = timed(lambda: overlap_crops(load_image(img), cfg.vision))
    pixels = normalize_pixels(crops.crops, rt.dtype, rt.device)
    t_vision = timed(lambda: encode_image(pixels, crops.tiling, rt.model.vision, cfg.vision))
    t_hash = timed(lambda: image_digest(img))
    print(f"\nmiss parts: crops {1e3 * t_crops:.1f} ms ({crops.n_crops} crops, host), vision "
          f"encoder {1e3 * t_vision:.1f} ms, SHA-256 {1e3 * t_hash:.1f} ms")  # fmt: skip
    text, kv = cfg.text, rt.kv
    q = torch.randn(1, 1, text.n_heads, text.head_dim, device=rt.device, dtype=rt.dtype)
    pt = rt.page_table.page_table[:1]
    sk = torch.ones(1, dtype=torch.int32, device=rt.device)
    meta = kestrel_kernels.AttentionMeta(pt, sk)
    for name in kestrel_kernels.available_backends(rt.device):
        backend = kestrel_kernels.resolve_backend(name, rt.device)
        kestrel_kernels.paged_attention(q, kv.k[0], kv.v[0], meta, backend=backend)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            kestrel_kernels.paged_attention(q, kv.k[0], kv.v[0], meta, backend=backend)
        host = (time.perf_counter() - t0) / 100
        torch.cuda.synchronize()
        print(f"paged_attention host time per decode call, {name}: {1e6 * host:.0f} us")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    holder = []
    with torch.profiler.profile(activities=acts) as prof:
        state, logits = rt.start_sequence(prompt(rt, 3), image(1), max_new_tokens=2)
        holder.append(int(logits.argmax()))
    rt.release_sequence(state)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"hit prefill: {kernels} GPU kernel launches; top host ops:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def profile_decode(rt: MoondreamRuntime, batch: int = 1) -> None:
    """The GPU kernels of one decode step at ``batch`` rows (a graph replay): how many, and
    the ten that take the most device time."""
    img = image(1)
    states = [rt.start_sequence(prompt(rt, 60 + i), img, max_new_tokens=8)[0]
              for i in range(batch)]  # fmt: skip
    feed = [TextToken(500 + i) for i in range(batch)]
    rt.decode_step(states, feed)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        rt.decode_step(states, feed)
        torch.cuda.synchronize()
    for s in states:
        rt.release_sequence(s)
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in cuda)
    print(f"\ndecode step, batch {batch}: {sum(e.count for e in cuda)} GPU kernels, "
          f"{total / 1e3:.2f} ms of device time; the ten longest:")  # fmt: skip
    for e in sorted(cuda, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"  {e.self_device_time_total:8.0f} us  x{e.count:<4d} {e.key[:90]}")


def qa_rate(rt: MoondreamRuntime, batch: int, n_requests: int) -> float:
    """Requests/s: new image per request, ANSWER_TOKENS greedy tokens, up to ``batch`` at once."""
    images = [image(10_000 + i) for i in range(n_requests)]
    pending = list(range(n_requests))
    running: list[list] = []  # [state, last token, tokens produced]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while pending or running:
        if pending and len(running) < batch:
            i = pending.pop(0)
            state, logits = rt.start_sequence(prompt(rt, i % 400), images[i],
                                              max_new_tokens=ANSWER_TOKENS)  # fmt: skip
            running.append([state, int(logits.argmax()), 1])
            if len(running) < batch and pending:
                continue  # admit up to the batch before decoding
        states = [r[0] for r in running]
        logits = rt.decode_step(states, [TextToken(r[1]) for r in running])
        for r, tok in zip(running, logits.argmax(-1).tolist(), strict=True):
            r[1], r[2] = tok, r[2] + 1
        for r in [r for r in running if r[2] >= ANSWER_TOKENS]:
            rt.release_sequence(r[0])
            running.remove(r)
    torch.cuda.synchronize()
    return n_requests / (time.perf_counter() - t0)


def decode_table(rt, batches, copy_tb_s: float, datasheet: float | None) -> list[dict]:
    """Each batch's decode rate, printed as a table row."""
    print("\n| decode batch | step ms | tokens/s | GB/step | TB/s | of copy BW | of datasheet |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for b in batches:
        r = decode_rate(rt, b)
        rows.append(r)
        sheet = f"{r['tb_s'] / datasheet:.0%}" if datasheet else "n/a"
        print(f"| {b} | {r['step_ms']:.2f} | {r['tokens_s']:.0f} | {r['bytes_per_step'] / 1e9:.2f}"
              f" | {r['tb_s']:.2f} | {r['tb_s'] / copy_tb_s:.0%} | {sheet} |")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kv-memory-fraction", type=float, default=0.9)
    ap.add_argument("--qa-requests", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="only break down one request's time")
    ap.add_argument("--overlap", action="store_true",
                    help="also time the encoder beside decode (bench_overlap.py)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="batches 1 and 8, 8 requests (CUDA)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device, --smoke too (a Moondream-2-sized model, CUDA graphs)")
    batches = (1, 8) if args.smoke else DECODE_BATCHES
    args.qa_requests = 8 if args.smoke else args.qa_requests
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_tb_s = copy_bandwidth_tb_s()
    model = random_model(MoondreamConfig(), device="cuda", dtype=torch.bfloat16)
    t_rt = time.perf_counter()
    rt = MoondreamRuntime(model, max_batch_size=max(batches),
                          kv_memory_fraction=args.kv_memory_fraction)  # fmt: skip
    t_rt = time.perf_counter() - t_rt
    backend = rt.attention_backend.name
    fused_ops = kestrel_kernels.fused.fused_backend(torch.device("cuda"))
    print(f"device: {name}; attention backend: {backend}; fused ops: {fused_ops}; decode "
          f"kernel: {kestrel_kernels.get_decode_kernel()}; torch {torch.__version__}")  # fmt: skip
    print(f"{rt.kv_report}  [runtime built in {t_rt:.1f} s]")
    assert rt.decode_graphs is not None, "decode graphs need the fa backend"
    if args.profile:
        ttft(rt, trials=2)  # warm
        profile_request(rt)
        return
    # every graph was captured while the runtime was built (included in its time above)
    print(f"decode graphs captured for batches {rt.decode_graphs.captured}; failed: "
          f"{sorted(rt.decode_graphs.failures)}")  # fmt: skip
    datasheet = next((v for k, v in DATASHEET_TB_S.items() if k in name), None)
    results = {"device": name, "backend": backend, "copy_tb_s": copy_tb_s,
               "kv_pool": str(rt.kv_report), "decode": [], "qa_req_s": {}}  # fmt: skip
    results["decode"] = decode_table(rt, batches, copy_tb_s, datasheet)
    for b in (1, batches[-1]):
        profile_decode(rt, b)
    trials = 2 if args.smoke else 10
    results["ttft_ms"] = t = ttft(rt, trials)
    print(f"\nTTFT (median of {trials}): miss {t['miss']:.1f} ms, hit {t['hit']:.1f} ms")
    print("\n| image QA | requests/s | Kestrel published (H100) |\n|---|---|---|")
    for b in (1, batches[-1]):
        n = args.qa_requests if b > 1 else max(4 if args.smoke else 16, args.qa_requests // 4)
        rate = results["qa_req_s"][b] = qa_rate(rt, b, n)
        published = f"{PUBLISHED_REQ_S[b]:.0f}" if b in PUBLISHED_REQ_S else "-"
        print(f"| batch {b} ({n} requests) | {rate:.1f} | {published} |")
    print(f"\ncopy bandwidth {copy_tb_s:.2f} TB/s (read + write); datasheet {datasheet} TB/s")
    if args.overlap:  # the vision encoder beside batch-64 decode steps (bench_overlap.py)
        results["overlap"] = bench_overlap.measure(rt)
        print("overlap: " + json.dumps(results["overlap"]))
    rt.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
