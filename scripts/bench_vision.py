"""The vision encoder alone on one image's crops: which attention kernel pays, where time goes.

    python scripts/bench_vision.py [--crops 10] [--rounds 5] [--repeats 5]
    python scripts/bench_vision.py --smoke     # CPU proof: a narrow encoder, torch's math path

At batch 64 every new image stops the running rows for the vision encoder (~15 ms for a
1280 x 960 image's 10 crops on an H200, ~40% of its dense bf16 peak), and at batch 1 it is the
largest part of a miss. This times the encoder of a Moondream-2-shaped model (random bf16
weights) on ``--crops`` crops with each attention kernel torch offers for it, one after the
other in each round (``torch.nn.attention.sdpa_kernel``: flash, efficient, cudnn; "default" is
torch's own pick), FlashAttention 4's dense kernel where it imports, and the default replayed
from a CUDA graph. Each variant's output is checked against the default's (a bound scaled to the
largest magnitude) and a variant that fails or differs is reported, not timed. ``gemms`` is
the encoder's matrix products alone, the same shapes in the same order: the floor the rest of
the encoder (attention, LayerNorm, GELU) sits on. ``TFLOP/s`` counts the encoder's matrix and
attention products. Then the default's GPU kernels by device time (``torch.profiler``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from collections.abc import Callable

import harness
import torch
import torch.nn.functional as F

from kestrel.moondream.config import MoondreamConfig, VisionConfig
from kestrel.moondream.model import VisionWeights
from kestrel.moondream.vision import vision_encoder
from kestrel.testing.random_weights import random_model

SMOKE = {"vision": {"enc_dim": 32, "enc_ff_dim": 64, "enc_n_layers": 2, "enc_n_heads": 2,
                    "proj_out_dim": 64, "proj_inner_dim": 128},
         "text": {"dim": 64, "ff_dim": 128, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2},
         "region": {"dim": 64, "inner_dim": 128}}  # fmt: skip
SDPA = ("flash", "efficient", "cudnn")
Encode = Callable[[], torch.Tensor]


def encoder_flops(cfg: VisionConfig, crops: int, attention: bool = True) -> float:
    """Multiply-adds x 2 of the encoder's matrix (and attention) products for ``crops`` crops;
    without ``attention``, those of the blocks' four matrix products alone (``gemms``)."""
    p, d, f = (cfg.crop_size // cfg.enc_patch_size) ** 2, cfg.enc_dim, cfg.enc_ff_dim
    per_token = 2 * d * (3 * d + d + 2 * f)  # qkv, proj, fc1, fc2
    if not attention:
        return crops * p * cfg.enc_n_layers * per_token
    patch = 2 * cfg.in_channels * cfg.enc_patch_size**2 * d
    return crops * p * (cfg.enc_n_layers * (per_token + 4 * p * d) + patch)  # + QK^T and PV


def fa4_attention() -> Callable | None:
    """FlashAttention 4's dense kernel as ``F.scaled_dot_product_attention`` (None if absent)."""
    try:
        fa = importlib.import_module("flash_attn.cute").flash_attn_func
    except Exception:
        return None

    def sdpa(q, k, v, *args, **kwargs):  # [N, H, P, D] in and out; FA4 takes [N, P, H, D]
        out = fa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return sdpa


def with_attention(encode: Encode, backend: str | Callable) -> Encode:
    """``encode`` with the encoder's attention on one SDPA backend or a replacement function."""
    if callable(backend):

        def swapped() -> torch.Tensor:
            original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = backend
            try:
                return encode()
            finally:
                F.scaled_dot_product_attention = original

        return swapped
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]  # fmt: skip

    def pinned() -> torch.Tensor:
        with sdpa_kernel(kind):
            return encode()

    return pinned


def gemms(x: torch.Tensor, w: VisionWeights) -> Encode:
    """The encoder's matrix products alone (its weights, its shapes, in its order)."""
    flat = x.reshape(-1, x.shape[-1])
    ff = torch.empty(flat.shape[0], w.blocks[0].fc1.weight.shape[0], dtype=x.dtype,
                     device=x.device)  # fmt: skip

    def run() -> torch.Tensor:
        for blk in w.blocks:
            torch.mm(flat, blk.qkv.weight.t())
            torch.mm(flat, blk.proj.weight.t())
            torch.mm(flat, blk.fc1.weight.t(), out=ff)
            out = torch.mm(ff, blk.fc2.weight.t())
        return out

    return run


def graphed(encode: Encode, device: torch.device) -> Encode:
    """``encode`` captured once as a CUDA graph and replayed (as the runtime serves it)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        encode()  # warm outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = encode()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def timer(encode: Encode, repeats: int, device: torch.device) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        if device.type != "cuda":
            import time

            t0 = time.perf_counter()
            for _ in range(repeats):
                encode()
            return {"ms": 1e3 * (time.perf_counter() - t0) / repeats}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            encode()
        end.record()
        end.synchronize()
        return {"ms": start.elapsed_time(end) / repeats}

    return run


def candidates(encode: Encode, x: torch.Tensor, w: VisionWeights, device: torch.device
               ) -> dict[str, Encode | str]:  # fmt: skip
    """Every variant by name, or the reason it cannot run here."""
    out: dict[str, Encode | str] = {"default": encode}
    if device.type != "cuda":
        out["math"] = with_attention(encode, "math")
    else:
        out.update({b: with_attention(encode, b) for b in SDPA})
        fa4 = fa4_attention()
        out["fa4"] = with_attention(encode, fa4) if fa4 else "flash_attn.cute does not import"
    for name, fn in list(out.items()):
        if isinstance(fn, str):
            continue
        try:
            fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    if device.type == "cuda":
        try:
            out["default, CUDA graph"] = graphed(encode, device)
        except Exception as exc:
            out["default, CUDA graph"] = f"capture failed: {type(exc).__name__}: {exc}"
    return out


def differs(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why ``got`` is not ``want`` within a bound scaled to ``want``'s largest magnitude."""
    scale = want.abs().max().item() or 1.0
    err = (got.float() - want.float()).abs().max().item()
    bound = (0.05 if want.dtype in (torch.bfloat16, torch.float16) else 1e-4) * scale
    return None if err <= bound else f"max |diff| {err:.3g} > {bound:.3g}"


def kernel_table(encode: Encode, emit: Callable[[str], None], top: int = 12) -> None:
    """The GPU kernels of one encode by device time: the ``top`` longest and their share."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        encode()
        torch.cuda.synchronize()
    cuda = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in cuda) or 1.0
    emit(f"\ndefault encoder: {sum(e.count for e in cuda)} GPU kernels, {total / 1e3:.2f} ms "
         f"of device time; the {top} longest:")  # fmt: skip
    emit("| us | share | calls | kernel |\n|---|---|---|---|")
    for e in sorted(cuda, key=lambda e: -e.self_device_time_total)[:top]:
        emit(f"| {e.self_device_time_total:.0f} | {e.self_device_time_total / total:.0%} | "
             f"{e.count} | {e.key[:100]} |")  # fmt: skip


def setup(smoke: bool, crops: int) -> tuple[VisionWeights, VisionConfig, torch.Tensor]:
    torch.manual_seed(0)
    config = MoondreamConfig.from_dict(SMOKE) if smoke else MoondreamConfig()
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    model = random_model(config, device=device, dtype=dtype)
    cfg = config.vision
    pixels = torch.rand(crops, cfg.in_channels, cfg.crop_size, cfg.crop_size, device=device)
    return model.vision, cfg, (2 * pixels - 1).to(dtype)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crops", type=int, default=10, help="crops per encode (a 1280x960 image: 10)")
    p.add_argument("--repeats", type=int, default=5, help="encodes per timed measurement")
    p.add_argument("--smoke", action="store_true", help="CPU proof: a narrow encoder")
    harness.add_arguments(p, rounds=5)
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: --smoke runs the CPU proof")
    w, cfg, pixels = setup(args.smoke, args.crops)
    device = pixels.device
    with torch.inference_mode():
        encode = lambda: vision_encoder(pixels, w, cfg)  # noqa: E731
        want = encode()
        found = candidates(encode, pixels, w, device)
        x = torch.randn(args.crops, (cfg.crop_size // cfg.enc_patch_size) ** 2, cfg.enc_dim,
                        device=device, dtype=pixels.dtype)  # fmt: skip
        found["gemms"] = gemms(x, w)
        skipped = {n: r for n, r in found.items() if isinstance(r, str)}
        for name, fn in found.items():
            if name != "gemms" and not isinstance(fn, str):
                why = differs(fn(), want)
                if why:
                    skipped[name] = f"output differs from the default's: {why}"
        bench = harness.start(args, "Vision encoder, one image's crops (bench_vision.py)")
        where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
        bench.emit(f"{where}: {args.crops} crops, {encoder_flops(cfg, args.crops) / 1e12:.2f} "
                   f"TFLOP an encode, {args.repeats} encodes a measurement")  # fmt: skip
        timed = {n: timer(fn, args.repeats, device) for n, fn in found.items() if n not in skipped}
        runs = bench.run(timed)
        for name, why in skipped.items():
            bench.emit(f"not timed: {name}: {why}")
        bench.table(runs, {"ms": "ms"}, baseline="default", fmt=".2f")
        ms = {n: statistics.median(r["ms"] for r in rs) for n, rs in runs.items()}
        flops = {n: encoder_flops(cfg, args.crops, attention=n != "gemms") for n in ms}
        tflops = {n: flops[n] / (v * 1e-3) / 1e12 for n, v in ms.items()}
        bench.emit("TFLOP/s: " + ", ".join(f"{n} {v:.0f}" for n, v in tflops.items()))
        if device.type == "cuda":
            kernel_table(encode, bench.emit)
        figures = {"ms": ms, "tflop_s": tflops, "skipped": skipped}
        bench.emit("vision: " + json.dumps(figures))  # one line for gpu_check.sh
        bench.finish(figures)


if __name__ == "__main__":
    main()
