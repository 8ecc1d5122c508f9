"""One MoE layer on a CPU: the grouped form against the forms it replaced, by rows.

    python scripts/bench_moe_forms.py [--dim 1024 --inner 512 --experts 64 --top-k 8]
                                      [--rows 1,8,64,512] [--dtype float32] [--rounds 5]
    python scripts/bench_moe.py --tables forms   # the same table from the MoE bench

Variants, every one over the same weights and inputs, interleaved through the harness:

- ``grouped``: ``moe.moe_mlp`` today -- the (token, expert) pairs sorted by expert on the
  device, offsets by ``searchsorted``, one grouped GEMM up and one down (``torch._grouped_mm``),
  no host sync, one form for every N;
- ``host-grouped``: the old prefill form -- per-expert counts read on the host
  (``bincount().tolist()``: a sync per layer on a GPU), then one matmul pair per chosen expert;
- ``gather``: the old decode form for N * k < E -- each row's k expert matrices copied out
  (``index_select``) and run as batched matmuls;
- ``all-experts``: the old decode form for N * k >= E -- every expert over every row, the
  routing weights zeroed outside each row's top k (E / k times the FLOPs).

Each N runs ``grouped``, ``host-grouped`` and the old static form the old code took at that N
(``gather`` below E / k rows, ``all-experts`` from there: the gather at 512 rows would copy
4,096 expert matrices). Printed: ms per layer call (median, min-max over rounds) and the ratio
to ``grouped``, per N.
The old forms live here only, as comparators; the package has one form.
"""

from __future__ import annotations

import argparse
import time

import harness
import torch
import torch.nn.functional as F

from kestrel.moondream.config import TextMoeConfig
from kestrel.moondream.model import Linear, MoeWeights
from kestrel.moondream.moe import expert_activation, moe_mlp, route


def host_grouped(x_NC, w: MoeWeights, cfg: TextMoeConfig):
    r = route(x_NC, w, cfg)
    flat = r.experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()
    token_of, weight_of = order // cfg.experts_per_token, r.weights.flatten()[order]
    out, start = torch.zeros_like(x_NC), 0
    for e, n in enumerate(counts):
        if n:
            tok = token_of[start : start + n]
            h, g = F.linear(x_NC[tok], w.up[e]).chunk(2, dim=-1)
            y = F.linear(expert_activation(h, g), w.down[e])
            out.index_add_(0, tok, y * weight_of[start : start + n, None].to(y.dtype))
            start += n
    return out


def gather(x_NC, w: MoeWeights, cfg: TextMoeConfig):
    r = route(x_NC, w, cfg)
    (N, k), C = r.experts.shape, x_NC.shape[1]
    chosen = r.experts.reshape(N * k)
    up, down = w.up.index_select(0, chosen), w.down.index_select(0, chosen)
    x = x_NC[:, None, :].expand(N, k, C).reshape(N * k, 1, C)
    h, g = torch.bmm(x, up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(expert_activation(h, g), down.transpose(1, 2)).view(N, k, C)
    return (y * r.weights.to(y.dtype)[..., None]).sum(dim=1)


def all_experts(x_NC, w: MoeWeights, cfg: TextMoeConfig):
    r = route(x_NC, w, cfg)
    weights = torch.zeros(x_NC.shape[0], cfg.num_experts, dtype=x_NC.dtype)
    weights.scatter_(1, r.experts, r.weights.to(x_NC.dtype))
    h, g = torch.matmul(x_NC, w.up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(expert_activation(h, g), w.down.transpose(1, 2))  # [E, N, C]
    return (y * weights.T[..., None]).sum(dim=0)


def grouped(x_NC, w: MoeWeights, cfg: TextMoeConfig):
    return moe_mlp(x_NC[None], w, cfg)[0][0]


FORMS = {"grouped": grouped, "host-grouped": host_grouped, "gather": gather,
         "all-experts": all_experts}  # fmt: skip


def weights(args: argparse.Namespace, dtype: torch.dtype) -> tuple[MoeWeights, TextMoeConfig]:
    cfg = TextMoeConfig(num_experts=args.experts, start_layer=0, experts_per_token=args.top_k,
                        expert_inner_dim=args.inner)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.dim, args.inner
    router = Linear(torch.randn(e, d, generator=gen).to(dtype), torch.zeros(e, dtype=dtype))
    up = (torch.randn(e, 2 * i, d, generator=gen) / d**0.5).to(dtype)
    down = (torch.randn(e, d, i, generator=gen) / i**0.5).to(dtype)
    return MoeWeights(router, up, down), cfg


def timed(fn, x, w, cfg, repeats: int) -> dict[str, float]:
    fn(x, w, cfg)  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(x, w, cfg)
    return {"ms": (time.perf_counter() - t0) * 1e3 / repeats}


def run_table(bench, args: argparse.Namespace) -> None:
    """The forms at each N (one table per N), interleaved; outputs checked equal first."""
    dtype = getattr(torch, args.dtype)
    w, cfg = weights(args, dtype)
    for n in [int(v) for v in args.rows.split(",")]:
        x = torch.randn(n, args.dim, generator=torch.Generator().manual_seed(n)).to(dtype)
        old_static = "gather" if n * cfg.experts_per_token < cfg.num_experts else "all-experts"
        forms = {k: FORMS[k] for k in ("grouped", "host-grouped", old_static)}
        want = grouped(x, w, cfg).float()
        for name, fn in forms.items():
            err = float((fn(x, w, cfg).float() - want).abs().max() / want.abs().max())
            assert err < (3e-2 if dtype == torch.bfloat16 else 1e-4), (name, n, err)
        repeats = max(1, 64 // n)
        with torch.inference_mode():
            runs = bench.run({name: lambda fn=fn, x=x, r=repeats: timed(fn, x, w, cfg, r)
                              for name, fn in forms.items()})  # fmt: skip
        pairs = f"{n * cfg.experts_per_token} pairs over {cfg.num_experts} experts"
        bench.emit(f"\nN = {n} rows ({pairs}), {args.dtype}, {args.dim} wide, "
                   f"experts of {args.inner}:")  # fmt: skip
        bench.table(runs, {"ms": "ms per layer"}, baseline="grouped", fmt=".3f")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--inner", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", default="1,8,64,512", help="N: decode rows, then a prefill's")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    bench = harness.start(args, "One MoE layer: grouped vs the old forms")
    run_table(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
