"""The replica: one :class:`~kestrel.Engine` per Ray actor, answering a batch of rows at once.

Ray Data builds a pool of these (``map_batches(Replica, compute=ActorPoolStrategy(size=N))``)
and hands each one whole blocks. A call sorts its block by routing key, so the rows of one image
are consecutive, decodes each image once, and keeps up to ``max_in_flight`` requests submitted
to the engine, whose scheduler batches them (an image's first question encodes it, the others
reuse its cached KV). Each row's record is exactly ``kestrel batch``'s line plus ``replica``;
a bad image or a failed request gives an error record, never a failed call.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kestrel.batch.run import RequestFeed
from kestrel.engine.options import EngineOptions

from .rows import request_of, table_of_records

__all__ = ["CrashOnce", "Replica", "ReplicaOptions"]


@dataclass(frozen=True, slots=True)
class CrashOnce:
    """Fault injection (tests, drills): the first replica to have answered ``after_rows`` rows
    kills its own process in the middle of its batch. ``marker`` is a file every replica can
    see; creating it is the claim, so this fires once per job, restarted replicas included."""

    after_rows: int
    marker: str

    def claim(self) -> bool:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How each replica builds its engine and asks its questions: the CLI's engine options
    (``engine``: an ``EngineOptions``, as ``cli.common.engine_options`` gives it; a mapping of
    its fields is turned into one), adapters to load (name, path), the generation
    settings, default adapter and ``response_format`` of every request, and the in-flight
    bound per call."""

    model: str | None = None
    engine: EngineOptions = field(default_factory=EngineOptions)
    adapters: tuple[tuple[str, str], ...] = ()
    settings: dict[str, Any] | None = None
    adapter: str | None = None
    response_format: dict[str, Any] | None = None  # the job's JSON schema: lines get "parsed"
    max_in_flight: int = 64
    threads: int | None = None  # torch intra-op threads (CPU replicas)
    crash: CrashOnce | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineOptions.of(self.engine))

    def open_engine(self) -> tuple[Any, str]:
        """In the replica's process: its Engine (threads set, adapters loaded) and its name,
        ``node-ip:pid``. Shared by the batch replicas and the serving ones."""
        import ray
        import torch

        from kestrel.engine import Engine

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        engine = Engine(self.model, self.engine)
        for name, path in self.adapters:
            engine.load_adapter(name, path)
        return engine, f"{ray.util.get_node_ip_address()}:{os.getpid()}"


class Replica:
    """A Ray Data callable class: ``Replica(options)(block) -> output rows``."""

    def __init__(self, options: ReplicaOptions) -> None:
        self.engine, self.name = options.open_engine()
        self.options = options
        if options.response_format is not None:  # a schema that cannot compile stops the job
            self.engine.check_response_format(options.response_format)
        self.answered = 0  # rows recorded by this process (for CrashOnce)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = sorted(batch.to_pylist(), key=lambda r: (r["key"], r["path"] or ""))
        records: list[dict[str, Any]] = []

        def record(line: dict[str, Any]) -> None:
            records.append({**line, "replica": self.name})
            self._answered_one()

        groups = [
            (path, [request_of(r) for r in group])
            for path, group in itertools.groupby(rows, key=lambda r: r["path"])
        ]
        opts = self.options
        feed = RequestFeed(self.engine, record, opts.max_in_flight, settings=opts.settings,
                           adapter=opts.adapter, response_format=opts.response_format)  # fmt: skip
        feed.run(groups)
        return table_of_records(records, parsed=feed.parsed)

    def _answered_one(self) -> None:
        self.answered += 1
        crash = self.options.crash
        if crash is not None and self.answered >= crash.after_rows and crash.claim():
            os._exit(17)  # as abrupt as a lost node: no cleanup, no reply
