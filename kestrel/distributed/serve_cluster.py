"""Starting the replicas of ``kestrel serve --ray`` on Ray Serve, and watching them.

Each replica is its own Serve application holding one deployment with one replica (one
:class:`~kestrel.distributed.serve_replica.EngineReplica`, one Engine): the name of the
application (``kestrel-replica-<i>``) is a stable identity for the ring, whichever process
serves it, and its handle reaches exactly that engine. Serve restarts a replica whose process
dies (its health check fails) and sends it nothing until its constructor, the model load, has
finished. No Serve HTTP proxy is started: the front door is Kestrel's own server.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray

from kestrel.errors import InvalidInputError

from .frontdoor import ClusterEngine, ReplicaLink
from .pipeline import ReplicaStartError
from .replica import ReplicaOptions
from .ring import Router
from .serve_replica import EngineReplica

__all__ = [
    "APP_PREFIX",
    "HealthMonitor",
    "ServeOptions",
    "attach_cluster",
    "delete_replicas",
    "placement",
    "start_cluster",
]

log = logging.getLogger("kestrel.distributed")
APP_PREFIX = "kestrel-replica"
_LAST_ERROR = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")
DEFAULT_CPU_REPLICAS = 2


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """``replicas``: how many (None: one per GPU of the cluster, else 2); ``routing``:
    ``image`` or ``random``; ``slack``: the bounded-load threshold in requests (None: one
    replica's ``max_batch_size``); ``cpus_per_replica``: Ray CPUs each CPU replica takes, and
    its torch threads (None: an equal share of the cluster's CPUs, at least 1);
    ``max_ongoing_requests``: what Serve lets one replica hold at once; ``health_period_s``:
    Serve's health check and the front door's probe period; ``app_prefix``: the replicas'
    Serve applications are ``<app_prefix>-<i>`` (the ring's names); ``attach``: use the
    replicas of that name already running (another front door's) instead of starting any."""

    replicas: int | None = None
    routing: str = "image"
    slack: int | None = None
    cpus_per_replica: float | None = None
    max_ongoing_requests: int = 256
    health_period_s: float = 1.0
    shutdown_timeout_s: float = 30.0
    app_prefix: str = APP_PREFIX
    attach: bool = False


def placement(
    replica: ReplicaOptions, options: ServeOptions
) -> tuple[int, ReplicaOptions, dict[str, float]]:
    """The replica count, each replica's options and its Ray resources: one GPU each when the
    cluster has GPUs (and the device is not "cpu"), else ``cpus_per_replica`` CPUs each."""
    res = ray.cluster_resources()
    cpus, gpus = float(res.get("CPU", 0)), int(res.get("GPU", 0))
    device = str(replica.engine.device)
    if gpus and device != "cpu":
        n = options.replicas or gpus
        if n > gpus:
            raise InvalidInputError(f"{n} replicas need {n} GPUs; the Ray cluster has {gpus}")
        engine = replace(replica.engine, device="cuda")  # the GPU Ray gives the actor
        return n, replace(replica, engine=engine), {"num_gpus": 1, "num_cpus": 1}
    n = options.replicas or DEFAULT_CPU_REPLICAS
    share = options.cpus_per_replica or max(1.0, float(int(cpus // n)))
    if share * n > cpus:
        raise InvalidInputError(
            f"{n} replicas of {share:g} CPUs need {share * n:g}; the Ray cluster has {cpus:g}"
        )
    threads = replica.threads or max(1, int(share))
    return n, replace(replica, threads=threads), {"num_cpus": share}


def start_cluster(replica: ReplicaOptions, options: ServeOptions) -> ClusterEngine:
    """Deploy the replicas on the connected Ray cluster, wait until every one has loaded its
    model, and give the front door's engine over them (routing as ``options`` says)."""
    from ray import serve

    n, replica, resources = placement(replica, options)
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        name="EngineReplica",
        num_replicas=1,
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options=resources,
        health_check_period_s=options.health_period_s,
        health_check_timeout_s=max(10.0, 10 * options.health_period_s),
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    )(EngineReplica)
    names = [f"{options.app_prefix}-{i}" for i in range(n)]
    taken = sorted(set(names) & set(serve.status().applications))
    if taken:
        raise InvalidInputError(
            f"Serve applications {', '.join(taken)} already run on this Ray cluster (another "
            "kestrel serve --ray?); stop them, or name these replicas otherwise (--ray-app)"
        )
    targets = [
        serve.RunTarget(deployment.bind(replica), name=name, route_prefix=None) for name in names
    ]
    try:
        handles = serve.run_many(targets)
        pairs = zip(names, handles, strict=True)
        links = [ReplicaLink(name, h, h.describe.remote().result()) for name, h in pairs]
    except RuntimeError as exc:  # Serve gave up: the constructor (model load) kept failing
        why = _start_failure(names)
        delete_replicas(names)
        raise ReplicaStartError(f"the replicas did not start: {why or exc}") from exc
    except BaseException:
        delete_replicas(names)
        raise
    return _door(links, options)


def attach_cluster(options: ServeOptions) -> ClusterEngine:
    """The front door's engine over replicas another front door started on this cluster
    (``<app_prefix>-0``, ``-1``, ...): the same names, so the same ring and the same routing."""
    from ray import serve

    pattern = re.compile(re.escape(options.app_prefix) + r"-(\d+)")
    running = [(m, name) for name in serve.status().applications
               if (m := pattern.fullmatch(name))]  # fmt: skip
    names = [name for _, name in sorted(running, key=lambda found: int(found[0][1]))]
    if not names:
        raise InvalidInputError(
            f"no Serve applications {options.app_prefix}-0, -1, ... run on this Ray cluster: "
            "start them with kestrel serve --ray (and --ray-address to reach it)"
        )
    handles = [serve.get_app_handle(name) for name in names]
    links = [
        ReplicaLink(n, h, h.describe.remote().result()) for n, h in zip(names, handles, strict=True)
    ]
    return _door(links, options)


def _door(links: list[ReplicaLink], options: ServeOptions) -> ClusterEngine:
    batch = int(links[0].info.get("max_batch_size", 16))
    slack = options.slack if options.slack is not None else batch
    router = Router([link.name for link in links], routing=options.routing, slack=slack)
    return ClusterEngine(links, router)


def _start_failure(names: Sequence[str]) -> str | None:
    """The last error line of a failed replica's constructor, from Serve's status."""
    from ray import serve

    apps = serve.status().applications
    for name in names:
        app = apps.get(name)
        for dep in app.deployments.values() if app is not None else ():
            found = [m for m in map(_LAST_ERROR.match, dep.message.splitlines()) if m]
            if found:
                return f"{found[-1][1]}: {found[-1][2]}"
    return None


def delete_replicas(names: Sequence[str]) -> None:
    """Delete the replicas' applications (their engines close; Serve itself stays up)."""
    from ray import serve

    for name in names:
        try:
            serve.delete(name, _blocking=False)
        except Exception as exc:  # the cluster is going away anyway
            log.warning("could not delete %s: %s", name, exc)


class HealthMonitor:
    """A daemon thread that probes every replica each ``period_s`` (``describe()``, answered
    between engine steps): one that fails or does not answer within ``timeout_s`` leaves the
    ring; one that answers again (Serve restarted it and its model is loaded) comes back, with
    its new process recorded."""

    def __init__(self, door: ClusterEngine, period_s: float = 1.0, timeout_s: float = 10.0):
        self.door = door
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kestrel-health", daemon=True)

    def __enter__(self) -> HealthMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + self.period_s)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.probe_once()

    def probe_once(self) -> None:
        """Probe every replica at once and update the ring."""
        door = self.door
        pending = {name: link.handle.describe.remote() for name, link in door.links.items()}
        deadline = time.monotonic() + self.timeout_s
        for name, response in pending.items():
            info = _answer(response, max(0.01, deadline - time.monotonic()))
            if info is None:
                if door.router.set_live(name, False):
                    log.warning("replica %s does not answer; off the ring", name)
                continue
            door.links[name].info = info
            if door.router.set_live(name, True):
                log.warning("replica %s is back (%s); its keys return", name, info["name"])


def _answer(response: Any, timeout_s: float) -> dict[str, Any] | None:
    try:
        return response.result(timeout_s=timeout_s)
    except Exception:
        response.cancel()  # a probe queued for a restarting replica must not pile up
        return None
