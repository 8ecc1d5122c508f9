"""Print a checkpoint's size and the time of one image encode and one 16-token prefill.

    python scripts/model_report.py tests/fixtures/md2-tiny-a [--device cpu] [--dtype float32]
    python scripts/model_report.py --smoke    # kestrel-tiny, one timed run each

Timings are wall-clock on this machine (median of a few runs after one warm-up); they are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kestrel.crops.overlap import overlap_crops
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.vision import encode_image, normalize_pixels
from kestrel.reference.eager import EagerMoondream
from kestrel.tiny import MODEL_DIR


class _NoTokenizer:
    def encode(self, text: str) -> list[int]:
        raise RuntimeError("model_report does not tokenize")

    def decode(self, ids) -> str:
        return ""


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", help="(--smoke: default kestrel-tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="kestrel-tiny by default, 1 repeat")
    args = ap.parse_args(argv)
    if args.smoke:
        args.checkpoint, args.repeats = args.checkpoint or str(MODEL_DIR), 1
    if args.checkpoint is None:
        ap.error("the checkpoint is needed (or --smoke)")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = MoondreamModel.from_pretrained(args.checkpoint, device=args.device, dtype=dtype)
    cfg = model.config
    counts = model.parameter_counts()
    bytes_per = torch.finfo(model.dtype).bits // 8
    print(f"checkpoint {args.checkpoint}: dtype {model.dtype}, device {model.device}")
    for tower in ("vision", "text", "region", "total"):
        n = counts[tower]
        print(f"  {tower:7} {n:>15,} params  {n * bytes_per / 2**20:10.1f} MiB")

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(600, 800, 3), dtype=np.uint8)
    crops = overlap_crops(image, cfg.vision)
    pixels = normalize_pixels(crops.crops, model.dtype, model.device)
    with torch.inference_mode():
        t_vis = _time(
            lambda: encode_image(pixels, crops.tiling, model.vision, cfg.vision), args.repeats
        )
    eager = EagerMoondream(model, _NoTokenizer())
    img_emb = encode_image(pixels, crops.tiling, model.vision, cfg.vision)
    enc = eager.encode_embeddings(img_emb, crops.tiling)
    t_prefix = _time(lambda: eager.encode_embeddings(img_emb, crops.tiling), args.repeats)

    ids = torch.arange(16, device=model.device) % cfg.text.vocab_size
    emb = model.text.wte[ids]

    def prefill16() -> None:
        with torch.inference_mode():
            eager.prefill_after_image(emb)

    t_prefill = _time(prefill16, args.repeats)
    n_crops = crops.n_crops
    print(f"image encode (800x600, {n_crops} crops, tiling {crops.tiling}): {t_vis * 1e3:9.1f} ms")
    print(
        f"BOS + image prefix prefill ({cfg.prefix_len} positions):        {t_prefix * 1e3:9.1f} ms"
    )
    print(f"16-token prefill after the image prefix:                 {t_prefill * 1e3:9.1f} ms")
    kv_mib = sum(k.numel() * k.element_size() for k in enc.k) * 2 / 2**20
    print(f"KV of one image prefix: {kv_mib:.2f} MiB")


if __name__ == "__main__":
    main()
