"""Time attention: the torch backend on CPU (decode and prefill shapes) and, on CUDA, the decode
kernels (FlashAttention vs the Triton flash-decoding kernel, ``kestrel_kernels.triton_decode``).

Usage: python scripts/bench_attention.py [--heads 32] [--head-dim 64] [--threads N]
       [--only cpu|gpu] [--width 2048] [--sweep] [--json out.json]
       python scripts/bench_attention.py --smoke    # tiny CPU shapes, 1 repeat, no GPU rows
The CPU table prints milliseconds per call (median of several) and the K/V bytes gathered per
second. The GPU rows (skipped with a note without CUDA) time one decode attention call at batch
1, 8 and 64 over ~800-position contexts, Moondream 2's 32 heads of 64 in bfloat16 (and the
Triton kernel on FP8 pages), each call replayed from a CUDA graph (device time, no host
overhead): milliseconds, K/V bytes read and the TB/s achieved, and the largest difference from
FlashAttention's output. ``--sweep`` also times other launch configurations of the Triton
kernel (``triton_decode.DecodeConfig``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kestrel_kernels as kk
from kestrel_kernels import decode_route, decode_tune
from kestrel_kernels.contract import KvScales, quantize_kv
from kestrel_kernels.decode_tune import graph_ms


def _case(
    batch: int, q_len: int, k_len: int, heads: int, head_dim: int, region: int, shared: int = 0
):  # fmt: skip
    """Pages scattered over the pool; the first ``shared`` of every row are the same pages (an
    image's KV that questions about it share)."""
    own = k_len - shared
    n_pages = shared + batch * own + 1
    pages = torch.randperm(n_pages - 1).to(torch.int32) + 1
    prefix = pages[:shared].expand(batch, shared)
    table = torch.cat([prefix, pages[shared:].view(batch, own)], dim=1)
    return dict(
        q=torch.randn(batch, q_len, heads, head_dim),
        k_cache=torch.randn(n_pages, heads, head_dim),
        v_cache=torch.randn(n_pages, heads, head_dim),
        meta=kk.AttentionMeta(
            table.contiguous(),
            torch.full((batch,), k_len, dtype=torch.int32),
            bidir_regions=torch.tensor([[0, region]] * batch, dtype=torch.int32),
        ),
        backend=kk.resolve_backend("torch"),
    )


def _time_ms(args: dict, repeats: int) -> float:
    kk.paged_attention(**args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kk.paged_attention(**args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


CPU_SHAPES = [  # kind, batch, query positions, keys per row, keys every row shares
    ("decode", 1, 1, 800, 0),
    ("decode", 16, 1, 800, 0),
    ("decode", 16, 1, 800, 750),  # 16 questions about one image
    ("decode", 16, 1, 1500, 0),
    ("prefill", 1, 760, 760, 0),
    ("append", 1, 40, 770, 0),
    ("prefill", 1, 1000, 1000, 0),
]
SMOKE_SHAPES = [("decode", 2, 1, 40, 30), ("prefill", 1, 40, 40, 0), ("append", 1, 8, 40, 0)]


def _cpu_rows(opts) -> None:
    shapes = SMOKE_SHAPES if opts.smoke else CPU_SHAPES
    print(f"torch backend, CPU, {torch.get_num_threads()} threads, ")
    print(f"Hq = Hkv = {opts.heads}, D = {opts.head_dim}, float32, region (0, {opts.region})")
    print(f"{'kind':8} {'B':>3} {'Lq':>5} {'K':>5} {'shared':>6} {'ms/call':>9} {'KV GB/s':>8}")
    for kind, batch, q_len, k_len, shared in shapes:
        args = _case(batch, q_len, k_len, opts.heads, opts.head_dim, opts.region, shared)
        ms = _time_ms(args, opts.repeats)
        kv_bytes = 2 * batch * k_len * opts.heads * opts.head_dim * 4
        print(f"{kind:8} {batch:3d} {q_len:5d} {k_len:5d} {shared:6d} {ms:9.2f} "
              f"{kv_bytes / ms / 1e6:8.2f}")  # fmt: skip


def _decode_case(batch: int, width: int, heads: int, head_dim: int, seed: int) -> dict:
    """bf16 decode inputs on CUDA: ``decode_tune.decode_case`` (rows of about 800 positions,
    pages scattered) over a pool of its own."""
    torch.manual_seed(seed)
    pool = torch.empty(batch * decode_tune.POSITIONS + 1, heads, head_dim, dtype=torch.bfloat16,
                       device="cuda")  # fmt: skip
    c = decode_tune.decode_case(pool, torch.empty_like(pool), batch, width, heads, seed=seed)
    return dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, page_table=c.page_table,
                seqused_k=c.seqused_k, positions=int(c.seqused_k.sum()))  # fmt: skip


def _decode_fns(case: dict, config) -> dict:
    """name -> (call, K/V bytes per call) for the decode kernels on ``case``."""
    from kestrel_kernels.triton_decode import paged_decode

    q, meta = case["q"], kk.AttentionMeta(case["page_table"], case["seqused_k"])
    k, v = case["k_cache"], case["v_cache"]
    bytes16 = 2 * case["positions"] * k.shape[1] * k.shape[2] * k.element_size()
    scales = KvScales(torch.tensor([0.05], device="cuda"), torch.tensor([0.05], device="cuda"))
    k8, v8 = quantize_kv(k, scales.k), quantize_kv(v, scales.v)
    fns = {}
    if "fa" in kk.available_backends("cuda"):
        plan = kk.plan_attention(meta, 1, backend=kk.resolve_backend("fa"), dtype=q.dtype)
        fns["fa"] = (lambda: kk.attend(q, k, v, plan), bytes16)
    fns["triton"] = (lambda: paged_decode(q[:, 0], k, v, meta, softmax_scale=0.125,
                                          config=config)[:, None], bytes16)  # fmt: skip
    fns["triton fp8"] = (lambda: paged_decode(q[:, 0], k8, v8, meta, softmax_scale=0.125,
                                              kv_scales=scales, config=config)[:, None],
                         bytes16 // 2)  # fmt: skip
    return fns


def _gpu_rows(opts) -> list[dict]:
    """The decode rows (module doc); [] without CUDA."""
    if not torch.cuda.is_available():
        print("decode kernels on CUDA (fa vs triton): skipped, no CUDA device")
        return []
    from kestrel_kernels.triton_decode import DecodeConfig, plan_decode

    decode_route.set_decode_kernel("fa")  # the fa row runs FlashAttention whatever the environment
    configs = [DecodeConfig()]
    if opts.sweep:
        configs += [
            DecodeConfig(heads=h, block_n=n, num_warps=w)
            for h, n, w in ((4, 8, 4), (16, 2, 4), (32, 2, 8), (8, 8, 4), (8, 4, 8))
        ]
        configs += [DecodeConfig(target_programs=t) for t in (1024, 4096)]  # fmt: skip
    print(f"decode on {torch.cuda.get_device_name()}: Hq = Hkv = {opts.heads}, D = "
          f"{opts.head_dim}, bf16, page table {opts.width} wide, graph-replayed")  # fmt: skip
    print(f"{'kernel':11} {'B':>3} {'K/row':>6} {'ms/call':>8} {'GB':>6} {'TB/s':>6} "
          f"{'vs fa':>8}  config")  # fmt: skip
    rows = []
    for batch in (1, 8, 64):
        case = _decode_case(batch, opts.width, opts.heads, opts.head_dim, seed=batch)
        for config in configs:
            fns = _decode_fns(case, config)
            want = fns["fa"][0]() if "fa" in fns else None
            for name, (fn, n_bytes) in fns.items():
                if name == "fa" and config is not configs[0]:
                    continue
                ms = graph_ms(fn)
                diff = float((fn() - want).abs().max()) if want is not None else float("nan")
                plan = plan_decode(batch, opts.width, opts.heads, config)
                row = dict(kernel=name, batch=batch, positions=case["positions"], ms=ms,
                           gb=n_bytes / 1e9, tb_s=n_bytes / ms / 1e9, max_diff_vs_fa=diff,
                           config=None if name == "fa" else repr(config),
                           splits=None if name == "fa" else plan.splits)  # fmt: skip
                rows.append(row)
                print(f"{name:11} {batch:3d} {case['positions'] // batch:6d} {ms:8.3f} "
                      f"{row['gb']:6.3f} {row['tb_s']:6.2f} {diff:8.4f}  "
                      f"{'' if name == 'fa' else f'{config} splits={plan.splits}'}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--region", type=int, default=730, help="bidirectional prefix length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("cpu", "gpu"), default=None)
    parser.add_argument("--width", type=int, default=2048, help="page table width (GPU rows)")
    parser.add_argument("--sweep", action="store_true", help="other Triton launch configs")
    parser.add_argument("--json", default=None, help="write the GPU rows to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes, no GPU rows")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.heads, opts.head_dim, opts.region, opts.repeats, opts.only = 2, 16, 30, 1, "cpu"
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.only != "gpu":
        _cpu_rows(opts)
    if opts.only != "cpu":
        rows = _gpu_rows(opts)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
