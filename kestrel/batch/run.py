"""Running a batch job: :func:`run_batch` keeps the engine's batch full with a bounded number
of in-flight futures, prepares (decodes and hashes) each image once for all its questions, and
appends one JSON line per request as results arrive:

    {"id", "image", "question", "answer", "finish_reason", "metrics": {...}}   or
    {"id", "image", "question", "error", "error_type"}

With a ``response_format`` (a JSON schema for the whole job, docs/structured.md) every answer
is held to it and its line carries ``"parsed"``: the answer's JSON value (null for an answer
cut short by ``max_tokens``), so the fields can be read as columns.

Resuming: ids already in the output file are skipped (error lines count as done; delete them
to retry). A bad image gives an error line for each of its requests; the run goes on. Bad
settings or an unknown adapter fail the run before a line is written; a closed engine stops it
without writing lines for the requests it did not finish.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from kestrel.batch.output import completed_ids, error_record, open_for_append, result_record
from kestrel.batch.requests import BatchRequest, check_unique
from kestrel.batch.tally import Counts, RunFigures, run_figures, summary_rows, two_columns
from kestrel.errors import EngineClosedError, InvalidInputError, KestrelError, UnknownAdapterError
from kestrel.results import EngineStats, QueryResult
from kestrel.skills import parse_settings

if TYPE_CHECKING:
    from kestrel.engine import Engine

__all__ = ["BatchSummary", "RequestFeed", "format_summary", "run_batch"]


# ---------------------------------------------------------------------------- the run
@dataclass(frozen=True, slots=True)
class BatchSummary(RunFigures):
    """What one :func:`run_batch` call did (the shared :class:`RunFigures` first); the three
    engine counters are their change during this call; ``engine`` is the final snapshot."""

    vision_encodes_skipped: int
    prefill_tokens_saved: int
    evictions: int
    engine: EngineStats


def run_batch(
    engine: Engine,
    requests: Sequence[BatchRequest],
    out: str | Path,
    *,
    settings: dict[str, Any] | None = None,
    adapter: str | None = None,
    max_in_flight: int = 64,
    progress: bool = True,
    response_format: dict[str, Any] | None = None,
) -> BatchSummary:
    """Answer every request whose id is not yet in ``out``, appending one JSON line per request
    (flushed as each result arrives). ``max_in_flight`` bounds the submitted-but-unfinished
    futures; a few times the engine's ``max_batch_size`` keeps its batch full."""
    if max_in_flight < 1:
        raise InvalidInputError(f"max_in_flight must be >= 1, got {max_in_flight}")
    check_unique(requests)
    # What would fail every request fails the run instead, before a line is written.
    parse_settings(settings)
    if response_format is not None:
        engine.check_response_format(response_format)  # a schema that cannot compile
    named = {adapter, *(r.adapter for r in requests)} - {None}
    for name in sorted(named - set(engine.adapters() if named else ())):
        raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
    out = Path(out)
    done = completed_ids(out)
    todo = [r for r in requests if r.id not in done]
    tally, ttft_ms = Counts(), []
    before = engine.stats()
    start = time.perf_counter()
    with (
        open_for_append(out) as f,
        tqdm(total=len(todo), unit="req", disable=not progress, file=sys.stderr) as bar,
    ):

        def record(line: dict[str, Any]) -> None:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            if (metrics := tally.add(line)) is not None:
                ttft_ms.append(metrics["ttft_ms"])
            bar.set_postfix(errors=tally.errors, refresh=False)
            bar.update(1)

        feed = RequestFeed(engine, record, max_in_flight, settings=settings, adapter=adapter,
                           response_format=response_format)  # fmt: skip
        feed.run(_group_by_image(todo))
    wall_s = time.perf_counter() - start
    return _summarize(tally, ttft_ms, len(requests) - len(todo), wall_s, before, engine.stats())


def _group_by_image(requests: Iterable[BatchRequest]) -> list[tuple[Path | None, list]]:
    """Requests grouped by image file, in order of first appearance: an image's questions go
    in together, so all but the first can reuse its cached prefix."""
    groups: dict[Path | None, list[BatchRequest]] = {}
    for r in requests:
        groups.setdefault(r.path, []).append(r)
    return list(groups.items())


class RequestFeed:
    """Keeps up to ``max_in_flight`` requests submitted and records each as it finishes; each
    image is decoded once for its group of questions. Used by ``run_batch`` and by each Ray
    replica (``kestrel.distributed``)."""

    def __init__(self, engine: Engine, record: Callable[[dict[str, Any]], None],
                 max_in_flight: int, **kwargs: Any) -> None:  # fmt: skip
        self.engine, self.record, self.max_in_flight = engine, record, max_in_flight
        self.kwargs = kwargs  # settings=, adapter=, response_format= of every submit_query
        self.parsed = kwargs.get("response_format") is not None  # the lines carry "parsed"
        self.in_flight: dict[Future[QueryResult], BatchRequest] = {}

    def run(self, groups: list[tuple[Path | None, list[BatchRequest]]]) -> None:
        try:
            for path, group in groups:
                try:  # decode + hash once for all of this image's questions
                    image = None if path is None else self.engine.prepare_image(path)
                except KestrelError as exc:
                    for r in group:
                        self.record(error_record(r, exc))
                    continue
                for r in group:
                    while len(self.in_flight) >= self.max_in_flight:
                        self._collect()
                    self._submit(image, r)
            while self.in_flight:
                self._collect()
        finally:  # interrupted (Ctrl-C, a write error, a closed engine): drop what is queued
            for future in self.in_flight:
                future.cancel()

    def _submit(self, image: Any, request: BatchRequest) -> None:
        kwargs = self.kwargs
        if request.adapter is not None:
            kwargs = {**kwargs, "adapter": request.adapter}
        try:
            future = self.engine.submit_query(image, request.question, **kwargs)
        except EngineClosedError:
            raise
        except KestrelError as exc:  # this request's own fault (its prompt too long, ...)
            self.record(error_record(request, exc))
        else:
            self.in_flight[future] = request

    def _collect(self) -> None:
        """Wait for at least one in-flight request and record every finished one."""
        finished, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
        for future in finished:
            request = self.in_flight.pop(future)
            try:
                self.record(result_record(request, future.result(), parsed=self.parsed))
            except EngineClosedError:
                raise  # not the request's fault: no line, so it runs again on resume
            except KestrelError as exc:
                self.record(error_record(request, exc))


def _summarize(
    tally: Counts,
    ttft_ms: list[float],
    skipped: int,
    wall_s: float,
    before: EngineStats,
    after: EngineStats,
) -> BatchSummary:
    ttft = np.asarray(ttft_ms, dtype=np.float64)
    p50, p99 = (float(v) for v in np.percentile(ttft, [50, 99])) if ttft.size else (None, None)
    return BatchSummary(
        **run_figures(tally, skipped=skipped, wall_s=wall_s, ttft_ms=(p50, p99)),
        vision_encodes_skipped=after.vision_encodes_skipped - before.vision_encodes_skipped,
        prefill_tokens_saved=after.prefill_tokens_saved - before.prefill_tokens_saved,
        evictions=after.evictions - before.evictions,
        engine=after,
    )


def format_summary(summary: BatchSummary) -> str:
    """The closing summary of ``kestrel batch``."""
    s = summary
    return two_columns(
        [
            *summary_rows(s),
            ("vision encodes skipped", str(s.vision_encodes_skipped)),
            ("prefill tokens saved", f"{s.prefill_tokens_saved:,}"),
            ("cache evictions", f"{s.evictions:,} pages"),
        ]
    )
