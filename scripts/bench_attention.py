"""Time the torch attention backend on CPU: decode (Lq = 1) and prefill shapes.

Usage: python scripts/bench_attention.py [--heads 32] [--head-dim 64] [--threads N]
Prints milliseconds per call (median of several) and the K/V bytes gathered per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kestrel_kernels as kk


def _case(batch: int, q_len: int, k_len: int, heads: int, head_dim: int, region: int):
    n_pages = batch * k_len + 1
    pages = torch.randperm(n_pages - 1)[: batch * k_len].to(torch.int32) + 1
    return dict(
        q=torch.randn(batch, q_len, heads, head_dim),
        k_cache=torch.randn(n_pages, heads, head_dim),
        v_cache=torch.randn(n_pages, heads, head_dim),
        page_table=pages.view(batch, k_len).contiguous(),
        seqused_k=torch.full((batch,), k_len, dtype=torch.int32),
        bidir_regions=torch.tensor([[0, region]] * batch, dtype=torch.int32),
        backend="torch",
    )


def _time_ms(args: dict, repeats: int) -> float:
    kk.paged_attention(**args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kk.paged_attention(**args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--region", type=int, default=730, help="bidirectional prefix length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    shapes = [
        ("decode", 1, 1, 800),
        ("decode", 16, 1, 800),
        ("decode", 16, 1, 1500),
        ("prefill", 1, 760, 760),
        ("append", 1, 40, 770),
        ("prefill", 1, 1000, 1000),
    ]
    print(f"torch backend, CPU, {torch.get_num_threads()} threads, ")
    print(f"Hq = Hkv = {opts.heads}, D = {opts.head_dim}, float32, region (0, {opts.region})")
    print(f"{'kind':8} {'B':>3} {'Lq':>5} {'K':>5} {'ms/call':>9} {'KV GB/s':>8}")
    for kind, batch, q_len, k_len in shapes:
        args = _case(batch, q_len, k_len, opts.heads, opts.head_dim, opts.region)
        ms = _time_ms(args, opts.repeats)
        kv_bytes = 2 * batch * k_len * opts.heads * opts.head_dim * 4
        print(f"{kind:8} {batch:3d} {q_len:5d} {k_len:5d} {ms:9.2f} {kv_bytes / ms / 1e6:8.2f}")


if __name__ == "__main__":
    main()
