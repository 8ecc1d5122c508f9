"""Train kestrel-tiny, a small Moondream 2 on synthetic scenes, and its French-colours LoRA.

    python scripts/train_tiny.py [--steps 18000] [--adapter-steps 1600] [--threads 2]
    python scripts/train_tiny.py --smoke --out DIR --state-dir DIR   # 2 + 1 steps of 1 image

Phase 1 trains every weight of a Moondream-architecture model (vision tower, projection, text
decoder, region heads; sizes in ``tiny_data.make_config``) with the project's own functions
(``kestrel.tiny.train_forward``): cross-entropy on answer tokens and on the continue/stop
decisions, Gaussian-smoothed cross-entropy on coordinate and size bins, plus a training-only
patch-class and patch-position probe on the image embeddings (see ``Trainer``). Phase 2
freezes the model and trains a rank-8 LoRA that answers colour questions in French.

Scenes come from the training stream ``synthetic.TRAIN_SEED``; the batch of step s depends only
on (seed, phase, s), so a resumed run sees the same data as an uninterrupted one. Training state
is saved to ``--state-dir`` every ``--save-every`` steps and a rerun resumes from it. Outputs:
``--out`` gets config.json, model.safetensors, tokenizer.json, loss.png and
``lora-french/adapter.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import tiny_data
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from kestrel.moondream.lora import LORA_MODULES, LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.weights import expected_shapes
from kestrel.testing.random_checkpoint import config_to_dict
from kestrel.tiny import synthetic
from kestrel.tiny.train_forward import image_embeddings, pack, packed_loss

PHASES = ("base", "adapter")
ADAPTER_DIR = "lora-french"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="default: kestrel/tiny/assets/model")
    p.add_argument("--state-dir", type=Path, help="default: bench_out/tiny_train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=18000)
    p.add_argument("--adapter-steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=8, help="images per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adapter-lr", type=float, default=5e-3)
    p.add_argument("--adapter-rank", type=int, default=8)
    p.add_argument("--redo-adapter", action="store_true", help="retrain the adapter only")
    p.add_argument("--sigma", type=float, default=24.0, help="coord/size label spread in bins")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--aux-weight", type=float, default=1.0, help="patch-class auxiliary loss")
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--smoke", action="store_true",
                   help="2 base + 1 adapter steps of one image, no plot; --out and --state-dir "
                   "must be given (the bundled model is never overwritten)")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        if args.out is None or args.state_dir is None:
            p.error("--smoke writes a model: give --out and --state-dir")
        args.steps, args.adapter_steps, args.batch, args.save_every = 2, 1, 1, 1
    args.out = args.out or Path("kestrel/tiny/assets/model")
    args.state_dir = args.state_dir or Path("bench_out/tiny_train")
    return args


def init_params(config, seed: int) -> dict[str, torch.nn.Parameter]:
    """Small-normal init; residual outputs scaled down by depth; Fourier features spread wide."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            t = torch.zeros(shape)
        elif ".ln" in name or "post_ln" in name:
            t = torch.ones(shape)
        elif name.endswith("_features"):
            t = torch.randn(shape, generator=gen) * 5.0
        else:
            std = 0.02
            if any(k in name for k in ("attn.proj", "mlp.fc2")):
                std /= math.sqrt(2 * max(config.text.n_layers, config.vision.enc_n_layers))
            t = torch.randn(shape, generator=gen) * std
        out[name] = torch.nn.Parameter(t)
    return out


def init_lora(config, seed: int, rank: int = 8) -> dict[str, torch.nn.Parameter]:
    """A = small normal, B = 0: the adapter starts as the identity."""
    gen = torch.Generator().manual_seed(seed + 1)
    shapes = expected_shapes(config)
    out = {}
    for i in range(config.text.n_layers):
        for m in LORA_MODULES:
            n_out, n_in = shapes[f"text.blocks.{i}.{m}.weight"]
            a = torch.randn(rank, n_in, generator=gen) / math.sqrt(n_in)
            out[f"text.blocks.{i}.{m}.A"] = torch.nn.Parameter(a)
            out[f"text.blocks.{i}.{m}.B"] = torch.nn.Parameter(torch.zeros(n_out, rank))
    return out


def frozen_at_zero(name: str) -> bool:
    """Vision tower and projection biases stay 0. Early on, before the decoder can read the
    image, Adam turns any of them into an image-independent offset of every image token; this
    guard is cheap, but the probes in ``Trainer`` are what keeps the image tokens informative."""
    return name.startswith("vision.") and name.endswith(".bias")


def lr_at(step: int, total: int, peak: float, warmup: int = 300) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        args.state_dir.mkdir(parents=True, exist_ok=True)
        tok_file = args.state_dir / "tokenizer.json"
        if not tok_file.exists():
            tiny_data.train_tokenizer(args.vocab).save(str(tok_file))
        self.tok_file = tok_file
        self.tokenizer = MoondreamTokenizer.from_file(tok_file)
        self.config = tiny_data.make_config(self.tokenizer)
        self.builder = tiny_data.SegmentBuilder(self.config, self.tokenizer)
        self.state_file = args.state_dir / "state.pt"
        self.params = init_params(self.config, args.seed)
        self.lora = init_lora(self.config, args.seed, args.adapter_rank)
        # Training-only probe: image embedding -> class of the shape under each patch. Its dense,
        # image-specific gradient keeps the image tokens informative from the first steps (else
        # they collapse to one image-independent vector); it is not part of the checkpoint.
        gen = torch.Generator().manual_seed(args.seed + 2)
        n_cls, dim = tiny_data.N_PATCH_CLASSES, self.config.text.dim
        # A second probe reads each patch's row and column: the decoder can only report a
        # coordinate that the image tokens carry, and otherwise they learn it very slowly.
        n_pos = 2 * self.config.vision.grid_side
        self.aux = {
            "weight": torch.nn.Parameter(torch.randn(n_cls, dim, generator=gen) * 0.02),
            "bias": torch.nn.Parameter(torch.zeros(n_cls)),
            "pos_weight": torch.nn.Parameter(torch.randn(n_pos, dim, generator=gen) * 0.02),
            "pos_bias": torch.nn.Parameter(torch.zeros(n_pos)),
        }
        self.state = {"phase": "base", "step": 0, "history": {p: [] for p in PHASES}}
        self.opt_state = None
        if self.state_file.exists():
            saved = torch.load(self.state_file, weights_only=False)
            pairs = [(saved["params"], self.params), (saved["aux"], self.aux)]
            if not args.redo_adapter:
                pairs.append((saved["lora"], self.lora))
            for src, dst in pairs:
                for k, v in src.items():
                    if k in dst:
                        dst[k].data.copy_(v)
            self.state, self.opt_state = saved["state"], saved["opt"]
            if args.redo_adapter:  # keep the base model, start the adapter from scratch
                assert self.state["phase"] in ("adapter", "done"), "the base is not trained yet"
                self.state.update(phase="adapter", step=0)
                self.state["history"]["adapter"] = []
                self.opt_state = None
            print(
                f"resumed from {self.state_file}: {self.state['phase']} step {self.state['step']}"
            )

    def model(self) -> MoondreamModel:
        return MoondreamModel.from_state_dict(self.params, self.config)

    def batch_loss(self, phase: str, step: int, model, lora) -> dict:
        """The loss of step ``step``: scenes and tasks depend only on (seed, phase, step)."""
        a = self.args
        rng = np.random.default_rng([a.seed, PHASES.index(phase), step])
        base = (PHASES.index(phase) * 10_000_000) + step * a.batch
        rows, pixels, tilings, labels = [], [], [], []
        for j in range(a.batch):
            scene = synthetic.make_scene(synthetic.TRAIN_SEED, base + j)
            rows.append(
                tiny_data.scene_segments(scene, rng, self.builder, french=phase == "adapter")
            )
            px, tiling = tiny_data.scene_pixels(scene, self.config)
            pixels.append(px)
            tilings.append(tiling)
            labels.append(tiny_data.patch_labels(scene, self.config.vision.grid_side))
        img_emb = image_embeddings(pixels, tilings, model)
        out = packed_loss(model, pack(rows, self.config), img_emb, lora=lora, sigma=a.sigma)
        if phase == "base" and a.aux_weight > 0:
            aux = F.linear(img_emb, self.aux["weight"], self.aux["bias"])  # [B, n_patches, cls]
            out["aux"] = F.cross_entropy(aux.flatten(0, 1), torch.cat(labels))
            out["aux"] = out["aux"] + self.position_loss(img_emb)
            out["loss"] = out["loss"] + a.aux_weight * out["aux"]
        return out

    def position_loss(self, img_emb: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each image token's row and column (row-major patch grid)."""
        g = self.config.vision.grid_side
        logits = F.linear(img_emb, self.aux["pos_weight"], self.aux["pos_bias"])  # [B, P, 2g]
        idx = torch.arange(g * g).repeat(img_emb.shape[0])
        rows, cols = logits.flatten(0, 1).split(g, dim=-1)
        return F.cross_entropy(rows, idx // g) + F.cross_entropy(cols, idx % g)

    def save_state(self, opt) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        torch.save(
            {
                "params": {k: v.detach() for k, v in self.params.items()},
                "lora": {k: v.detach() for k, v in self.lora.items()},
                "aux": {k: v.detach() for k, v in self.aux.items()},
                "state": self.state,
                "opt": opt.state_dict(),
            },
            tmp,
        )
        os.replace(tmp, self.state_file)

    def run_phase(self, phase: str) -> None:
        a = self.args
        total = a.steps if phase == "base" else a.adapter_steps
        peak = a.lr if phase == "base" else a.adapter_lr
        trained = self.lora
        if phase == "base":  # vision biases stay 0 (see frozen_at_zero)
            trained = {k: v for k, v in self.params.items() if not frozen_at_zero(k)}
            trained.update({f"aux.{k}": v for k, v in self.aux.items()})
        for name, p in self.params.items():
            p.requires_grad_(phase == "base" and name in trained)
        opt = torch.optim.AdamW(
            trained.values(), lr=peak, weight_decay=a.weight_decay, betas=(0.9, 0.95)
        )
        if self.opt_state is not None and self.state["phase"] == phase:
            try:
                opt.load_state_dict(self.opt_state)
            except ValueError as exc:  # the trained set changed (e.g. a new probe): fresh moments
                print(f"optimizer state not restored: {exc}")
        self.state["phase"] = phase
        model = self.model()
        lora = None
        if phase == "adapter":
            lora = LoraAdapter.from_tensors("train", self.lora, self.config)
        start = self.state["step"]
        bar = tqdm(range(start, total), initial=start, total=total, desc=phase, mininterval=15)
        ema = None
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, peak, warmup=300 if phase == "base" else 50)
            out = self.batch_loss(phase, step, model, lora)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(trained.values(), 1.0)
            opt.step()
            rec = {k: round(float(v.detach()), 4) for k, v in out.items()}
            self.state["history"][phase].append(rec)
            ema = rec["loss"] if ema is None else 0.98 * ema + 0.02 * rec["loss"]
            bar.set_postfix(loss=f"{ema:.3f}", lm_acc=rec["lm_acc"], err=rec.get("coord_err"))
            self.state["step"] = step + 1
            if (step + 1) % a.save_every == 0 or step + 1 == total:
                self.save_state(opt)
        self.opt_state = None
        self.state["step"] = 0
        self.state["phase"] = PHASES[PHASES.index(phase) + 1] if phase == "base" else "done"
        self.save_state(opt)


def write_checkpoint(tr: Trainer) -> None:
    """HF layout: config.json (nested config), model.safetensors, tokenizer.json."""
    out, dtype = tr.args.out, getattr(torch, tr.args.save_dtype)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().to(dtype).contiguous() for k, v in tr.params.items()}
    save_file(tensors, str(out / "model.safetensors"))
    meta = {
        "architectures": ["HfMoondream"],
        "config": config_to_dict(tr.config),
        "model_type": "moondream1",
        "torch_dtype": tr.args.save_dtype,
        "kestrel_tiny": {"seed": tr.args.seed, "steps": tr.args.steps, "scene_seed": 0},
    }
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tr.tok_file.read_text())
    adir = out / ADAPTER_DIR
    adir.mkdir(exist_ok=True)
    lora = {k: v.detach().to(dtype).contiguous() for k, v in tr.lora.items()}
    save_file(lora, str(adir / "adapter.safetensors"))
    for f in (out / "model.safetensors", adir / "adapter.safetensors"):
        f.chmod(0o644)  # safetensors writes 0600; packaged files must be world-readable


def plot(tr: Trainer) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, phase in zip(axes, PHASES, strict=True):
        hist = tr.state["history"][phase]
        for key in ("loss", "lm", "coord", "size"):
            y = np.array([h[key] for h in hist])
            if len(y) >= 50:
                y = np.convolve(y, np.ones(50) / 50, mode="valid")
            ax.plot(y, label=key, lw=1)
        ax.set_title(f"{phase} ({len(hist)} steps)")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(tr.args.out / "loss.png", dpi=80)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tr = Trainer(args)
    t0 = time.time()
    if tr.state["phase"] == "base":
        tr.run_phase("base")
    if tr.state["phase"] == "adapter":
        tr.run_phase("adapter")
    write_checkpoint(tr)
    if not args.smoke:
        plot(tr)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
