"""``kestrel serve --ray`` end to end: join or start Ray, start the replicas, watch them, and
give the front door's engine; everything is taken down on exit.

    with serve_cluster(address, ReplicaOptions(...), ServeOptions(replicas=2)) as door:
        app = kestrel.server.create_app(door)      # the app of `kestrel serve`, unchanged
        add_replica_metrics(app, door)             # per-replica series on /metrics
        ...run it...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray

from .frontdoor import ClusterEngine
from .pipeline import ray_session
from .replica import ReplicaOptions
from .serve_cluster import (
    HealthMonitor,
    ServeOptions,
    attach_cluster,
    delete_replicas,
    start_cluster,
)
from .serve_stats import ReplicaCollector

__all__ = [
    "ReplicaOptions",
    "ServeOptions",
    "add_replica_metrics",
    "serve_cluster",
    "startup_line",
]


@contextlib.contextmanager
def serve_cluster(
    address: str | None, replica: ReplicaOptions, options: ServeOptions | None = None
) -> Iterator[ClusterEngine]:
    """The front door's engine over freshly started replicas (or, with ``options.attach``,
    over those another front door started), probed by a health monitor. On exit the replicas
    this call started are deleted (and a Ray instance started here is stopped)."""
    options = options or ServeOptions()
    with ray_session(address):
        door = attach_cluster(options) if options.attach else start_cluster(replica, options)
        try:
            with HealthMonitor(door, period_s=options.health_period_s):
                yield door
        finally:
            door.close()
            if not options.attach:
                delete_replicas(list(door.links))


def add_replica_metrics(app: Any, door: ClusterEngine) -> None:
    """Register the per-replica Prometheus series on the app's own registry."""
    app.state.kestrel.metrics.registry.register(ReplicaCollector(lambda: door.last_stats))


def startup_line(door: ClusterEngine, url: str) -> str:
    replicas = ", ".join(
        f"{name} ({link.info.get('name', '?')})" for name, link in door.links.items()
    )
    adapters = ", ".join(door.adapters()) or "none"
    return (
        f"kestrel serve --ray: {door.model_path} ({door.config.family}) on {url} "
        f"(Ray at {ray.get_runtime_context().gcs_address}; adapters: {adapters}; routing: "
        f"{door.router.routing}; {len(door.links)} replicas: {replicas})"
    )
