"""The Ray Data job behind ``kestrel batch --ray``: read, key, route, answer, write.

    items (one per image) --map: decode + hash once--> rows keyed by image digest
      --route: repartition(P, keys=["key"])  (image)  |  random_shuffle().repartition(P)  (random)
      --materialize: the routed rows (small), so every replica starts on a block of its own
      --map_batches(Replica, ActorPoolStrategy(size=N)): one Engine per replica, a block per call
      --write_datasink(OutputSink): kestrel batch's lines (+ "replica") into the --out folder

Image routing is Ray Data's hash shuffle: every row whose key hashes to partition p lands in
block p, and a block is one call on one replica, so all the questions about an image meet on
the replica holding its cached KV. See docs/distributed.md for the costs and the failure story.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import ray.data

from kestrel.batch.requests import BatchRequest
from kestrel.errors import InvalidInputError, KestrelError, UnknownAdapterError
from kestrel.grammar import parse_response_format
from kestrel.skills import parse_settings

from .replica import Replica, ReplicaOptions
from .rows import image_items, keyed_requests
from .sink import OutputSink, completed_in, output_format
from .summary import RaySummary, Tally

__all__ = ["ROUTINGS", "RayBatchOptions", "ReplicaStartError", "ray_session", "run_ray_batch"]

ROUTINGS = ("image", "random")
_SPARE_CPUS = 1.0  # kept free of replicas for the reading, shuffling and writing tasks
# Reading blocks: each one's map task writes a shard per routed block, so the shuffle moves
# reading x routed objects; beyond a few hundred reading blocks that count, not the CPUs, binds.
_MAX_READ_BLOCKS = 512
_REPLICA_START_S = 900  # how long the replica pool may take to start (resources, model load)


@dataclass(frozen=True, slots=True)
class RayBatchOptions:
    """``replicas``: the actor pool size (None: one per GPU, or one per 4 spare CPUs);
    ``routing``: ``"image"`` (by content hash) or ``"random"`` (Ray's unkeyed shuffle);
    ``blocks_per_replica``: routed blocks per replica (the unit of work and of retry)."""

    replicas: int | None = None
    routing: str = "image"
    blocks_per_replica: int = 4
    progress: bool = True
    seed: int = 0  # random routing's shuffle


@contextlib.contextmanager
def ray_session(address: str | None = None) -> Iterator[None]:
    """Join ``address`` (default ``$RAY_ADDRESS``) or start a local Ray instance sized to this
    machine, quietly; shut down what was started on exit. A driver already connected to Ray
    (``ray.init`` done by the caller) is used as it is."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:  # at least 2 logical CPUs: a replica and the reading / writing tasks
        ray.init(
            num_cpus=max(2, os.cpu_count() or 1),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    try:
        yield
    finally:
        ray.shutdown()


def run_ray_batch(
    requests: Sequence[BatchRequest],
    out: str | Path,
    replica: ReplicaOptions,
    options: RayBatchOptions | None = None,
) -> RaySummary:
    """Answer every request whose id is not yet in the ``out`` folder on a pool of replicas of
    the connected Ray cluster (see :func:`ray_session`); returns the job's summary. Bad options
    (settings, adapters, routing, resources) fail here, before anything runs or is written."""
    options = options or RayBatchOptions()
    _check(requests, replica, options)
    n, replica, resources = _placement(replica, options.replicas)
    done = completed_in(out)
    todo = [r for r in requests if r.id not in done]
    skipped = len(requests) - len(todo)
    if not todo:
        return Tally().summary(skipped=skipped, wall_s=0.0, routing=options.routing)
    sink = OutputSink(str(Path(out).expanduser().resolve()), output_format(out))
    start = time.perf_counter()
    with _job_context(options.progress), _unwrapped_errors():
        _dataset(todo, replica, n, options, resources).write_datasink(sink)
    wall_s = time.perf_counter() - start
    return (sink.tally or Tally()).summary(skipped=skipped, wall_s=wall_s, routing=options.routing)


def _check(
    requests: Sequence[BatchRequest], replica: ReplicaOptions, options: RayBatchOptions
) -> None:
    if options.routing not in ROUTINGS:
        raise InvalidInputError(f"routing must be one of {', '.join(ROUTINGS)}")
    for name in ("replicas", "blocks_per_replica"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise InvalidInputError(f"{name} must be >= 1, got {value}")
    if len({r.id for r in requests}) != len(requests):
        raise InvalidInputError("request ids must be unique")
    parse_settings(replica.settings)
    parse_response_format(replica.response_format)  # its shape; each replica compiles it
    loaded = {name for name, _ in replica.adapters}
    named = {replica.adapter, *(r.adapter for r in requests)} - {None}
    for name in sorted(named - loaded):
        raise UnknownAdapterError(f"no adapter named {name!r} is loaded")


def _placement(
    replica: ReplicaOptions, wanted: int | None
) -> tuple[int, ReplicaOptions, dict[str, float]]:
    """The pool size, the replica options and the Ray resources of each replica: one GPU each
    when the cluster has GPUs (and the device is not "cpu"), else an equal share of the CPUs
    that leaves one for the other tasks (a pool holding every CPU would starve them)."""
    res = ray.cluster_resources()
    cpus, gpus = float(res.get("CPU", 0)), int(res.get("GPU", 0))
    spare = cpus - _SPARE_CPUS
    device = str(replica.engine.device)
    if spare <= 0:
        raise InvalidInputError(f"the Ray cluster has {cpus:g} CPUs; --ray needs at least 2")
    if gpus and device != "cpu":
        n = wanted or gpus
        if n > gpus:
            raise InvalidInputError(f"{n} replicas need {n} GPUs; the Ray cluster has {gpus}")
        engine = replace(replica.engine, device="cuda")  # the GPU Ray gives the actor
        return n, replace(replica, engine=engine), {
            "num_gpus": 1, "num_cpus": min(1.0, spare / n)
        }  # fmt: skip
    n = wanted or max(1, int(spare) // 4)
    share = spare / n
    threads = replica.threads or max(1, int(share))
    return n, replace(replica, threads=threads), {"num_cpus": share}


def _dataset(
    todo: list[BatchRequest],
    replica: ReplicaOptions,
    n: int,
    options: RayBatchOptions,
    resources: dict[str, float],
) -> ray.data.Dataset:
    items = image_items(todo)
    cpus = int(ray.cluster_resources().get("CPU", 2))
    reading = min(len(items), max(2, 2 * cpus), _MAX_READ_BLOCKS)
    ds = ray.data.from_items(items, override_num_blocks=reading)
    # The reading side: each image decoded and hashed once; one row per request with its key.
    ds = ds.map_batches(keyed_requests, batch_size=None, batch_format="pyarrow")
    blocks = max(n, min(n * options.blocks_per_replica, len(todo)))
    if options.routing == "image":
        ds = ds.repartition(blocks, keys=["key"])  # hash shuffle: a key's rows in one block
    else:
        ds = ds.random_shuffle(seed=options.seed).repartition(blocks)
    # The routed rows are small (ids, paths, questions) and the shuffle is a barrier anyway:
    # holding them all lets every replica start on a block of its own at once.
    ds = ds.materialize()
    return ds.map_batches(
        Replica,
        fn_constructor_kwargs={"options": replica},
        batch_size=None,  # a whole block per call: an image's rows arrive together
        batch_format="pyarrow",
        # One block at a time per replica: the next block goes to whichever replica is free.
        compute=ray.data.ActorPoolStrategy(size=n, max_tasks_in_flight_per_actor=1),
        **resources,
    )


@contextlib.contextmanager
def _job_context(progress: bool) -> Iterator[None]:
    """For the job: Ray Data's progress bars on or off, its INFO chatter off, and the replica
    pool started in full before the first block is handed out (an even split of the work)."""
    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    saved = ctx.enable_progress_bars, ctx.wait_for_min_actors_s, ctx.shuffle_strategy
    level = logger.level
    ctx.enable_progress_bars = progress
    ctx.wait_for_min_actors_s = _REPLICA_START_S
    if str(ctx.shuffle_strategy.value).startswith("sort_"):  # Ray < 2.57's default: no keys
        ctx.shuffle_strategy = type(ctx.shuffle_strategy).HASH_SHUFFLE
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ctx.enable_progress_bars, ctx.wait_for_min_actors_s, ctx.shuffle_strategy = saved
        logger.setLevel(level)


class ReplicaStartError(KestrelError):
    """A replica could not build its engine (a model or an adapter that does not load there);
    Ray does not retry an actor whose constructor failed, so the job stops."""


_LAST_ERROR = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """A Kestrel error raised inside Ray surfaces as itself (or, when only its text crossed
    over, as a :class:`ReplicaStartError` quoting it), not as Ray's wrapped task errors."""
    try:
        yield
    except Exception as exc:
        cause: Any = exc
        seen = set()
        while cause is not None and id(cause) not in seen:
            if isinstance(cause, KestrelError):
                raise cause from exc
            seen.add(id(cause))
            cause = getattr(cause, "cause", None) or cause.__cause__
        if getattr(exc, "actor_init_failed", False):
            lines = [_LAST_ERROR.match(x) for x in _ANSI.sub("", str(exc)).splitlines()]
            last = [m for m in lines if m] or None
            why = f"{last[-1][1]}: {last[-1][2]}" if last else type(exc).__name__
            raise ReplicaStartError(f"a replica could not start: {why}") from exc
        raise
