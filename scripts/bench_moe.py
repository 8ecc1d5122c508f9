"""Moondream 3's mixture of experts on a CPU: decode, prefill and TTFT of a reduced-width model.

    python scripts/bench_moe.py [--dim 384 --layers 8 --experts 64 --top-k 8 ...] [--rounds 3]

The model is a Moondream-3-shaped random checkpoint (tau attention, a dense MLP before
``--moe-start``, then ``--experts`` GeGLU experts with top-``--top-k`` routing) with reduced
widths, written into a temporary folder and loaded through the normal loader. Three tables,
every variant interleaved through the harness (``harness.py``), median (min-max) over rounds:

1. Decode against batch size: B sequences (each its own image and question) decode ``--steps``
   steps together. Besides tokens/s: the experts a step touches (distinct experts chosen by its
   B rows, mean over MoE layers), the weight bytes that step reads (every non-expert text weight
   but the embedding, plus the touched experts; KV reads excluded) and their ratio to the
   active-parameter floor (one token's weights: the non-expert ones plus top-k experts per MoE
   layer); reading all experts would be ``all-experts / floor`` times the floor.
2. Prefill of one text-only prompt of ``--prompt`` tokens: achieved GFLOP/s of the MoE model
   (active FLOPs: top-k experts per token) against the dense-equivalent, a Moondream-2-structure
   model of the same widths whose dense MLP does as many FLOPs per token as the MoE one
   (ff_dim = 1.5 x top-k x expert width: a GeGLU expert has three matrices, a dense MLP two).
3. Time to first token of an image query through the Engine: uncached (a new image) against
   cached (the image's prefix is in the prefix cache; only the question is new).
4. FP8 experts (the published form, written from the random model with absmax / 448 row
   scales): the resident bytes of the model with FP8 experts (16-bit elsewhere), in 16 bits and
   in float32, expert stacks apart (FP8 counts its scales; the issue's bar: at most 0.55x the
   16-bit stacks), then decode tokens/s at batch 1 and 16 with the experts kept FP8
   (dequantised on use) against dequantised once at load (``moe_weights``).

5. ``forms`` (``bench_moe_forms.py``): one MoE layer at these widths, the grouped form (two
   grouped GEMMs, no host sync) against the forms it replaced, at 1, 8, 64 and 512 rows.

``--tables`` picks the tables (default all: decode,prefill,ttft,fp8,forms).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import harness
import numpy as np
import torch

import kestrel.moondream.text as text_module
from kestrel import Engine
from kestrel.moondream.config import MOONDREAM2, MOONDREAM3, MoondreamConfig
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.fp8_checkpoint import write_fp8_checkpoint
from kestrel.testing.random_checkpoint import write_random_checkpoint
from kestrel.tokens import TextToken

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md3-tiny-a"


def configs(args: argparse.Namespace) -> tuple[MoondreamConfig, MoondreamConfig]:
    """(the Moondream-3-shaped config, its dense equivalent) for the requested widths."""
    fixture = json.loads((FIXTURE / "config.json").read_text())["config"]
    if args.vocab != fixture["text"]["vocab_size"]:  # prompts and answers use its tokenizer
        raise SystemExit(
            f"--vocab must be {fixture['text']['vocab_size']}, the fixture tokenizer's: a random "
            "model samples every id of its vocabulary, and the tokenizer must decode each"
        )
    moe = {"num_experts": args.experts, "start_layer": args.moe_start,
           "experts_per_token": args.top_k, "expert_inner_dim": args.expert_inner}  # fmt: skip
    text = {"dim": args.dim, "ff_dim": 4 * args.dim, "n_layers": args.layers,
            "n_heads": args.heads, "n_kv_heads": args.heads, "vocab_size": args.vocab,
            "max_context": 4096, "rope_theta": 1.5e6}  # fmt: skip
    vision = {"enc_dim": args.vision_dim, "enc_ff_dim": 4 * args.vision_dim,
              "enc_n_heads": max(1, args.vision_dim // 64), "enc_n_layers": args.vision_layers,
              "proj_out_dim": args.dim, "proj_inner_dim": 4 * args.dim}  # fmt: skip
    region = {"dim": args.dim}
    base = {"vision": vision, "region": region, "tokenizer": fixture["tokenizer"]}
    md3 = MoondreamConfig.from_dict({**base, "text": {**text, "moe": moe}}, family=MOONDREAM3)
    dense_ff = 3 * args.top_k * args.expert_inner // 2
    dense_region = {**region, "inner_dim": 4 * args.dim}
    dense = MoondreamConfig.from_dict(
        {**base, "region": dense_region, "text": {**text, "ff_dim": dense_ff}}, family=MOONDREAM2
    )
    return md3, dense


def write_model(out: Path, config: MoondreamConfig, dtype: torch.dtype) -> Path:
    write_random_checkpoint(out, config, dtype=dtype)
    (out / "tokenizer.json").write_bytes((FIXTURE / "tokenizer.json").read_bytes())
    return out


def prefill_flops(config: MoondreamConfig, tokens: int) -> float:
    """Matmul + attention FLOPs of a text-only prefill of ``tokens`` positions (active experts
    only; the lm head on the last position)."""
    t = config.text
    head_dim = t.dim // t.n_heads
    qkv_dim = t.dim + 2 * t.n_kv_heads * head_dim
    per_token = 0.0
    for layer in range(t.n_layers):
        per_token += 2 * t.dim * qkv_dim + 2 * t.dim * t.dim
        if t.moe is not None:
            per_token += 2 * qkv_dim * t.n_heads * 2  # tau's two projections
        if t.moe is not None and layer >= t.moe.start_layer:
            m = t.moe
            per_token += (
                2 * t.dim * m.num_experts + m.experts_per_token * 6 * t.dim * m.expert_inner_dim
            )
        else:
            per_token += 4 * t.dim * t.ff_dim
    attention = t.n_layers * 2 * t.dim * tokens * (tokens + 1)  # causal QK^T and PV
    return per_token * tokens + attention + 2 * t.dim * t.vocab_size


class ExpertLog:
    """Records each MoE layer's chosen experts while ``on`` (references only: no sync)."""

    def __init__(self) -> None:
        self.on = False
        self.chosen: list[torch.Tensor] = []
        inner = text_module.moe_mlp

        def recorded(x, w, cfg):
            out, routing = inner(x, w, cfg)
            if self.on:
                self.chosen.append(routing.experts)
            return out, routing

        text_module.moe_mlp = recorded
        self.restore = partial(setattr, text_module, "moe_mlp", inner)

    def mean_touched(self) -> float:
        """Distinct experts per MoE-layer call, averaged over the calls recorded."""
        counts = [int(torch.unique(e).numel()) for e in self.chosen]
        self.chosen.clear()
        return sum(counts) / max(len(counts), 1)


def weight_bytes(rt: MoondreamRuntime) -> tuple[float, float, int]:
    """(non-expert text weight bytes but the embedding, one expert's bytes, MoE layer count)."""
    sd = rt.model.state_dict()
    dense = sum(v.numel() * v.element_size() for k, v in sd.items() if k.startswith("text.")
                and k != "text.wte" and v.dim() < 3 and not k.endswith(".scale"))  # fmt: skip
    experts = [v for k, v in sd.items() if k.startswith("text.") and v.dim() == 3]
    scales = [v for k, v in sd.items() if k.endswith(".scale")]  # FP8 experts' row scales
    moe_layers = len(experts) // 2
    per_expert = sum(v[0].numel() * v.element_size() for v in experts[:2] + scales[:2])
    return float(dense), float(per_expert), moe_layers


def prompt(rt: MoondreamRuntime, question: str) -> list[TextToken]:
    t = rt.config.tokenizer
    q = t.templates["query"]
    ids = [t.bos_id, *q["prefix"], *rt.tokenizer.encode(question), *q["suffix"]]
    return [TextToken(i) for i in ids]


def decode_run(rt: MoondreamRuntime, log: ExpertLog, images: list, batch: int, steps: int):
    states = [rt.start_sequence(prompt(rt, f"question {b}?"), images[b],
                                max_new_tokens=steps + 2)[0] for b in range(batch)]  # fmt: skip
    feed = [TextToken(int(i)) for i in range(11, 11 + batch)]
    logits = rt.decode_step(states, feed)  # warm-up
    log.chosen.clear()
    log.on = True
    t0 = time.perf_counter()
    for _ in range(steps):  # greedy: each row feeds its own argmax, so rows route apart
        feed = [TextToken(int(i)) for i in logits.argmax(-1).tolist()]
        logits = rt.decode_step(states, feed)
    elapsed = time.perf_counter() - t0
    log.on = False
    for s in states:
        rt.release_sequence(s)
    return batch * steps / elapsed, elapsed / steps, log.mean_touched()


def decode_variant(rt, log, images, batch: int, args) -> dict[str, float]:
    dense, per_expert, moe_layers = weight_bytes(rt)
    k = rt.config.text.moe.experts_per_token
    with torch.inference_mode():
        tps, step_s, touched = decode_run(rt, log, images, batch, args.steps)
    read = dense + moe_layers * touched * per_expert
    floor = dense + moe_layers * k * per_expert
    return {"tps": tps, "experts": touched, "mb": read / 1e6, "floor": read / floor,
            "gbs": read / step_s / 1e9}  # fmt: skip


def prefill_variant(rt: MoondreamRuntime, tokens: int, seed: list[int]) -> dict[str, float]:
    seed[0] += 1
    rng = np.random.default_rng(seed[0])  # a new prompt each time: nothing is cached
    t = rt.config.tokenizer
    ids = [t.bos_id, *rng.integers(16, rt.config.text.vocab_size, tokens - 1).tolist()]
    with torch.inference_mode():
        t0 = time.perf_counter()
        state, _ = rt.start_sequence([TextToken(i) for i in ids], None, max_new_tokens=1)
        elapsed = time.perf_counter() - t0
    rt.release_sequence(state)
    return {"gflops": prefill_flops(rt.config, tokens) / elapsed / 1e9, "ms": elapsed * 1e3}


def ttft_variant(engine: Engine, image, counter: list[int]) -> dict[str, float]:
    counter[0] += 1
    if image is None:  # uncached: an image the cache has never seen
        image = np.random.default_rng(10_000 + counter[0]).integers(0, 256, (378, 378, 3),
                                                                    dtype=np.uint8)  # fmt: skip
    result = engine.query(image, f"question {counter[0]}?", settings={"max_tokens": 1})
    return {"ttft": result.metrics.ttft_ms, "cached": result.metrics.cached_tokens}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_argument_group("model (reduced Moondream 3 widths)")
    for flag, default in (("--dim", 384), ("--heads", 6), ("--layers", 8), ("--moe-start", 2),
                          ("--experts", 64), ("--top-k", 8), ("--expert-inner", 192),
                          ("--vocab", 768), ("--vision-dim", 192),
                          ("--vision-layers", 27)):  # fmt: skip
        size.add_argument(flag, type=int, default=default)
    size.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    work = p.add_argument_group("workload")
    work.add_argument("--batches", default="1,2,4,8,16")
    work.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    work.add_argument("--prompt", type=int, default=740, help="prefill prompt tokens")
    work.add_argument("--tables", default="decode,prefill,ttft,fp8,forms")
    work.add_argument("--fp8-batches", default="1,16", help="batch sizes of the FP8 decode table")
    harness.add_arguments(p, rounds=3)
    return p.parse_args()


def decode_table(bench, model: Path, args, dtype: torch.dtype) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    rt = MoondreamRuntime.from_pretrained(
        model, device="cpu", dtype=dtype, max_batch_size=max(batches),
        kv_cache_pages=max(batches) * (800 + args.steps) + 64, enable_prefix_cache=False,
    )  # fmt: skip
    log = ExpertLog()
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(max(batches))]
    variants = {f"B={b}": partial(decode_variant, rt, log, images, b, args) for b in batches}
    runs = bench.run(variants)
    dense, per_expert, moe_layers = weight_bytes(rt)
    m = rt.config.text.moe
    floor = dense + moe_layers * m.experts_per_token * per_expert
    everything = dense + moe_layers * m.num_experts * per_expert
    bench.emit(
        f"\n### Decode against batch size ({args.steps} steps, own image per row)\n"
        f"{moe_layers} MoE layers of {m.num_experts} experts, top-{m.experts_per_token}; "
        f"floor {floor / 1e6:.1f} MB per step (non-expert {dense / 1e6:.1f} MB + "
        f"{m.experts_per_token} experts x {per_expert / 1e6:.2f} MB per layer); all experts "
        f"{everything / 1e6:.1f} MB = {everything / floor:.2f}x the floor"
    )
    bench.table(
        runs,
        {"tps": "tokens/s", "experts": "experts touched / layer", "mb": "MB read / step",
         "floor": "x floor", "gbs": "GB/s"},
        baseline={f"B={b}": f"B={batches[0]}" for b in batches},
        fmt=".2f",
    )  # fmt: skip


def prefill_table(bench, models: dict[str, Path], args, dtype: torch.dtype) -> None:
    runtimes = {
        name: MoondreamRuntime.from_pretrained(
            path,
            device="cpu",
            dtype=dtype,
            max_batch_size=1,
            kv_cache_pages=args.prompt + 64,
            enable_prefix_cache=False,
        )
        for name, path in models.items()
    }
    seed = [0]
    for rt in runtimes.values():
        prefill_variant(rt, args.prompt, seed)  # warm-up, untimed
    runs = bench.run(
        {n: partial(prefill_variant, rt, args.prompt, seed) for n, rt in runtimes.items()}
    )
    flops = {n: prefill_flops(rt.config, args.prompt) / 1e9 for n, rt in runtimes.items()}
    bench.emit(
        f"\n### Prefill, one text-only prompt of {args.prompt} tokens\nGFLOP per prefill: "
        + ", ".join(f"{n} {f:.2f}" for n, f in flops.items())
    )
    bench.table(runs, {"gflops": "GFLOP/s", "ms": "ms"}, baseline="dense-equivalent")


def ttft_table(bench, model: Path, dtype: torch.dtype) -> None:
    with Engine(model, device="cpu", dtype=dtype, kv_cache_pages=20_000, max_batch_size=1) as e:
        warm = np.random.default_rng(5).integers(0, 256, (378, 378, 3), dtype=np.uint8)
        e.query(warm, "warm-up", settings={"max_tokens": 1})  # puts its image in the cache
        counter = [0]
        runs = bench.run({"uncached": partial(ttft_variant, e, None, counter),
                          "cached image": partial(ttft_variant, e, warm, counter)})  # fmt: skip
    bench.emit("\n### Time to first token of an image query (Engine, max_tokens 1)")
    bench.table(runs, {"ttft": "TTFT ms", "cached": "cached positions"}, baseline="uncached")


def resident_bytes(model: MoondreamModel) -> dict[str, float]:
    """Bytes the model's tensors hold: all of them, and the expert stacks (with FP8 scales)."""
    sd = model.state_dict()
    experts = sum(v.numel() * v.element_size() for k, v in sd.items()
                  if k.endswith(".scale") or (k.startswith("text.") and v.dim() == 3))  # fmt: skip
    total = sum(v.numel() * v.element_size() for v in sd.values())
    return {"total": total / 1e6, "experts": experts / 1e6}


def memory_table(bench, fp8_path: Path) -> None:
    """Resident bytes: FP8 experts + 16-bit rest, all 16-bit, all float32 (exact counts)."""
    loads = {"fp8 experts, bf16 rest": ("fp8", torch.bfloat16),
             "bfloat16": ("dequantize", torch.bfloat16),
             "float32": ("dequantize", torch.float32)}  # fmt: skip
    sizes = {name: resident_bytes(MoondreamModel.from_pretrained(fp8_path, dtype=dt,
                                                                 moe_weights=mode))
             for name, (mode, dt) in loads.items()}  # fmt: skip
    bench.emit("\n### Resident bytes of the model (tensor bytes, MB)")
    bench.emit("| model | total MB | expert stacks MB | experts vs bfloat16 |")
    bench.emit("|---|---|---|---|")
    for name, size in sizes.items():
        rel = size["experts"] / sizes["bfloat16"]["experts"]
        bench.emit(f"| {name} | {size['total']:.2f} | {size['experts']:.2f} | {rel:.3f}x |")
    ok = sizes["fp8 experts, bf16 rest"]["experts"] <= 0.55 * sizes["bfloat16"]["experts"]
    bench.emit(f"FP8 expert stacks <= 0.55x their 16-bit size: {'yes' if ok else 'NO'}")


def fp8_decode_table(bench, fp8_path: Path, args, dtype: torch.dtype) -> None:
    """Decode tokens/s: experts FP8 (dequantised on use) against dequantised at load."""
    batches = [int(b) for b in args.fp8_batches.split(",")]
    tokenizer = MoondreamTokenizer.for_checkpoint(fp8_path)
    runtimes = {mode: MoondreamRuntime(
        MoondreamModel.from_pretrained(fp8_path, dtype=dtype, moe_weights=mode), tokenizer,
        max_batch_size=max(batches), kv_cache_pages=max(batches) * (800 + args.steps) + 64,
        enable_prefix_cache=False,
    ) for mode in ("fp8", "dequantize")}  # fmt: skip
    log = ExpertLog()
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(max(batches))]
    variants = {f"{mode} B={b}": partial(decode_variant, rt, log, images, b, args)
                for b in batches for mode, rt in runtimes.items()}  # fmt: skip
    runs = bench.run(variants)
    log.restore()
    bench.emit(f"\n### Decode with FP8 experts ({args.steps} steps, {args.dtype} activations)")
    bench.table(runs, {"tps": "tokens/s", "mb": "MB read / step"},
                baseline={f"{m} B={b}": f"dequantize B={b}" for b in batches for m in runtimes},
                fmt=".2f")  # fmt: skip


def main() -> None:
    args = parse_args()
    bench = harness.start(args, "Moondream 3 mixture of experts (bench_moe.py)")
    dtype = getattr(torch, args.dtype)
    md3, dense = configs(args)
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-moe-") as tmp:
        models = {"moe": write_model(Path(tmp) / "moe", md3, dtype),
                  "dense-equivalent": write_model(Path(tmp) / "dense", dense, dtype)}  # fmt: skip
        bench.emit(f"model: dim {args.dim}, {args.layers} layers, {args.heads} heads, "
                   f"{args.dtype}, CPU (random weights, Moondream 3 structure)")  # fmt: skip
        tables = set(args.tables.split(","))
        if "decode" in tables:
            decode_table(bench, models["moe"], args, dtype)
        if "prefill" in tables:
            prefill_table(bench, models, args, dtype)
        if "ttft" in tables:
            ttft_table(bench, models["moe"], dtype)
        if "fp8" in tables:
            fp8_path = write_fp8_checkpoint(models["moe"], Path(tmp) / "moe-fp8").parent
            memory_table(bench, fp8_path)
            fp8_decode_table(bench, fp8_path, args, dtype)
    if "forms" in tables:
        import bench_moe_forms

        forms = argparse.Namespace(
            dim=args.dim, inner=args.expert_inner, experts=args.experts, top_k=args.top_k,
            rows="1,8,64,512", dtype=args.dtype,
        )  # fmt: skip
        bench_moe_forms.run_table(bench, forms)
    bench.finish()


if __name__ == "__main__":
    main()
