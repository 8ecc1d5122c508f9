"""Kestrel on a Ray cluster (optional extra ``kestrel[ray]``): everything Ray lives here.

``kestrel batch --ray`` (``pipeline``, ``replica``, ``rows``, ``sink``, ``summary``): a Ray Data
job over the inputs of ``kestrel batch``: rows keyed by the image's content hash on the reading
side, shuffled so that every question about an image reaches the one replica (one
:class:`~kestrel.Engine` per actor) whose prefix cache holds that image, answered in batches,
and written as ``kestrel batch``'s lines.

``kestrel serve --ray`` (``serving``, ``frontdoor``, ``ring``, ``serve_cluster``,
``serve_replica``, ``serve_stats``): the app of ``kestrel serve`` over a ServedEngine front
that routes each request by its image's digest, on a consistent-hash ring, to one of N replica
deployments on Ray Serve (one Engine each).

``import kestrel`` never imports this package; this package needs Ray (see
docs/distributed.md).
"""

from __future__ import annotations

try:
    import ray.data  # noqa: F401
except ImportError as exc:
    raise ImportError('kestrel.distributed needs Ray Data: pip install "kestrel[ray]"') from exc

from .pipeline import ROUTINGS, RayBatchOptions, ReplicaStartError, ray_session, run_ray_batch
from .replica import CrashOnce, Replica, ReplicaOptions
from .summary import RaySummary, ReplicaSummary, format_ray_summary

__all__ = [
    "ROUTINGS",
    "CrashOnce",
    "RayBatchOptions",
    "RaySummary",
    "Replica",
    "ReplicaOptions",
    "ReplicaStartError",
    "ReplicaSummary",
    "format_ray_summary",
    "ray_session",
    "run_ray_batch",
]
