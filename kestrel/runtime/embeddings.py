"""The runtime's side of the image-embedding tier (``kestrel/embedding_cache/``).

On a prefill that computes an image (its KV is not in the prefix cache), the runtime first asks
the tier for the image's embedding under the request's salt; on a hit the prefill takes it
as it is (no crops, no vision encoder), on a miss the encoder runs and its output is kept.
``EmbeddingBatch`` is one prefill's view: it looks every wanted image up once (pinning the
hits until the prefill is built), tells the crop pool which images still need crops, and
encodes each missing image once per salt.

The key's ``source`` is everything besides the pixels that the embedding depends on: the vision
config (crop size, crop count, overlap), the model dtype and a fingerprint of the vision
weights. Adapters touch the text decoder only, so the key carries no adapter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple

import torch

from kestrel.embedding_cache import EmbeddingCache, EmbeddingKey, EmbeddingLease
from kestrel.images import PreparedImage
from kestrel.kv.storage import PagedKVCache
from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.sequence import SequenceState

__all__ = [
    "DEFAULT_IMAGES_PER_POOL_IMAGE",
    "MAX_DEFAULT_FRACTION",
    "EmbeddingBatch",
    "ImageEmbeddings",
    "embedding_tier",
    "size_tier",
    "vision_source",
]

# Default budget: the embeddings of four times as many images as the KV pool holds, at most a
# quarter of the pool's bytes. A Moondream 2 image's embedding is ~1/47 of its KV (3 MB against
# 143 MB in bf16), so that is ~8% of the pool there; small models hit the cap.
DEFAULT_IMAGES_PER_POOL_IMAGE = 4
MAX_DEFAULT_FRACTION = 1 / 4
_SAMPLE = 256  # elements taken from each end of a weight for the fingerprint


def vision_source(model: MoondreamModel) -> str:
    """The model's vision identity: config, dtype and a fingerprint of its vision weights."""
    h = hashlib.sha256(repr(astuple(model.config.vision)).encode())
    h.update(str(model.dtype).encode())
    w = model.vision
    for t in (w.pos_emb, w.patch_emb.weight, w.proj_fc1.weight, w.proj_fc2.weight):
        flat = t.detach().reshape(-1)
        h.update(repr(tuple(t.shape)).encode())
        for part in (flat[:_SAMPLE], flat[-_SAMPLE:]):
            h.update(part.float().cpu().numpy().tobytes())
    return f"vision:{h.hexdigest()[:32]}"


class ImageEmbeddings:
    """The tier as the runtime sees it: off (``budget == 0``) or an ``EmbeddingCache``."""

    def __init__(self, model: MoondreamModel, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"embedding cache budget must be an int >= 0, got {budget!r}")
        self.cache = EmbeddingCache(budget) if budget else None
        self.source = vision_source(model) if budget else ""

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    def key(self, image: PreparedImage) -> EmbeddingKey:
        return EmbeddingKey(image.digest, self.source)

    def cached(self, image: PreparedImage, salt: str | None) -> bool:
        """Whether ``image``'s embedding is cached under ``salt`` (any thread; not counted)."""
        return self.cache is not None and self.cache.contains(salt, self.key(image))

    def batch(self, wanted: Iterable[tuple[str | None, PreparedImage]]) -> EmbeddingBatch:
        return EmbeddingBatch(self, wanted)

    def check_integrity(self) -> None:
        if self.cache is not None:
            self.cache.check_integrity()

    def stats_fields(self) -> dict[str, int]:
        """The tier's figures under ``EngineStats``'s names (zeros when it is off)."""
        if self.cache is None:
            return {}
        s = self.cache.stats()
        return {
            "embedding_hits": s.hits,
            "embedding_misses": s.misses,
            "embedding_bytes": s.bytes,
            "embedding_budget_bytes": s.budget_bytes,
            "embedding_entries": s.entries,
            "embedding_evictions": s.evictions,
        }


def size_tier(
    pages: int,
    per_page: int,
    budget: int | None,
    *,
    image_pages: int,
    image_bytes: int,
    prefix_cache: bool,
    carve: bool,
) -> tuple[int, int]:
    """``(KV pool pages, embedding budget in bytes)``. ``budget`` None: the default, room for
    the embeddings (``image_bytes`` each) of ``DEFAULT_IMAGES_PER_POOL_IMAGE`` times as many
    images as the pool holds KV for (``image_pages`` each), at most
    ``MAX_DEFAULT_FRACTION`` of the pool's bytes; 0 with the prefix cache off (no caching at
    all). ``carve``: the pool was sized from the device's free memory, so it gives the tier's
    bytes up (the device holds both)."""
    if budget is None:
        pool_images = max(1, (pages - 1) // max(1, image_pages))
        budget = min(DEFAULT_IMAGES_PER_POOL_IMAGE * pool_images * image_bytes,
                     int(pages * per_page * MAX_DEFAULT_FRACTION))  # fmt: skip
        budget = budget if prefix_cache else 0
    if carve and budget:
        pages -= -(-budget // per_page)
        if pages < 2:
            raise ValueError(
                f"an embedding budget of {budget / 2**20:.0f} MiB leaves no room for the KV "
                "pool on this device; pass a smaller embedding_cache_mb"
            )
    return pages, budget


def embedding_tier(
    model: MoondreamModel,
    pages: int,
    kv_dtype: torch.dtype,
    budget: int | None,
    *,
    prefix_cache: bool,
    carve: bool,
) -> tuple[int, ImageEmbeddings]:
    """The runtime's KV pool pages (less the tier's bytes when ``carve``) and its tier."""
    cfg, text = model.config, model.config.text
    per_page = PagedKVCache.bytes_per_page(text.n_layers, text.n_kv_heads, text.head_dim,
                                           kv_dtype)  # fmt: skip
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    pages, budget = size_tier(
        pages, per_page, budget, image_pages=cfg.image_tokens,
        image_bytes=cfg.image_tokens * cfg.vision.proj_out_dim * itemsize,
        prefix_cache=prefix_cache, carve=carve,
    )  # fmt: skip
    return pages, ImageEmbeddings(model, budget)


class EmbeddingBatch:
    """One prefill's embeddings: ``wanted`` (salt, image) pairs looked up once each; the hits
    stay pinned until ``close`` (a context manager)."""

    def __init__(
        self, tier: ImageEmbeddings, wanted: Iterable[tuple[str | None, PreparedImage]]
    ) -> None:
        self._tier = tier
        self._leases: dict[tuple[str | None, bytes], EmbeddingLease] = {}
        self._encoded: dict[tuple[str | None, bytes], torch.Tensor] = {}
        self.to_encode: list[PreparedImage] = []  # the misses, for the crop pool
        missed: set[tuple[str | None, bytes]] = set()
        cache = tier.cache
        try:
            for salt, image in wanted:
                at = (salt, image.digest)
                if at in self._leases or at in missed:
                    continue
                lease = cache.lookup(salt, tier.key(image)) if cache is not None else None
                if lease is None:
                    missed.add(at)
                    self.to_encode.append(image)
                else:
                    self._leases[at] = lease
        except BaseException:
            self.close()
            raise

    def get(
        self,
        salt: str | None,
        image: PreparedImage,
        encode: Callable[[PreparedImage], torch.Tensor],
    ) -> tuple[torch.Tensor, bool]:
        """``image``'s embedding and whether it came from the tier; a miss is encoded (once
        per salt in this batch) and offered to the tier."""
        at = (salt, image.digest)
        lease = self._leases.get(at)
        if lease is not None:
            return lease.tensor, True
        emb = self._encoded.get(at)
        if emb is None:
            emb = encode(image)
            self._encoded[at] = emb
            if self._tier.cache is not None:
                self._tier.cache.insert(salt, self._tier.key(image), emb)
        return emb, False

    def for_sequence(
        self,
        state: SequenceState,
        computed: Sequence[bool],
        encode: Callable[[PreparedImage], torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """The embedding of each of ``state``'s images that its prefill computes (``computed``),
        None for the others; counts the sequence's tier hits and encodes."""
        out: list[torch.Tensor | None] = []
        state.embedding_hits = state.image_encodes = 0  # a retried prefill counts afresh
        for image, new in zip(state.images, computed, strict=True):
            if not new:
                out.append(None)
                continue
            emb, hit = self.get(state.namespace.salt, image, encode)
            state.embedding_hits += hit
            state.image_encodes += not hit
            out.append(emb)
        return out

    def close(self) -> None:
        leases, self._leases = self._leases, {}
        for lease in leases.values():
            lease.release()
        self._encoded.clear()

    def __enter__(self) -> EmbeddingBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
