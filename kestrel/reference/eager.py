"""Eager, uncached generation: the project's own reference path.

One request at a time, no prefix cache, no batching. The token logic of every skill lives in
``kestrel.skills`` (shared with the engine); this module only runs the model for it. It owns a
PagedKVCache sized to ``max_context`` with an identity page table (position i lives in page
i + 1; page 0 stays the scratch page) and calls the same text_forward / region functions the
runtime uses, so cached and uncached results can be compared token for token.

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

from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.text import RoutingSink, embed_text, lm_head, text_forward
from kestrel.moondream.vision import encode_image as vision_encode
from kestrel.reference.types import (
    Box,
    ContextOverflowError,
    EncodedImage,
    Phase,
    Point,
    QueryTrace,
    ReasoningResult,
    RegionResult,
    RegionStep,
)
from kestrel.runtime.heads import ModelHeads
from kestrel.skills.base import Skill
from kestrel.skills.prompts import token_ids
from kestrel.skills.region import DetectSkill, PointSkill, RegionSkill
from kestrel.skills.settings import Settings
from kestrel.skills.text import CaptionSkill, QuerySkill, TextPhase
from kestrel.tokens import CoordToken, SizeToken, TextToken
from kestrel_kernels.backends import resolve_backend
from kestrel_kernels.batch import AttentionBatch

__all__ = ["EagerMoondream", "EncodedImage", "QueryTrace", "RegionResult"]

_Token = TextToken | CoordToken | SizeToken


@dataclass(slots=True)
class _Seq:
    """One running sequence: how many positions are filled and which adapter applies."""

    pos: int
    bidir_end: int | None  # image prompts: BOS + image attend bidirectionally
    adapter: LoraAdapter | None


class EagerMoondream:
    """Uncached Moondream 2 / 3 generation over ``model`` (any object with encode/decode works as
    ``tokenizer``: ``encode(text) -> list[int]``, ``decode(ids) -> str``)."""

    def __init__(self, model: MoondreamModel, tokenizer, *, backend: str = "auto") -> None:
        from kestrel.kv.page_table import PagedKVCache

        self.model = model
        self.tokenizer = tokenizer
        self.backend = resolve_backend(backend, model.device, model.dtype)  # once
        # Moondream 3: called with (layer, Routing) for every MoE layer of every forward
        self.routing_sink: RoutingSink | None = None
        self._ops = ModelHeads(model, tokenizer)
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
        attention = AttentionBatch(
            positions_BT=positions[None],
            slot_mapping=positions + 1,
            page_table=self._page_table,
            seqused_k=torch.tensor([end], dtype=torch.int32, device=dev),
            bidir_regions=bidir,
            backend=self.backend,
        )
        inputs = ForwardInputs.of(attention, [seq.adapter])
        hidden = text_forward(
            emb_TC[None], self.model.text, self.model.config.text, inputs, self.kv,
            routing_sink=self.routing_sink,
        )[0]  # fmt: skip
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
        """Any image ``kestrel.images.load_image`` accepts -> EncodedImage."""
        from kestrel.crops.overlap import overlap_crops
        from kestrel.images import load_image
        from kestrel.moondream.vision import normalize_pixels

        m = self.model
        crops = overlap_crops(load_image(image), m.config.vision)
        pixels = normalize_pixels(crops.crops, m.dtype, m.device)
        return self.encode_crops(pixels, tuple(crops.tiling), adapter=adapter)

    def prefill_after_image(
        self, emb_TC: Tensor, *, adapter: LoraAdapter | None = None
    ) -> tuple[Tensor, Tensor]:
        """Feed ``emb_TC`` [T, dim] at the positions after the BOS + image prefix last put in
        the cache (by ``encode_embeddings`` or a query), as a prompt's prefill does; returns the
        last position's (logits [V], hidden [dim]). What was fed past the prefix is overwritten
        by the next call. Times one prompt's prefill alone (``scripts/model_report.py``)."""
        n = self.model.config.prefix_len
        return self._step(_Seq(pos=n, bidir_end=n, adapter=adapter), emb_TC)

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
        return logits, hidden, tuple(token_ids(body, self.model.config.tokenizer))

    # ---------------------------------------------------------------- driving a skill
    def _run(self, skill: Skill, image, adapter: LoraAdapter | None) -> tuple[int, ...]:
        """Prefill the skill's prompt, then feed whatever it asks for until it finishes.

        The budget is the context left, so a skill stops with "length" where the context ends.
        Returns the id view of the prefilled prompt.
        """
        with torch.inference_mode():
            seq, has_image = self._start(image, adapter)
            logits, hidden, prompt_ids = self._prefill(seq, skill.prompt, has_image)
            fed = skill.advance(logits, hidden, self.max_context - seq.pos)
            while fed is not None:
                logits, hidden = self._step(seq, embed_tokens([fed], self.model))
                fed = skill.advance(logits, hidden, self.max_context - seq.pos)
        return prompt_ids

    # ---------------------------------------------------------------- text generation
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
    ) -> QueryTrace:
        """Answer ``question`` about ``image`` (None = text-only). ``record`` keeps per-step
        logits (row 0 = prefill) in the phases."""
        settings = Settings(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        skill = QuerySkill(
            self._ops, question, settings, reasoning=reasoning, spatial_refs=spatial_refs,
            record=record,
        )  # fmt: skip
        return self._text_result(skill, self._run(skill, image, adapter))

    def caption(self, image, length: str = "normal", **kw) -> QueryTrace:
        """Caption ``image``; same keywords as ``query`` minus reasoning / spatial_refs."""
        adapter, record = kw.pop("adapter", None), kw.pop("record", False)
        settings = Settings(**{"max_tokens": 768, "temperature": 0.0, "top_p": 1.0, **kw})
        skill = CaptionSkill(self._ops, length, settings, record=record)
        return self._text_result(skill, self._run(skill, image, adapter))

    def _text_result(self, skill: QuerySkill | CaptionSkill, prompt_ids) -> QueryTrace:
        phase = _phase(skill.answer)
        thought = None
        if isinstance(skill, QuerySkill) and skill.reasoning is not None:
            text, grounding = skill.reasoning_output()
            r = skill.reasoning
            thought = ReasoningResult(text, tuple(r.tokens), grounding, _phase(r))
        return QueryTrace(
            answer=skill.answer_text(),
            token_ids=phase.token_ids,
            finish_reason="eos" if phase.finish_reason == "stop" else phase.finish_reason,
            prompt_ids=prompt_ids,
            phase=phase,
            reasoning=thought,
        )

    # ---------------------------------------------------------------- point / detect
    def point(self, image, obj: str, max_objects: int = 50, **kw) -> RegionResult:
        return self._regions(PointSkill(self._ops, obj, max_objects, record=_rec(kw)), image, kw)

    def detect(self, image, obj: str, max_objects: int = 50, **kw) -> RegionResult:
        return self._regions(DetectSkill(self._ops, obj, max_objects, record=_rec(kw)), image, kw)

    def _regions(self, skill: RegionSkill, image, kw: dict) -> RegionResult:
        prompt_ids = self._run(skill, image, kw.pop("adapter", None))
        if kw:
            raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
        objects = tuple(
            Point.from_tokens(x, y) if s is None else Box.from_center(x, y, s)
            for x, y, s in skill.objects
        )
        steps = None
        if skill.record:
            steps = tuple(
                RegionStep(t.x_logits, t.y_logits, t.size_logits, t.next_logits)
                for t in skill.traces
            )
        return RegionResult(
            objects=objects,
            decisions=tuple(skill.decisions),
            prompt_ids=prompt_ids,
            prefill_logits=skill.first_logits,
            prefill_hidden=skill.first_hidden,
            steps=steps,
        )


def _rec(kw: dict) -> bool:
    return bool(kw.pop("record", False))


def _phase(p: TextPhase) -> Phase:
    """The eager result view of one text phase."""
    return Phase(
        token_ids=tuple(p.tokens),
        finish_reason=p.finish_reason or "length",
        prefill_logits=p.first_logits,
        prefill_hidden=p.first_hidden,
        step_logits=torch.stack(p.step_logits) if p.record and p.step_logits else None,
    )
