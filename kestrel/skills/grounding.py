"""Reasoning-mode grounding: split the reasoning tokens into text chunks with their points."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kestrel.moondream.config import TokenizerConfig

__all__ = ["GroundingChunk", "grounding_chunks"]


@dataclass(frozen=True, slots=True)
class GroundingChunk:
    start_idx: int  # char offsets of the chunk in the reasoning text
    end_idx: int
    points: tuple[tuple[float, float], ...]


def grounding_chunks(
    ids: Sequence[int],
    coords: dict[int, float],
    tok: TokenizerConfig,
    decode: Callable[[list[int]], str],
) -> tuple[str, tuple[GroundingChunk, ...]]:
    """Split reasoning at start_ground_points / end_ground markers into text chunks.

    ``coords`` maps the index of each coord token in ``ids`` to its decoded value; the
    coordinates inside one chunk pair up as (x, y) points. Returns the reasoning text and one
    GroundingChunk (character span in that text, points) per chunk that holds a point.
    """
    chunks: list[tuple[list[int], list[float]]] = [([], [])]
    for i, t in enumerate(ids):
        if t in (tok.start_ground_points_id, tok.end_ground_id):
            chunks.append(([], []))
        elif i in coords:
            chunks[-1][1].append(coords[i])
        else:
            chunks[-1][0].append(t)
    text, out = "", []
    for chunk_ids, values in chunks:
        piece = decode(chunk_ids) if chunk_ids else ""
        if len(values) >= 2:
            pts = tuple((values[j], values[j + 1]) for j in range(0, len(values) - 1, 2))
            out.append(GroundingChunk(len(text), len(text) + len(piece), pts))
        text += piece
    return text, tuple(out)
