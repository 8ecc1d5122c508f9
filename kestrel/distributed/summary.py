"""The closing summary of a Ray batch job, counted from the rows it wrote.

Each write task tallies the rows it writes (per replica; TTFTs as a histogram, so a tally has
a fixed size however many rows it covers) and returns its :class:`Tally`; the driver merges
them. Counting the written rows, not the engines, is what survives a replica
that dies mid-job: the rows of its lost batch are counted once, where they were finally
answered. A row with an image and ``cached_tokens == 0`` ran the vision encoder; one with
``cached_tokens > 0`` reused the image's cached KV (a vision encode skipped).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from kestrel.batch.tally import Counts, RunFigures, run_figures, summary_rows, two_columns

__all__ = ["RaySummary", "ReplicaSummary", "Tally", "format_ray_summary"]


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """The rows one replica (one Engine, ``<node ip>:<pid>``) answered or failed."""

    replica: str
    requests: int
    errors: int
    input_tokens: int
    cached_tokens: int
    hit_rate: float  # token-weighted: cached / input positions of its answered rows
    vision_encodes: int
    vision_encodes_skipped: int


@dataclass(frozen=True, slots=True)
class RaySummary(RunFigures):
    """What one Ray batch job did (its own rows only; ``skipped`` were already in the output):
    the shared :class:`RunFigures`, token-weighted over every replica's answered rows, then
    the vision encodes and each replica's share."""

    vision_encodes: int
    vision_encodes_skipped: int
    routing: str
    replicas: tuple[ReplicaSummary, ...]


@dataclass(slots=True)
class Tally:
    """Counts per replica and a TTFT histogram; mergeable across write tasks, and of a fixed
    size whatever the number of rows (the driver merges one per write task)."""

    replicas: dict[str, Counts] = field(default_factory=dict)
    ttft: Counter[int] = field(default_factory=Counter)  # log-spaced bin -> answered rows

    def add(self, record: dict[str, Any]) -> None:
        metrics = self.replicas.setdefault(record.get("replica") or "?", Counts()).add(record)
        if metrics is not None:
            self.ttft[_ttft_bin(metrics["ttft_ms"])] += 1

    def merge(self, other: Tally) -> None:
        for name, counts in other.replicas.items():
            self.replicas.setdefault(name, Counts()).merge(counts)
        self.ttft.update(other.ttft)

    def summary(self, *, skipped: int, wall_s: float, routing: str) -> RaySummary:
        total = Counts()
        for counts in self.replicas.values():
            total.merge(counts)
        ttft = (_percentile(self.ttft, 0.50), _percentile(self.ttft, 0.99))
        return RaySummary(
            **run_figures(total, skipped=skipped, wall_s=wall_s, ttft_ms=ttft),
            vision_encodes=total.vision_encodes,
            vision_encodes_skipped=total.vision_encodes_skipped,
            routing=routing,
            replicas=tuple(_replica(name, c) for name, c in sorted(self.replicas.items())),
        )


# TTFT percentiles from log-spaced bins 0.6% wide (1 us .. 10^7 ms): the reported value is
# the bin's middle, within 0.6% of the exact percentile.
_BINS_PER_DECADE = 200
_TTFT_FLOOR_MS = 1e-3
_TTFT_BINS = 10 * _BINS_PER_DECADE


def _ttft_bin(ms: float) -> int:
    decades = math.log10(max(ms, _TTFT_FLOOR_MS) / _TTFT_FLOOR_MS)
    return min(int(decades * _BINS_PER_DECADE), _TTFT_BINS - 1)


def _percentile(hist: Counter[int], q: float) -> float | None:
    total = sum(hist.values())
    if not total:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return _TTFT_FLOOR_MS * 10 ** ((b + 0.5) / _BINS_PER_DECADE)
    raise AssertionError("unreachable")


def _replica(name: str, c: Counts) -> ReplicaSummary:
    """A replica's row: its name, then the counts of the same names (hit rate included)."""
    names = [f.name for f in fields(ReplicaSummary)][1:]
    return ReplicaSummary(name, *(getattr(c, n) for n in names))


def format_ray_summary(summary: RaySummary) -> str:
    """The two-column table of ``kestrel batch``, with a line per replica."""
    s = summary
    rows = [
        *summary_rows(s),
        ("vision encodes", str(s.vision_encodes)),
        ("vision encodes skipped", str(s.vision_encodes_skipped)),
        ("routing", f"{s.routing}, {len(s.replicas)} replicas served"),
    ]
    rows += [
        (
            f"replica {r.replica}",
            f"{r.requests} requests, hit rate {r.hit_rate:.1%}, "
            f"{r.vision_encodes_skipped} vision encodes skipped",
        )
        for r in s.replicas
    ]
    return two_columns(rows)
