"""Does the vision encoder run beside decode steps on the GPU? The question encoding new images
ahead of their admission hangs on.

    python scripts/bench_overlap.py [--batch 64] [--encodes 8] [--steps 64] [--rounds 3]
    python scripts/bench_overlap.py --smoke     # CPU proof: a narrow model, no streams

At batch 64 a request's new image costs ~15 ms of vision encoder, during which every running
row waits: the encoder is compute-bound (large matrix products), a decode step mostly reads K/V
(memory-bound), so on paper the two could share the device. This measures it on a
Moondream-2-shaped model with random bf16 weights (the runtime's captured graphs, as served):

- ``encoder``: ``--encodes`` encodes of a 1280 x 960 image's 10 crops, back to back;
- ``decode``: ``--steps`` decode steps of ``--batch`` rows over ~760-position contexts;
- ``one stream``: both, one after the other, on one stream (what serving does today);
- ``two streams``: the encodes on a side stream while the steps run on the main one, issued
  interleaved, then both waited for.

Each figure is wall time from a synchronized start to a synchronized end, the median over the
harness's rounds, variants interleaved. ``hidden`` is the share of the shorter side that the
two streams saved: (one stream - two streams) / min(encoder, decode); 0 means no overlap, 1
means the shorter side cost nothing. The encoder's output on the side stream is checked equal
to the main stream's. With ``--smoke`` (no CUDA) the two-stream variant runs on one stream, so
only the bookkeeping is proven.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import harness
import numpy as np
import torch

from kestrel.images import prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.vision import encode_image
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.random_weights import random_model
from kestrel.tokens import TextToken

# A narrow model of Moondream 2's structure for --smoke (the CPU proof of the bookkeeping).
SMOKE = {
    "text": {"dim": 64, "ff_dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2},
    "vision": {"enc_dim": 32, "enc_ff_dim": 64, "enc_n_layers": 1, "enc_n_heads": 2,
               "proj_out_dim": 64, "proj_inner_dim": 128},
    "region": {"dim": 64, "inner_dim": 128},
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_budget(steps: int, rounds: int) -> int:
    """Decode steps each row takes over a measurement: three variants of ``steps`` steps each
    round, a step for each of the two warm-up runs, and a little room."""
    return 3 * steps * rounds + 2 + 8


class Overlap:
    """The runtime, a batch of running rows and one image's encoder input, ready to time."""

    def __init__(self, rt: MoondreamRuntime, batch: int, steps: int, rounds: int = 3) -> None:
        self.rt, self.steps = rt, steps
        rng = np.random.default_rng(0)
        image = prepare_image(rng.integers(0, 256, (960, 1280, 3), np.uint8))
        crops = rt.crops.pixels(image)
        self.pixels, self.tiling = crops.encoder_input(rt.dtype, rt.device), crops.tiling
        bos = TextToken(rt.config.tokenizer.bos_id)
        shared = prepare_image(rng.integers(0, 256, (600, 800, 3), np.uint8))
        budget = step_budget(steps, rounds)
        room = rt.config.text.max_context - rt.config.prefix_len - 2  # BOS, image, 2 tokens
        if budget > room:
            raise SystemExit(
                f"{steps} decode steps x {rounds} rounds take {budget} positions a row, more "
                f"than the {room} the context leaves: use fewer"
            )
        self.states = [
            rt.start_sequence([bos, TextToken(100 + i), TextToken(17)], shared,
                              max_new_tokens=budget)[0]
            for i in range(batch)
        ]  # fmt: skip
        self.feed = [TextToken(500 + i) for i in range(batch)]
        cuda = rt.device.type == "cuda"
        self.side = torch.cuda.Stream(rt.device) if cuda else None

    def encode(self) -> torch.Tensor:
        if self.rt.vision_graphs is not None:
            return self.rt.vision_graphs.encode(self.pixels, self.tiling)
        return encode_image(self.pixels, self.tiling, self.rt.model.vision, self.rt.config.vision)

    def decode(self) -> None:
        self.rt.decode_step(self.states, self.feed)

    def run(self, encodes: int, steps: int, streams: int) -> tuple[float, torch.Tensor | None]:
        """Wall seconds of ``encodes`` encodes and ``steps`` decode steps, on one stream or the
        encodes on the side stream (issued interleaved); and the last encode's output."""
        device, out = self.rt.device, None
        _sync(device)
        t0 = time.perf_counter()
        if streams == 1:
            for _ in range(encodes):
                out = self.encode()
            for _ in range(steps):
                self.decode()
        else:
            per = -(-steps // max(1, encodes))  # decode steps issued after each encode
            done = 0
            main = torch.cuda.current_stream(device) if self.side is not None else None
            for _ in range(max(encodes, 1)):
                if encodes:
                    if self.side is not None:
                        self.side.wait_stream(main)
                    with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
                        out = self.encode()
                for _ in range(min(per, steps - done)):
                    self.decode()
                    done += 1
        _sync(device)
        return time.perf_counter() - t0, out

    def release(self) -> None:
        for s in self.states:
            self.rt.release_sequence(s)


def variants(o: Overlap, encodes: int, steps: int) -> dict[str, Callable[[], dict[str, float]]]:
    def timed(e: int, s: int, streams: int) -> Callable[[], dict[str, float]]:
        return lambda: {"ms": 1e3 * o.run(e, s, streams)[0]}

    return {
        "encoder": timed(encodes, 0, 1),
        "decode": timed(0, steps, 1),
        "one stream": timed(encodes, steps, 1),
        "two streams": timed(encodes, steps, 2),
    }


def medians(runs: harness.Runs) -> dict[str, float]:
    """Each variant's median ms, and ``hidden``: the share of the shorter side that the two
    streams saved."""
    ms = {name: statistics.median(r["ms"] for r in rounds) for name, rounds in runs.items()}
    saved = ms["one stream"] - ms["two streams"]
    return {**ms, "hidden": saved / max(min(ms["encoder"], ms["decode"]), 1e-9)}


def measure(rt: MoondreamRuntime, batch: int = 64, encodes: int = 8, steps: int = 64,
            rounds: int = 3) -> dict[str, float]:  # fmt: skip
    """The variants on a runtime already built (``bench_gpu_runtime.py --overlap``), run
    interleaved ``rounds`` times: ``medians``."""
    o = Overlap(rt, batch, steps, rounds)
    try:
        with torch.inference_mode():
            o.run(1, 1, 2)  # warm both paths
            return medians(harness.interleave(variants(o, encodes, steps), rounds, lambda _: None))
    finally:
        o.release()


def build(smoke: bool, batch: int) -> MoondreamRuntime:
    torch.manual_seed(0)
    if smoke:
        config = MoondreamConfig.from_dict(SMOKE)
        model = random_model(config, device="cpu", dtype=torch.float32)
        return MoondreamRuntime(model, max_batch_size=batch, kv_cache_pages=batch * 1024)
    model = random_model(MoondreamConfig(), device="cuda", dtype=torch.bfloat16)
    return MoondreamRuntime(model, max_batch_size=batch, kv_memory_fraction=0.8)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, help="decode rows (default 64; smoke 4)")
    p.add_argument("--encodes", type=int, help="image encodes (default 8; smoke 2)")
    p.add_argument("--steps", type=int, help="decode steps (default 64; smoke 4)")
    p.add_argument("--smoke", action="store_true", help="CPU proof: a narrow model, one stream")
    harness.add_arguments(p, rounds=3)
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: --smoke runs the CPU proof")
    batch = args.batch or (4 if args.smoke else 64)
    encodes = args.encodes or (2 if args.smoke else 8)
    steps = args.steps or (4 if args.smoke else 64)
    rt = build(args.smoke, batch)
    o = Overlap(rt, batch, steps, args.rounds)
    with torch.inference_mode():
        _, want = o.run(1, 0, 1)
        _, got = o.run(1, 1, 2)  # warm both paths; the side stream's encode equals the main's
        if not torch.equal(want, got):
            raise SystemExit("the encoder's output on the side stream differs from the main's")
        bench = harness.start(args, "Vision encoder beside decode steps (bench_overlap.py)")
        device = torch.cuda.get_device_name() if rt.device.type == "cuda" else "CPU (one stream)"
        bench.emit(f"{device}: {encodes} encodes of 10 crops, {steps} decode steps of {batch} rows")
        runs = bench.run(variants(o, encodes, steps))
    o.release()
    bench.table(runs, {"ms": "ms"}, baseline="one stream", fmt=".2f")
    got = medians(runs)
    saved = got["one stream"] - got["two streams"]
    bench.emit(f"hidden: {got['hidden']:.2f} of the shorter side ({saved:.2f} ms saved)")
    rt.check_integrity()
    bench.finish({"overlap": got})


if __name__ == "__main__":
    main()
