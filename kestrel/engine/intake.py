"""The Engine's image intake: how far an encoded image is decoded (``CropFit``: only as far
as its crops use it) and the decoded bytes it may hold at once (``DecodeBudget``)."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.crops.overlap import crop_geometry
from kestrel.errors import InvalidInputError
from kestrel.images.budget import DecodeBudget
from kestrel.images.known import KnownImages
from kestrel.moondream.config import VisionConfig

__all__ = ["CropFit", "budget_bytes", "intake"]

_MB = 1 << 20


@dataclass(frozen=True, slots=True)
class CropFit:
    """An upright ``height`` x ``width`` image -> the (height, width) its local crops are cut
    from (``images/shrink.py``'s ``Fit``): nothing of the image beyond that size reaches the
    model. A value, so a deferred image's decoder pickles with it."""

    vision: VisionConfig

    def __call__(self, height: int, width: int) -> tuple[int, int]:
        return crop_geometry(height, width, self.vision).resized


def budget_bytes(image_memory_mb: float | None) -> int | None:
    """``image_memory_mb`` in bytes (None stays None: sized from the machine), checked."""
    if image_memory_mb is None:
        return None
    if isinstance(image_memory_mb, bool) or not (
        isinstance(image_memory_mb, (int, float)) and image_memory_mb > 0
    ):
        raise InvalidInputError(f"image_memory_mb must be positive, got {image_memory_mb!r}")
    return max(1, int(image_memory_mb * _MB))


def intake(
    vision: VisionConfig, exif_orientation: bool, limit: int | None
) -> tuple[CropFit, DecodeBudget, KnownImages]:
    """The fit, the budget (``limit`` bytes; None: sized from the machine) and the known
    images an Engine prepares its callers' images with."""
    fit = CropFit(vision)
    budget = DecodeBudget(limit)
    known = KnownImages(exif_orientation=exif_orientation, fit=fit, budget=budget)
    return fit, budget, known
