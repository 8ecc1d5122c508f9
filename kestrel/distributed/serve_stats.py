"""The front door's ``/v1/stats`` and ``/metrics``: every replica's snapshot and their sum.

:class:`ClusterStats` is an :class:`~kestrel.results.EngineStats` (the sum over the replicas
that answered, so the server app's stats route and engine gauges work unchanged) plus one
:class:`ReplicaStats` per replica. :class:`ReplicaCollector` adds the per-replica Prometheus
series, labelled ``replica``, to the app's registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kestrel.results import EngineStats

from .ring import RouterSnapshot

__all__ = ["ClusterStats", "ReplicaCollector", "ReplicaStats", "cluster_stats"]

# hit_rate is recomputed, vision_encodes summed from the replicas' own counters below
_SUMMED = [f.name for f in fields(EngineStats) if f.name not in ("hit_rate", "vision_encodes")]


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica as the front door sees it: ``live`` (on the ring), requests ``in_flight``
    from this front door and ``routed`` to it since start; ``process`` (``ip:pid``, renewed on
    restart) and the engine figures, None while it does not answer."""

    replica: str
    live: bool
    in_flight: int
    routed: int
    process: str | None
    requests_served: int | None
    requests_failed: int | None
    requests_cancelled: int | None
    hit_rate: float | None
    vision_encodes: int | None
    vision_encodes_skipped: int | None
    queue_depth: int | None
    running: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    pages_total: int | None
    pages_free: int | None
    pages_cached: int | None
    pages_private: int | None
    pages_locked: int | None


@dataclass(frozen=True, slots=True)
class ClusterStats(EngineStats):
    """The sum over the replicas that answered (``hit_rate``: their cached over prompt
    positions), ``vision_encodes`` in all, requests ``diverted`` off the ring's choice by the
    bounded-load rule, and each replica."""

    vision_encodes: int = 0
    diverted: int = 0
    replicas: tuple[ReplicaStats, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FROM_ENGINE = [f.name for f in fields(ReplicaStats)][4:]  # from ``process`` on
_RENAMED = {"process": "name", "cached_tokens": "prefill_tokens_saved"}


def _replica(name: str, snap: RouterSnapshot, s: Mapping[str, Any] | None) -> ReplicaStats:
    engine = {k: None if s is None else s[_RENAMED.get(k, k)] for k in _FROM_ENGINE}
    return ReplicaStats(
        replica=name,
        live=snap.live[name],
        in_flight=snap.in_flight[name],
        routed=snap.routed[name],
        **engine,
    )


def cluster_stats(
    found: Mapping[str, Mapping[str, Any] | None], snap: RouterSnapshot
) -> ClusterStats:
    """Sum the replicas' snapshots (``found[name]``: a replica's ``stats()``, None if down)."""
    answered = [s for s in found.values() if s is not None]
    total = {k: sum(int(s[k]) for s in answered) for k in _SUMMED}
    prompt = sum(int(s["prompt_tokens"]) for s in answered)
    return ClusterStats(
        **total,
        hit_rate=total["prefill_tokens_saved"] / prompt if prompt else 0.0,
        vision_encodes=sum(int(s["vision_encodes"]) for s in answered),
        diverted=snap.diverted,
        replicas=tuple(_replica(name, snap, found[name]) for name in found),
    )


class ReplicaCollector:
    """Prometheus series per replica from the front door's last snapshot (``/metrics`` takes
    one just before rendering): ``kestrel_replica_up``, ``_in_flight_requests``,
    ``_routed_requests``, ``_requests_served``, ``_prefix_hit_rate``, ``_vision_encodes``,
    ``_vision_encodes_skipped``, ``_queue_depth``."""

    def __init__(self, latest: Callable[[], ClusterStats | None]) -> None:
        self._latest = latest

    def describe(self) -> list[Any]:
        return []  # dynamic: nothing to check for name clashes at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._latest()
        if stats is None:
            return
        series = (
            ("up", GaugeMetricFamily, "1 while the replica is on the ring", "live"),
            ("in_flight_requests", GaugeMetricFamily, "requests in flight from this front door",
             "in_flight"),
            ("routed_requests", CounterMetricFamily, "requests routed to the replica", "routed"),
            ("requests_served", CounterMetricFamily, "requests its engine served",
             "requests_served"),
            ("prefix_hit_rate", GaugeMetricFamily, "cached / prompt positions", "hit_rate"),
            ("vision_encodes", CounterMetricFamily, "vision encoder runs", "vision_encodes"),
            ("vision_encodes_skipped", CounterMetricFamily, "vision encoder runs saved by hits",
             "vision_encodes_skipped"),
            ("queue_depth", GaugeMetricFamily, "requests waiting in its engine", "queue_depth"),
        )  # fmt: skip
        for name, kind, doc, attr in series:
            family = kind(f"kestrel_replica_{name}", doc, labels=["replica"])
            for r in stats.replicas:
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([r.replica], float(value))
            yield family
