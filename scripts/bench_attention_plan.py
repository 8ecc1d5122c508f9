"""Time the two segment plans of a miss prefill's attention: one call per layer, or two + a merge.

    python scripts/bench_attention_plan.py                  # CUDA sm90 + flash-attn-4: the figures
    python scripts/bench_attention_plan.py --smoke          # any machine: tiny sizes, torch model

A miss prefill is BOS + a 729-position image (one bidirectional block) and ``n`` text queries.
``segments.build_single_call_plan`` answers it with one non-causal call per layer (``n`` one-row
sequences), ``build_segment_plan`` with a non-causal and a causal call and a ``where``. The first
saves launches and pays ``n`` extra query tiles; this prints, for each ``n``, the median time of
``--layers`` attention calls (host launches and device work, as an eager prefill sees them) under
each plan, batch 1 and batch ``--batch``. ``SINGLE_CALL_MAX_CAUSAL_ROWS`` (or
``KESTREL_FA_SINGLE_CALL_ROWS``) should sit where the two columns cross. A timing figure: run it
on an idle machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kestrel_kernels as kk
from kestrel_kernels.segments import build_segment_plan, build_single_call_plan
from kestrel_kernels.torch_backend import paged_attention_segmented


def inputs(batch: int, prefix: int, n: int, heads: int, dim: int, dev: str, dtype) -> dict:
    k_len = prefix + n
    n_pages = batch * k_len + 1
    pages = (torch.randperm(n_pages - 1, device=dev)[: batch * k_len] + 1).int()
    return dict(
        q=torch.randn(batch, k_len, heads, dim, device=dev, dtype=dtype),
        k_cache=torch.randn(n_pages, heads, dim, device=dev, dtype=dtype),
        v_cache=torch.randn(n_pages, heads, dim, device=dev, dtype=dtype),
        page_table=pages.view(batch, k_len),
        seqused_k=torch.full((batch,), k_len, dtype=torch.int32, device=dev),
        seqused_q=None,
        bidir_regions=torch.tensor([[0, prefix]] * batch, dtype=torch.int32, device=dev),
    )


def layers_ms(args: dict, plan, layers: int, reps: int, gpu: bool) -> float:
    """Median wall time of ``layers`` attention calls with ``plan`` (synchronised at the ends)."""
    scale = 1 / math.sqrt(args["q"].shape[-1])

    def call():
        if gpu:
            return kk.attend(args["q"], args["k_cache"], args["v_cache"], plan)
        meta = kk.AttentionMeta(args["page_table"], args["seqused_k"], args["seqused_q"],
                                args["bidir_regions"])  # fmt: skip
        return paged_attention_segmented(args["q"], args["k_cache"], args["v_cache"], meta,
                                         softmax_scale=scale, segments=plan)  # fmt: skip

    times = []
    for _ in range(reps + 1):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers):
            call()
        if gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the torch model (CPU)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    if args.smoke:
        dev, dtype, prefix, heads, dim, rows = "cpu", torch.float32, 20, 2, 16, (2, 4)
        args.layers, args.reps, args.batch, gpu = 2, 1, 2, False
    else:
        if "fa" not in kk.available_backends("cuda"):
            raise SystemExit("needs the fa backend (CUDA sm90 + flash-attn-4); try --smoke")
        dev, dtype, prefix, heads, dim, rows = "cuda", torch.bfloat16, 730, 32, 64, (8, 16, 32, 64)
        gpu = True
    print(f"{args.layers} layers, prefix {prefix}, {heads} heads x {dim}; ms per forward")
    print("batch  text rows  one call  two calls + where")
    for batch in (1, args.batch):
        for n in rows:
            a = inputs(batch, prefix, n, heads, dim, dev, dtype)
            meta = (a["q"].shape[1], a["seqused_k"], None, a["bidir_regions"])
            plans = [build_single_call_plan(*meta, n), build_segment_plan(*meta, True)]
            if gpu:  # the fa backend with the forward's plan, as text_forward hands it over
                fa = kk.resolve_backend("fa", "cuda")
                whole = kk.AttentionMeta(a["page_table"], a["seqused_k"],
                                         bidir_regions=a["bidir_regions"])  # fmt: skip
                plans = [fa.plan(whole, meta[0], causal_rows=rows_bound)
                         for rows_bound in (n, meta[0])]  # fmt: skip
                assert plans[0].segments.causal_k is None and plans[1].segments.causal_k is not None
            one, two = (layers_ms(a, plan, args.layers, args.reps, gpu) for plan in plans)
            print(f"{batch:5d}  {n:9d}  {one:8.3f}  {two:17.3f}")


if __name__ == "__main__":
    main()
