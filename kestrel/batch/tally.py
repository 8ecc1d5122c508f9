"""Counting a batch job from the lines it writes: one :class:`Counts` per job (or per Ray
replica, merged by the driver), and the summary rows every batch summary prints.

A line with ``metrics`` is an answer, one without is an error. A line with an image and
``cached_tokens == 0`` ran the vision encoder; one with ``cached_tokens > 0`` reused the
image's cached KV (a vision encode skipped).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Counts", "RunFigures", "run_figures", "summary_rows", "two_columns"]


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


@dataclass(frozen=True, slots=True)
class RunFigures:
    """The figures every batch summary opens with (``BatchSummary``, the Ray job's summary).
    Token counts and TTFT cover the run's answered requests; ``hit_rate`` is token-weighted
    (cached / input positions)."""

    requests: int  # run by this call: answers + errors
    skipped: int  # already in the output file
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    hit_rate: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_figures(
    c: Counts, *, skipped: int, wall_s: float, ttft_ms: tuple[float | None, float | None]
) -> dict[str, Any]:
    """The :class:`RunFigures` fields of a run counted in ``c`` (``ttft_ms``: p50, p99)."""
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    return {
        "requests": c.requests,
        "skipped": skipped,
        "errors": c.errors,
        "wall_s": wall_s,
        "requests_per_s": c.requests * per_s,
        "output_tokens_per_s": c.output_tokens * per_s,
        "ttft_p50_ms": ttft_ms[0],
        "ttft_p99_ms": ttft_ms[1],
        "input_tokens": c.input_tokens,
        "cached_tokens": c.cached_tokens,
        "output_tokens": c.output_tokens,
        "hit_rate": c.hit_rate,
    }


def summary_rows(s: RunFigures) -> list[tuple[str, str]]:
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
