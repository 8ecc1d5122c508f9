"""Prometheus metrics of one app, on its own registry (two apps in a process never collide).

Per request: counts and latencies by route and status, time to first token, tokens (input,
cached, output), the cache tier that served it. Per scrape: the engine's snapshot (queue
depth, running requests, hit rate, KV pages by state, served / failed / cancelled, the
embedding and host KV tiers' hits, misses and bytes) and the server's requests in flight, read
once by the ``/metrics`` handler and emitted by a custom collector.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kestrel.results import EngineStats, RequestMetrics

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_PAGE_STATES = ("total", "free", "cached", "private", "locked", "evictable")


class _EngineCollector(Collector):
    """Emits the last engine snapshot handed to :meth:`ServerMetrics.render`."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.in_flight = 0
        self.max_queue = 0
        self.decodes_skipped = 0  # the app's own (it prepares the images it is sent)

    def describe(self) -> list[Metric]:
        return []  # dynamic: nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kestrel_in_flight_requests",
            "requests admitted by the server (decoding, queued or running)",
            value=self.in_flight,
        )
        yield GaugeMetricFamily(
            "kestrel_max_in_flight_requests", "the server's --max-queue", value=self.max_queue
        )
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily(
            "kestrel_queue_depth", "requests waiting for admission", value=s.queue_depth
        )
        yield GaugeMetricFamily("kestrel_running_requests", "sequences running", value=s.running)
        yield GaugeMetricFamily(
            "kestrel_prefix_hit_rate", "cached / input prompt positions", value=s.hit_rate
        )
        pages = GaugeMetricFamily("kestrel_kv_pages", "KV pages by state", labels=["state"])
        for state in _PAGE_STATES:
            pages.add_metric([state], getattr(s, f"pages_{state}"))
        yield pages
        outcomes = CounterMetricFamily(
            "kestrel_engine_requests", "requests finished by the engine", labels=["outcome"]
        )
        outcomes.add_metric(["served"], s.requests_served)
        outcomes.add_metric(["failed"], s.requests_failed)
        outcomes.add_metric(["cancelled"], s.requests_cancelled)
        yield outcomes
        for name, doc, total in (
            ("prefill_tokens_saved", "prompt positions served from the prefix cache",
             s.prefill_tokens_saved),
            ("vision_encodes_skipped", "vision encoder runs saved by cache hits",
             s.vision_encodes_skipped),
            ("kv_evictions", "KV pages evicted from the prefix cache", s.evictions),
            ("vision_encodes", "vision encoder runs (one per image encoded)", s.vision_encodes),
            ("image_decodes_skipped", "images sent again, prepared without a decode",
             self.decodes_skipped + s.image_decodes_skipped),
        ):  # fmt: skip
            yield CounterMetricFamily(f"kestrel_{name}", doc, value=total)
        yield from _tier_metrics(s)
        yield from _image_memory_metrics(s)


def _labelled(family: type, name: str, doc: str, label: str, values: dict[str, int]) -> Metric:
    """One metric family of ``values`` by their ``label``."""
    metric = family(name, doc, labels=[label])
    for key, value in values.items():
        metric.add_metric([key], value)
    return metric


def _image_memory_metrics(s: EngineStats) -> Iterator[Metric]:
    """Decoded image bytes under their budget (docs/images.md), and the decodes it held up."""
    yield _labelled(GaugeMetricFamily, "kestrel_image_memory_bytes",
                    "decoded image bytes held by requests in flight", "kind",
                    {"used": s.image_memory_bytes, "peak": s.image_memory_peak_bytes,
                     "budget": s.image_memory_budget_bytes})  # fmt: skip
    yield _labelled(CounterMetricFamily, "kestrel_image_decodes_delayed",
                    "decodes that found the image memory budget full", "outcome",
                    {"waited": s.image_decodes_waited,
                     "refused": s.image_decodes_refused})  # fmt: skip


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """The cache tiers past the device KV: image embeddings, host KV (zeros when off)."""
    lookups = CounterMetricFamily(
        "kestrel_embedding_cache_lookups", "image-embedding tier lookups", labels=["result"]
    )
    lookups.add_metric(["hit"], s.embedding_hits)
    lookups.add_metric(["miss"], s.embedding_misses)
    yield lookups
    yield CounterMetricFamily(
        "kestrel_embedding_cache_evictions", "embeddings evicted", value=s.embedding_evictions
    )
    tier_bytes = GaugeMetricFamily(
        "kestrel_cache_tier_bytes", "bytes held by a cache tier, and its budget",
        labels=["tier", "kind"],
    )  # fmt: skip
    tier_bytes.add_metric(["embedding", "used"], s.embedding_bytes)
    tier_bytes.add_metric(["embedding", "budget"], s.embedding_budget_bytes)
    tier_bytes.add_metric(["host_kv", "used"], s.host_kv_bytes)
    tier_bytes.add_metric(["host_kv", "budget"], s.host_kv_budget_bytes)
    yield tier_bytes
    yield GaugeMetricFamily(
        "kestrel_embedding_cache_entries", "images in the embedding tier",
        value=s.embedding_entries,
    )  # fmt: skip
    yield CounterMetricFamily(
        "kestrel_host_kv_hits", "evicted nodes whose KV was copied back from host memory",
        value=s.host_kv_hits,
    )  # fmt: skip


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kestrel_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "kestrel_http_request_duration_seconds", "request latency (streams: to the last event)",
            ["route", "status"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tiers = Counter(
            "kestrel_requests_by_cache_tier", "requests by the cache tier that served them",
            ["route", "tier"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kestrel_ttft_seconds", "submit -> first generated token, by route", ["route"],
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "kestrel_tokens",
            "prompt positions (input, cached), generated tokens (output, reasoning)",
            ["route", "kind"], registry=r,
        )  # fmt: skip
        self._engine = _EngineCollector()
        r.register(self._engine)

    def observe(
        self, route: str, status: int, seconds: float, metrics: RequestMetrics | None
    ) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route, str(status)).observe(seconds)
        if metrics is None:
            return
        self.ttft.labels(route).observe(metrics.ttft_ms / 1000.0)
        self.tiers.labels(route, metrics.cache_tier).inc()
        self.tokens.labels(route, "input").inc(metrics.input_tokens)
        self.tokens.labels(route, "cached").inc(metrics.cached_tokens)
        self.tokens.labels(route, "output").inc(metrics.output_tokens)
        self.tokens.labels(route, "reasoning").inc(metrics.reasoning_tokens)

    def render(
        self, stats: EngineStats | None, in_flight: int, max_queue: int, decodes_skipped: int = 0
    ) -> bytes:
        """The exposition text, with this engine snapshot and server state (``decodes_skipped``:
        the images the app was sent again and prepared without a decode)."""
        self._engine.stats = stats
        self._engine.in_flight = in_flight
        self._engine.max_queue = max_queue
        self._engine.decodes_skipped = decodes_skipped
        return generate_latest(self.registry)
