"""Training data of the tiny model: tokenizer, config and packed segments from synthetic scenes.

Prompts are built by ``kestrel.skills.prompts`` (the functions the eager path and the runtime
use), so the model is trained on exactly the token sequences it is later asked with.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kestrel.crops.overlap import overlap_crops
from kestrel.moondream.config import (
    MoondreamConfig,
    RegionConfig,
    TextConfig,
    TokenizerConfig,
    VisionConfig,
)
from kestrel.moondream.region import coord_to_bin, coord_token, size_to_bin, size_token
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.vision import normalize_pixels
from kestrel.skills import prompts
from kestrel.tiny import synthetic
from kestrel.tiny.train_forward import NO_TARGET, Segment
from kestrel.tokens import TextToken

# Moondream's special-token layout: ids 0-9 (bos = eos = 0; id 8 reserved).
SPECIALS = (
    "<|endoftext|>",
    "<|md_open|>",
    "<|md_close|>",
    "<|md_answer|>",
    "<|md_thinking|>",
    "<|md_coord|>",
    "<|md_size|>",
    "<|md_ground_points|>",
    "<|md_ground_text|>",
    "<|md_end_ground|>",
)
TEMPLATE_WORDS = ("query", "describe", "short", "normal", "long", "detect", "point")


def corpus(n_scenes: int = 1500) -> list[str]:
    """Every string the model reads or writes, from training-stream scenes."""
    lines = list(TEMPLATE_WORDS) * 50 + [" " + c for c in synthetic.FRENCH_COLORS.values()] * 50
    for scene in synthetic.scenes(synthetic.TRAIN_SEED, n_scenes, start=10_000_000):
        lines += [f"{q.question} {q.answer}" for q in scene.queries()]
        lines += [" " + scene.caption("short"), " " + scene.caption("normal")]
        lines += [" " + r.obj for r in scene.region_items()]
    return lines


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE (no normalizer, no prefix space) with the special ids 0-9."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    for i, name in enumerate(SPECIALS):
        assert tok.token_to_id(name) == i, f"special token {name} is not id {i}"
    return tok


def _word_id(tok: MoondreamTokenizer, word: str) -> int:
    ids = tok.encode(word)
    if len(ids) != 1:
        raise ValueError(f"template word {word!r} is not a single token: {ids}")
    return ids[0]


def make_config(tok: MoondreamTokenizer) -> MoondreamConfig:
    """The tiny model: Moondream 2's structure, small everywhere (112 px crops, 64 image tokens)."""
    w = {word: _word_id(tok, word) for word in TEMPLATE_WORDS}
    templates = {
        "caption": {n: [1, w["describe"], 2, w[n], 3] for n in ("short", "normal", "long")},
        "query": {"prefix": [1, w["query"], 2], "suffix": [3]},
        "detect": {"prefix": [1, w["detect"], 2], "suffix": [3]},
        "point": {"prefix": [1, w["point"], 2], "suffix": [3]},
    }
    dim = 192
    return MoondreamConfig(
        text=TextConfig(
            dim=dim, ff_dim=768, n_layers=4, vocab_size=tok.vocab_size, max_context=1024,
            n_heads=3, n_kv_heads=3, prefix_attn=65,
        ),
        vision=VisionConfig(
            enc_dim=96, enc_patch_size=14, enc_n_layers=4, enc_ff_dim=384, enc_n_heads=3,
            proj_out_dim=dim, crop_size=112, max_crops=4, overlap_margin=1, proj_inner_dim=384,
        ),
        region=RegionConfig(dim=dim, inner_dim=192),
        tokenizer=TokenizerConfig(templates=templates),
    )  # fmt: skip


class SegmentBuilder:
    """Prompt + answer -> Segment with the targets the eager path's decisions read."""

    def __init__(self, config: MoondreamConfig, tokenizer: MoondreamTokenizer) -> None:
        self.cfg = config
        self.tok = tokenizer

    def _text(self, prompt: list, answer: str) -> Segment:
        body = prompt[1:]  # BOS is the image prefix's first position
        ans = self.tok.encode(" " + answer)  # answers start with a space, as in Moondream
        tokens = (*body, *(TextToken(i) for i in ans))
        lm = [NO_TARGET] * (len(body) - 1) + [*ans, self.cfg.tokenizer.eos_id]
        n = len(tokens)
        return Segment(tokens, tuple(lm), (NO_TARGET,) * n, (None,) * n)

    def query(self, question: str, answer: str) -> Segment:
        return self._text(
            prompts.query_prompt(self.cfg.tokenizer, self.tok.encode, question), answer
        )

    def caption(self, length: str, text: str) -> Segment:
        return self._text(prompts.caption_prompt(self.cfg.tokenizer, length), text)

    def region(self, item: synthetic.RegionItem, with_size: bool) -> Segment:
        build = prompts.detect_prompt if with_size else prompts.point_prompt
        tokens = list(build(self.cfg.tokenizer, self.tok.encode, item.obj)[1:])
        rc, t = self.cfg.region, self.cfg.tokenizer
        lm, coord, size = [NO_TARGET] * len(tokens), [NO_TARGET] * len(tokens), [None] * len(tokens)
        for k, (x0, y0, x1, y1) in enumerate(item.boxes):
            cx, cy = item.points[k]
            lm[-1], coord[-1] = t.coord_id, coord_to_bin(cx, rc)  # continue, then decode x
            tokens.append(coord_token(coord_to_bin(cx, rc), rc))
            lm.append(NO_TARGET), coord.append(coord_to_bin(cy, rc)), size.append(None)
            tokens.append(coord_token(coord_to_bin(cy, rc), rc))
            lm.append(NO_TARGET), coord.append(NO_TARGET), size.append(None)
            if with_size:
                wb, hb = size_to_bin(x1 - x0, rc), size_to_bin(y1 - y0, rc)
                size[-1] = (wb, hb)
                tokens.append(size_token(wb, hb, rc))
                lm.append(NO_TARGET), coord.append(NO_TARGET), size.append(None)
        lm[-1] = t.eos_id  # after the last object (or the prompt): stop
        return Segment(tuple(tokens), tuple(lm), tuple(coord), tuple(size))


def _pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


def pick_query(scene: synthetic.Scene, rng: np.random.Generator, color_weight: float = 0.0):
    """A question: a kind chosen uniformly (colour with probability ``color_weight`` if set),
    yes and no equally likely for existence questions."""
    qs = scene.queries()
    kinds = sorted({q.kind for q in qs})
    kind = "color" if "color" in kinds and rng.random() < color_weight else _pick(rng, kinds)
    pool = [q for q in qs if q.kind == kind]
    if kind == "exists":
        answer = _pick(rng, sorted({q.answer for q in pool}))
        pool = [q for q in pool if q.answer == answer]
    return _pick(rng, pool)


def scene_segments(
    scene: synthetic.Scene,
    rng: np.random.Generator,
    builder: SegmentBuilder,
    *,
    french: bool = False,
    n_queries: int = 3,
) -> list[Segment]:
    """Segments for one image: queries, one point, one detect, sometimes a caption. ``french``
    answers colour questions in French (the adapter's behaviour) and asks them more often."""
    out = []
    for _ in range(n_queries):
        q = pick_query(scene, rng, color_weight=0.5 if french else 0.0)
        if q.kind == "color" and (french or rng.random() < 0.3):
            # The base model also learns "... in French?": an adapter only adapts the decoder
            # blocks, so the French words must already be live outputs of lm_head.
            question = q.question if french else q.question[:-1] + " in French?"
            out.append(builder.query(question, synthetic.FRENCH_COLORS[q.answer]))
            continue
        out.append(builder.query(q.question, q.answer))
    items = scene.region_items()
    present = [r for r in items if r.points]
    absent = [r for r in items if not r.points]
    for with_size in (False, True):
        pool = absent if absent and rng.random() < 0.15 else present
        out.append(builder.region(_pick(rng, pool), with_size))
    if rng.random() < 0.25:
        length = _pick(rng, ("short", "normal", "long"))
        out.append(builder.caption(length, scene.caption(length)))
    return out


def scene_pixels(scene: synthetic.Scene, config: MoondreamConfig) -> tuple[torch.Tensor, tuple]:
    """Normalized crops and tiling, exactly as the eager path prepares the image."""
    crops = overlap_crops(scene.image, config.vision)
    return normalize_pixels(crops.crops, torch.float32), tuple(crops.tiling)


N_PATCH_CLASSES = 1 + len(synthetic.COLORS) * len(synthetic.SHAPES)


def patch_labels(scene: synthetic.Scene, grid: int) -> torch.Tensor:
    """Training-only auxiliary target: per patch of the global crop (row-major), 0 for background
    or 1 + colour * n_shapes + kind for the shape whose box holds the patch centre."""
    colors, kinds = list(synthetic.COLORS), list(synthetic.SHAPES)
    labels = torch.zeros(grid * grid, dtype=torch.int64)
    centres = (np.arange(grid) + 0.5) / grid
    for gy, v in enumerate(centres):
        for gx, u in enumerate(centres):
            for s in scene.shapes:
                if s.box[0] <= u <= s.box[2] and s.box[1] <= v <= s.box[3]:
                    cls = colors.index(s.color) * len(kinds) + kinds.index(s.kind)
                    labels[gy * grid + gx] = 1 + cls
    return labels
