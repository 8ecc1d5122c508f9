"""Batch image-QA against the public Moondream reference implementation, in one process.

    python scripts/bench_reference.py --reference DIR [--model DIR] [--rounds 3]
    MOONDREAM_REF=DIR python scripts/bench_reference.py
    python scripts/bench_reference.py --smoke    # 1 image x 1 question, one round (or SKIPPED)

Needs a checkout of the reference (``vikhyat/moondream``, the ``moondream/torch`` code that the
Hugging Face checkpoint's remote code runs); without one it says how to get it and exits with
status 0 as SKIPPED. The reference is imported from that checkout and run, never copied here.

Same checkpoint (the random-weight bench checkpoint of ``timing.bench_model``), same workload
as ``bench_batch_qa.py`` (N images x Q questions, 8-token greedy answers), three variants
interleaved through the harness (``harness.py``):
- the reference at its best: one ``encode_image`` per image, reused for its questions;
- the reference's plain API, ``query(image, question)`` per request (on the first image's
  questions only: it encodes the image every time);
- ``kestrel.Engine``, every request submitted at once (fresh engine each round).
Both the reference at its best and the Engine run the vision encoder once per image, so the
ratio between them is bounded by that shared cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import harness
import numpy as np
import torch
from bench_batch_qa import TOKENS, workload
from PIL import Image
from timing import bench_model

from kestrel import Engine

HOW_TO_GET = """SKIPPED: no reference checkout (--reference DIR or MOONDREAM_REF=DIR).
Get it with:
    git clone https://github.com/vikhyat/moondream moondream-reference
    git -C moondream-reference checkout 44146f1
then run:
    python scripts/bench_reference.py --reference moondream-reference"""


def reference_config(ref_config, cfg: dict) -> object:
    """The reference's config from the checkpoint's: keys its dataclasses do not have (fields
    this project added for Moondream 3, such as ``rope_theta``, whose Moondream 2 values the
    reference hard-codes) are left out."""
    sections = {
        "text": ref_config.TextConfig,
        "vision": ref_config.VisionConfig,
        "region": ref_config.RegionConfig,
        "tokenizer": ref_config.TokenizerConfig,
    }
    kept = {}
    for name, cls in sections.items():
        known = {f.name for f in dataclasses.fields(cls)}
        kept[name] = {k: v for k, v in cfg.get(name, {}).items() if k in known}
    return ref_config.MoondreamConfig.from_dict(kept)


def load_reference(checkout: Path, model_dir: Path):
    """The reference's MoondreamModel on the checkpoint at ``model_dir``, in float32."""
    sys.path.insert(0, str(checkout))
    import moondream.torch.config as ref_config
    import moondream.torch.moondream as ref_model
    import moondream.torch.weights as ref_weights
    from tokenizers import Tokenizer

    class LocalTokenizer:  # the reference fetches its tokenizer from the hub: use the checkpoint's
        @staticmethod
        def from_pretrained(_name: str) -> Tokenizer:
            return Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    crops = ref_model.prepare_crops

    def crops_float32(image, config, device):  # its crops are bfloat16; the model runs float32
        pixels, tiling = crops(image, config, device)
        return pixels.to(torch.float32), tiling

    ref_model.Tokenizer = LocalTokenizer
    ref_model.prepare_crops = crops_float32
    cfg = json.loads((model_dir / "config.json").read_text())["config"]
    model = ref_model.MoondreamModel(
        reference_config(ref_config, cfg), dtype=torch.float32, setup_caches=False
    )
    ref_weights.load_weights_into_model(str(model_dir / "model.safetensors"), model)
    model._setup_caches()
    return model.eval()


def reference_best(model, reqs, settings: dict) -> dict[str, float]:
    """The reference with each image encoded once (requests about the same picture share one
    image object) and every question asked against that encoding."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        encoded: dict[int, object] = {}
        for img, q in reqs:
            if id(img) not in encoded:
                encoded[id(img)] = model.encode_image(img, settings)
            model.query(encoded[id(img)], q, settings=settings)
        return {"rps": len(reqs) / (time.perf_counter() - t0), "encodes": len(encoded)}


def reference_plain(model, reqs, settings: dict) -> dict[str, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        for img, q in reqs:
            model.query(img, q, settings=settings)
        return {"rps": len(reqs) / (time.perf_counter() - t0)}


def engine(model_dir: Path, reqs) -> dict[str, float]:
    settings = {"temperature": 0.0, "max_tokens": TOKENS}
    with Engine(model_dir, device="cpu", dtype="float32", kv_cache_pages=40_000,
                max_batch_size=16) as eng:  # fmt: skip
        eng.query(None, "warm up", settings={"max_tokens": 1})
        t0 = time.perf_counter()
        futures = [eng.submit_query(img, q, settings=settings) for img, q in reqs]
        results = [f.result() for f in futures]
        assert all(len(r.tokens) == TOKENS for r in results), "answers are not fixed-length"
        return {"rps": len(reqs) / (time.perf_counter() - t0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=Path, default=os.environ.get("MOONDREAM_REF"),
                   help="reference checkout (default: $MOONDREAM_REF)")  # fmt: skip
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/kestrel-bench/cpu")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    harness.add_arguments(p, rounds=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.images, args.questions = 1, 1
    if not args.reference or not (args.reference / "moondream" / "torch").is_dir():
        print(HOW_TO_GET)
        return 0
    bench = harness.start(args, "Batch image-QA against the reference (bench_reference.py)")
    model_dir = bench_model(args.model)
    pil: dict[int, Image.Image] = {}  # one PIL image per picture: "at its best" keys on identity
    reqs = [(pil.setdefault(id(img), Image.fromarray(img)), q)
            for img, q in workload(args.images, args.questions)]  # fmt: skip
    ref = load_reference(args.reference.resolve(), model_dir)
    settings = {"temperature": 0, "max_tokens": TOKENS, "variant": None}
    warm = Image.fromarray(np.full((378, 378, 3), 127, dtype=np.uint8))
    reference_best(ref, [(warm, "warm up")], settings)
    plain = reqs[: args.questions]
    names = ("reference at its best (one encode per image)", "Engine, cache on")
    runs = bench.run(
        {
            names[0]: lambda: reference_best(ref, reqs, settings),
            f"reference plain query(image, question) ({len(plain)} requests)": (
                lambda: reference_plain(ref, plain, settings)
            ),
            names[1]: lambda: engine(model_dir, reqs),
        }
    )
    bench.emit(
        f"\n{len(reqs)} requests ({args.images} images x {args.questions} questions, "
        f"{TOKENS}-token greedy answers), CPU float32, model {model_dir.name}, one process"
    )
    encodes = {r["encodes"] for r in runs[names[0]]}
    if encodes != {args.images}:  # "at its best" must encode each picture once, no more
        raise SystemExit(f"the reference encoded {encodes} images per round, not {args.images}")
    bench.table(runs, {"rps": "requests/s"}, baseline=names[0])
    bench.finish({"reference": str(args.reference)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
