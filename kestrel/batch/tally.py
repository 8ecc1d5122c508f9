"""Counting a batch job from the lines it writes: one :class:`Counts` per job (or per Ray
replica, merged by the driver), and the summary rows every batch summary prints.

A line with ``metrics`` is an answer, one without is an error. A line with an image and
``cached_tokens == 0`` ran the vision encoder; one with ``cached_tokens > 0`` reused the
image's cached KV (a vision encode skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Counts", "summary_rows", "two_columns"]


@dataclass(slots=True)
class Counts:
    """Requests, errors and token counts of the lines added so far; mergeable."""

    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    vision_encodes: int = 0
    vision_encodes_skipped: int = 0

    def add(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Count one output line; returns its metrics (None for an error line)."""
        self.requests += 1
        metrics = record.get("metrics")
        if metrics is None:
            self.errors += 1
            return None
        self.input_tokens += metrics["input_tokens"]
        self.cached_tokens += metrics["cached_tokens"]
        self.output_tokens += metrics["output_tokens"]
        if record.get("image") is not None:
            hit = metrics["cached_tokens"] > 0
            self.vision_encodes_skipped += hit
            self.vision_encodes += not hit
        return metrics

    def merge(self, other: Counts) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def hit_rate(self) -> float:
        """Token-weighted: cached / input positions of the answered lines."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


def summary_rows(s: Any) -> list[tuple[str, str]]:
    """The rows every batch summary shares (``BatchSummary`` and the Ray job's summary)."""
    p50, p99 = ("-" if v is None else f"{v:.1f}" for v in (s.ttft_p50_ms, s.ttft_p99_ms))
    hits = f"{s.hit_rate:.1%} ({s.cached_tokens:,} of {s.input_tokens:,} input tokens cached)"
    return [
        ("requests", f"{s.requests} (+{s.skipped} already done, skipped)"),
        ("errors", str(s.errors)),
        ("wall time", f"{s.wall_s:.2f} s"),
        ("requests/s", f"{s.requests_per_s:.2f}"),
        ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
        ("TTFT p50 / p99", f"{p50} / {p99} ms"),
        ("prefix hit rate", hits),
    ]


def two_columns(rows: list[tuple[str, str]]) -> str:
    """A small two-column table for a terminal."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
