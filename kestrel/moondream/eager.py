"""Eager, uncached generation: the project's own reference path.

One request at a time, no prefix cache, no batching. It owns a PagedKVCache sized to
``max_context`` with an identity page table (position i lives in page i + 1; page 0 stays the
scratch page) and calls the same text_forward / region functions the runtime uses, so cached and
uncached results can be compared token for token.

Reference behaviours reproduced (moondream-architecture.md section 6, design.md section 5):
doubled answer marker in queries; the answer id masked from the first DECODE step only; eos and
size masked while reasoning, which stops (without feeding) on the answer id; coord tokens during
reasoning decode a coordinate from the last position's hidden state (the reference's whole-prefill
bug is avoided) and feed encode_coordinate; then a single [answer] is prefilled for the answer
phase. Point/detect: greedy; continue while argmax != eos (the first decision uses the prefill
logits), bounded by max_objects; x, then y, then size, each decoded from the hidden state that
produced it and fed back as bin / coord_bins and 2 ** (bin / (size_bins - 1) * 10 - 10).
Reported points and boxes are clamped to [0, 1]; raw values and bins are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kestrel.moondream import prompts
from kestrel.moondream.eager_types import (
    Box,
    ContextOverflowError,
    EncodedImage,
    Phase,
    Point,
    QueryResult,
    ReasoningResult,
    RegionResult,
    RegionStep,
)
from kestrel.moondream.grounding import grounding_chunks
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import (
    coord_token,
    decode_coordinate,
    decode_size,
    embed_tokens,
    size_token,
    spatial_ref_tokens,
)
from kestrel.moondream.sampling import (
    answer_suppressed_ids,
    greedy,
    reasoning_suppressed_ids,
    sample,
    suppress,
)
from kestrel.moondream.text import embed_text, lm_head, text_forward
from kestrel.moondream.vision import encode_image as vision_encode
from kestrel.prefix_cache.tokens import CoordToken, SizeToken, TextToken

__all__ = ["EagerMoondream", "EncodedImage", "QueryResult", "RegionResult"]

_Token = TextToken | CoordToken | SizeToken


@dataclass(slots=True)
class _Seq:
    """One running sequence: how many positions are filled and which adapter applies."""

    pos: int
    bidir_end: int | None  # image prompts: BOS + image attend bidirectionally
    adapter: LoraAdapter | None


class EagerMoondream:
    """Uncached Moondream 2 generation over ``model`` (any object with encode/decode works as
    ``tokenizer``: ``encode(text) -> list[int]``, ``decode(ids) -> str``)."""

    def __init__(self, model: MoondreamModel, tokenizer, *, backend: str = "auto") -> None:
        from kestrel.kv_cache import PagedKVCache

        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend
        cfg = model.config
        self.max_context = cfg.text.max_context
        t = cfg.text
        self.kv = PagedKVCache(
            n_pages=self.max_context + 1,
            n_layers=t.n_layers,
            n_kv_heads=t.n_kv_heads,
            head_dim=t.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        dev = model.device
        self._page_table = torch.arange(1, self.max_context + 1, dtype=torch.int32, device=dev)[
            None
        ]

    # ---------------------------------------------------------------- forward plumbing
    def _forward(self, seq: _Seq, emb_TC: Tensor) -> Tensor:
        """Append T positions to ``seq``; return their hidden states [T, dim] (pre post_ln)."""
        T = emb_TC.shape[0]
        end = seq.pos + T
        if end > self.max_context:
            raise ContextOverflowError(
                f"sequence would reach {end} positions, max_context is {self.max_context}; "
                "ask for fewer tokens or use a shorter prompt"
            )
        dev = emb_TC.device
        positions = torch.arange(seq.pos, end, device=dev)
        bidir = None
        if seq.bidir_end is not None:
            bidir = torch.tensor([[0, seq.bidir_end]], dtype=torch.int32, device=dev)
        hidden = text_forward(
            emb_TC[None],
            self.model.text,
            self.model.config.text,
            positions_BT=positions[None],
            kv=self.kv,
            slot_mapping=positions + 1,
            page_table=self._page_table,
            seqused_k=torch.tensor([end], dtype=torch.int32, device=dev),
            bidir_regions=bidir,
            lora=None if seq.adapter is None else [seq.adapter],
            backend=self.backend,
        )[0]
        seq.pos = end
        return hidden

    def _step(self, seq: _Seq, emb_TC: Tensor) -> tuple[Tensor, Tensor]:
        """Feed embeddings; return (logits [V] of the last position, hidden [dim] there)."""
        hidden = self._forward(seq, emb_TC)[-1]
        return lm_head(hidden[None], self.model.text)[0], hidden

    def _embed_ids(self, ids: Sequence[int]) -> Tensor:
        return embed_text(torch.tensor(list(ids), device=self.model.device), self.model.text)

    # ---------------------------------------------------------------- images
    def encode_crops(
        self, pixels_NCHW: Tensor, tiling: tuple[int, int], *, adapter: LoraAdapter | None = None
    ) -> EncodedImage:
        """Normalized crops -> image embeddings -> BOS + image prefix prefilled."""
        m = self.model
        with torch.inference_mode():
            img_emb = vision_encode(pixels_NCHW, tiling, m.vision, m.config.vision)
        return self.encode_embeddings(img_emb, tiling, adapter=adapter)

    def encode_embeddings(
        self, img_emb: Tensor, tiling: tuple[int, int], *, adapter: LoraAdapter | None = None
    ) -> EncodedImage:
        """Prefill BOS + ``img_emb`` (one bidirectional block) and keep its KV."""
        cfg = self.model.config
        n = cfg.prefix_len
        seq = _Seq(pos=0, bidir_end=n, adapter=adapter)
        with torch.inference_mode():
            emb = torch.cat([self._embed_ids([cfg.tokenizer.bos_id]), img_emb.to(self.model.dtype)])
            self._forward(seq, emb)
            k = tuple(layer[1 : n + 1].clone() for layer in self.kv.k)
            v = tuple(layer[1 : n + 1].clone() for layer in self.kv.v)
        return EncodedImage(
            img_emb, tuple(tiling), k, v, None if adapter is None else adapter.lora_id
        )

    def encode_image(self, image, *, adapter: LoraAdapter | None = None) -> EncodedImage:
        """Any image ``kestrel.moondream.image_input.load_image`` accepts -> EncodedImage."""
        from kestrel.moondream.image_crops import normalize_pixels, overlap_crops
        from kestrel.moondream.image_input import load_image

        m = self.model
        crops = overlap_crops(load_image(image), m.config.vision)
        pixels = normalize_pixels(crops.crops, m.dtype, m.device)
        return self.encode_crops(pixels, tuple(crops.tiling), adapter=adapter)

    def _start(self, image, adapter: LoraAdapter | None) -> tuple[_Seq, bool]:
        """A fresh sequence; with an image, its prefix KV copied into pages 1..prefix_len."""
        if image is None:
            return _Seq(pos=0, bidir_end=None, adapter=adapter), False
        lora_id = None if adapter is None else adapter.lora_id
        if not isinstance(image, EncodedImage):
            image = self.encode_image(image, adapter=adapter)
        elif image.lora_id != lora_id:  # the prefix KV depends on the adapter: redo it
            image = self.encode_embeddings(image.img_emb, image.tiling, adapter=adapter)
        n = self.model.config.prefix_len
        for layer, (k, v) in enumerate(zip(image.k, image.v, strict=True)):
            self.kv.k[layer][1 : n + 1] = k
            self.kv.v[layer][1 : n + 1] = v
        return _Seq(pos=n, bidir_end=n, adapter=adapter), True

    def _prefill(
        self, seq: _Seq, tokens: Sequence[_Token], has_image: bool
    ) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """Prefill the prompt (BOS dropped when the image prefix already holds it). Returns the
        last position's logits and hidden state, and the id view of what was prefilled."""
        body = list(tokens[1:] if has_image else tokens)
        logits, hidden = self._step(seq, embed_tokens(body, self.model))
        return logits, hidden, tuple(prompts.token_ids(body, self.model.config.tokenizer))

    # ---------------------------------------------------------------- text generation
    def _generate(
        self,
        seq: _Seq,
        logits: Tensor,
        hidden: Tensor,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_id: int,
        banned: tuple[int, ...],
        coord_id: int | None = None,
        record: bool = False,
    ) -> tuple[Phase, list[tuple[int, float]]]:
        """Sample until ``stop_id`` (not fed) or max_tokens. ``banned`` applies from the first
        decode step. If ``coord_id`` is set, that token feeds a decoded coordinate instead of
        its embedding; the (token index, value) of each coordinate is returned."""
        first_logits, first_hidden = logits, hidden
        steps = [logits] if record else []
        tokens: list[int] = []
        coords: list[tuple[int, float]] = []
        tok = int(sample(logits[None], temperature, top_p)[0])
        reason = "max_tokens"
        while True:
            if tok == stop_id:
                reason = "stop"
                break
            if len(tokens) >= max_tokens:
                break
            if seq.pos >= self.max_context:
                reason = "length"
                break
            tokens.append(tok)
            if coord_id is not None and tok == coord_id:
                b = int(greedy(decode_coordinate(hidden, self.model.region)[None])[0])
                fed = coord_token(b, self.model.config.region)
                coords.append((len(tokens) - 1, fed.pos))
                emb = embed_tokens([fed], self.model)
            else:
                emb = self._embed_ids([tok])
            logits, hidden = self._step(seq, emb)
            if record:
                steps.append(logits)
            tok = int(sample(suppress(logits[None], banned), temperature, top_p)[0])
        phase = Phase(
            token_ids=tuple(tokens),
            finish_reason=reason,
            prefill_logits=first_logits,
            prefill_hidden=first_hidden,
            step_logits=torch.stack(steps) if record else None,
        )
        return phase, coords

    def _answer(self, seq: _Seq, logits: Tensor, hidden: Tensor, **kw) -> Phase:
        tok = self.model.config.tokenizer
        phase, _ = self._generate(
            seq, logits, hidden, stop_id=tok.eos_id, banned=answer_suppressed_ids(tok), **kw
        )
        return phase

    def query(
        self,
        image,
        question: str,
        *,
        reasoning: bool = False,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        max_tokens: int = 768,
        temperature: float = 0.0,
        top_p: float = 1.0,
        adapter: LoraAdapter | None = None,
        record: bool = False,
    ) -> QueryResult:
        """Answer ``question`` about ``image`` (None = text-only). ``record`` keeps per-step
        logits (row 0 = prefill) in the phases."""
        cfg = self.model.config
        spatial = spatial_ref_tokens(spatial_refs or (), cfg.region)
        prompt = prompts.query_prompt(
            cfg.tokenizer, self.tokenizer.encode, question, spatial=spatial, reasoning=reasoning
        )
        gen = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        return self._text_answer(image, prompt, adapter, reasoning=reasoning, record=record, **gen)

    def _text_answer(
        self, image, prompt: list[_Token], adapter: LoraAdapter | None, *, reasoning: bool, **kw
    ) -> QueryResult:
        """Prefill ``prompt`` after the image, then (optionally) reason and answer."""
        answer_id = self.model.config.tokenizer.answer_id
        with torch.inference_mode():
            seq, has_image = self._start(image, adapter)
            logits, hidden, prompt_ids = self._prefill(seq, prompt, has_image)
            thought = None
            if reasoning:
                thought = self._reason(seq, logits, hidden, **kw)
                logits, hidden = self._step(seq, self._embed_ids([answer_id]))
            phase = self._answer(seq, logits, hidden, **kw)
        return QueryResult(
            answer=self.tokenizer.decode(list(phase.token_ids)),
            token_ids=phase.token_ids,
            finish_reason="eos" if phase.finish_reason == "stop" else phase.finish_reason,
            prompt_ids=prompt_ids,
            phase=phase,
            reasoning=thought,
        )

    def _reason(self, seq: _Seq, logits: Tensor, hidden: Tensor, **kw) -> ReasoningResult:
        tok = self.model.config.tokenizer
        phase, coords = self._generate(
            seq,
            logits,
            hidden,
            stop_id=tok.answer_id,
            banned=reasoning_suppressed_ids(tok),
            coord_id=tok.coord_id,
            **kw,
        )
        text, grounding = grounding_chunks(
            phase.token_ids, dict(coords), tok, self.tokenizer.decode
        )
        return ReasoningResult(
            text=text, token_ids=phase.token_ids, grounding=grounding, phase=phase
        )

    def caption(self, image, length: str = "normal", **kw) -> QueryResult:
        """Caption ``image``; same keywords as ``query`` minus reasoning / spatial_refs."""
        cfg = self.model.config
        prompt = prompts.caption_prompt(cfg.tokenizer, length)
        adapter, record = kw.pop("adapter", None), kw.pop("record", False)
        gen = {"max_tokens": 768, "temperature": 0.0, "top_p": 1.0, **kw}
        return self._text_answer(image, prompt, adapter, reasoning=False, record=record, **gen)

    # ---------------------------------------------------------------- point / detect
    def point(self, image, obj: str, max_objects: int = 50, **kw) -> RegionResult:
        prompt = prompts.point_prompt(self.model.config.tokenizer, self.tokenizer.encode, obj)
        return self._regions(image, prompt, max_objects, with_size=False, **kw)

    def detect(self, image, obj: str, max_objects: int = 50, **kw) -> RegionResult:
        prompt = prompts.detect_prompt(self.model.config.tokenizer, self.tokenizer.encode, obj)
        return self._regions(image, prompt, max_objects, with_size=True, **kw)

    def _regions(
        self,
        image,
        prompt: list[_Token],
        max_objects: int,
        *,
        with_size: bool,
        adapter: LoraAdapter | None = None,
        record: bool = False,
    ) -> RegionResult:
        cfg = self.model.config
        rw, rc = self.model.region, cfg.region
        objects: list[Point | Box] = []
        steps: list[RegionStep] = []
        with torch.inference_mode():
            seq, has_image = self._start(image, adapter)
            logits, hidden, prompt_ids = self._prefill(seq, prompt, has_image)
            first = (logits, hidden)
            decisions = [int(greedy(logits[None])[0])]
            while decisions[-1] != cfg.tokenizer.eos_id and len(objects) < max_objects:
                if seq.pos + (3 if with_size else 2) > self.max_context:
                    break
                x_logits = decode_coordinate(hidden, rw)
                xt = coord_token(int(greedy(x_logits[None])[0]), rc)
                _, hidden = self._step(seq, embed_tokens([xt], self.model))
                y_logits = decode_coordinate(hidden, rw)
                yt = coord_token(int(greedy(y_logits[None])[0]), rc)
                logits, hidden = self._step(seq, embed_tokens([yt], self.model))
                size_logits = None
                if with_size:
                    size_logits = decode_size(hidden, rw)
                    wb, hb = (int(b) for b in greedy(size_logits))
                    st = size_token(wb, hb, rc)
                    logits, hidden = self._step(seq, embed_tokens([st], self.model))
                    objects.append(Box.from_center(xt, yt, st))
                else:
                    objects.append(Point.from_tokens(xt, yt))
                if record:
                    steps.append(RegionStep(x_logits, y_logits, size_logits, logits))
                decisions.append(int(greedy(logits[None])[0]))
        return RegionResult(
            objects=tuple(objects),
            decisions=tuple(decisions),
            prompt_ids=prompt_ids,
            prefill_logits=first[0],
            prefill_hidden=first[1],
            steps=tuple(steps) if record else None,
        )
