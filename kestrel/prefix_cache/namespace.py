"""CacheNamespace: which radix tree a prompt lives in.

KV values depend on more than the token sequence: an adapter changes every layer, and in
Moondream 2 the BOS position attends bidirectionally to the image block, so even BOS's KV depends
on the image. Each distinct (adapter, image) pair therefore gets its own tree; nothing is ever
shared across namespaces. A tenant's ``salt`` splits the trees further, so two tenants never share
an entry even for the same image and prompt (cache hits are observable through timing). The
fields are typed (never joined into a string), so an adapter id, an image hash and a salt can
never collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CacheNamespace"]


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """``lora_id``: None for the base model, else ``"name@<sha256 of weights>[:16]"``.
    ``image_hash``: None for text-only prompts, else the image's 128-bit content hash.
    ``salt``: None, or the requester's cache salt (an opaque non-empty string)."""

    lora_id: str | None = None
    image_hash: int | None = None
    salt: str | None = None
    # (lora_id, image_hash, salt): the radix cache keys its trees by this plain tuple, so a
    # lookup hashes and compares in C (every match and insert looks a tree up).
    key: tuple = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return hash(self.key)

    def __post_init__(self) -> None:
        if self.lora_id is not None and (not isinstance(self.lora_id, str) or not self.lora_id):
            raise ValueError(f"lora_id must be None or a non-empty str, got {self.lora_id!r}")
        if self.image_hash is not None and (
            isinstance(self.image_hash, bool)
            or not isinstance(self.image_hash, int)
            or self.image_hash < 0
        ):
            raise ValueError(
                f"image_hash must be None or a non-negative int, got {self.image_hash!r}"
            )
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ValueError(f"salt must be None or a non-empty str, got {self.salt!r}")
        object.__setattr__(self, "key", (self.lora_id, self.image_hash, self.salt))
