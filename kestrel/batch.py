"""Batch image question answering through an :class:`~kestrel.Engine`, into a JSONL file.

The job is a list of :class:`BatchRequest` (from a folder of images x a file of questions, or
from a JSONL of ``{"id", "image", "question"}``) and :func:`run_batch`, which keeps the
engine's batch full with a bounded number of in-flight futures, prepares (decodes and hashes)
each image once for all its questions, and appends one JSON line per request as results arrive:

    {"id", "image", "question", "answer", "finish_reason", "metrics": {...}}   or
    {"id", "image", "question", "error", "error_type"}

Resuming: ids already in the output file are skipped (error lines count as done; delete them
to retry). A bad image gives an error line for each of its requests; the run goes on. Bad
settings or an unknown adapter fail the run before a line is written; a closed engine stops it
without writing lines for the requests it did not finish.
The record builders (:func:`result_record`, :func:`error_record`) are public so other drivers
(a Ray Data pipeline, say) write the same lines.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from kestrel.batch_output import completed_ids, error_record, open_for_append, result_record
from kestrel.errors import EngineClosedError, InvalidInputError, KestrelError, UnknownAdapterError
from kestrel.results import EngineStats, QueryResult
from kestrel.skills import parse_settings

if TYPE_CHECKING:
    from kestrel.engine import Engine

__all__ = [
    "IMAGE_EXTENSIONS",
    "BatchRequest",
    "BatchSummary",
    "RequestFeed",
    "completed_ids",
    "error_record",
    "format_summary",
    "requests_from_folder",
    "requests_from_jsonl",
    "result_record",
    "run_batch",
    "summary_rows",
    "two_columns",
]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jfif", ".pbm", ".ppm"}
)


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One question about one image. ``image`` is the name written to the output (relative to
    the images folder or the JSONL's folder, as given); ``path`` is the file to open (None: a
    text-only question)."""

    id: str
    image: str | None
    path: Path | None
    question: str
    adapter: str | None = None  # a loaded adapter's name (None: the run's default)


# ---------------------------------------------------------------------------- building requests
def requests_from_folder(images_dir: str | Path, questions_file: str | Path) -> list[BatchRequest]:
    """Every image under ``images_dir`` (recursive, sorted, hidden files skipped) x every
    non-empty line of ``questions_file``; ids are ``<relative image path>#<question index>``."""
    root = Path(images_dir).expanduser()
    if not root.is_dir():
        raise InvalidInputError(f"images folder not found: {images_dir}")
    questions = _read_questions(Path(questions_file).expanduser())
    names = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and p.is_file()
    )
    if not names:
        raise InvalidInputError(
            f"no images under {images_dir} (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})"
        )
    return [
        BatchRequest(f"{name}#{i}", name, root / name, question)
        for name in names
        for i, question in enumerate(questions)
    ]


def _read_lines(path: Path, what: str) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidInputError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc}") from exc


def _read_questions(path: Path) -> list[str]:
    questions = [q.strip() for q in _read_lines(path, "questions file") if q.strip()]
    if not questions:
        raise InvalidInputError(f"questions file {path} holds no questions (all lines empty)")
    return questions


def requests_from_jsonl(path: str | Path) -> list[BatchRequest]:
    """One request per non-empty line ``{"id", "image", "question"}`` (optionally
    ``"adapter"``: the name of a loaded adapter); ``image`` is a path relative to the JSONL's
    folder (or absolute), or null / absent for a text-only question."""
    path = Path(path).expanduser()
    lines = enumerate(_read_lines(path, "input file"), 1)
    requests = [_request_from_line(ln, f"{path}:{n}", path.parent) for n, ln in lines if ln.strip()]
    if not requests:
        raise InvalidInputError(f"input file {path} holds no requests")
    _check_unique(requests)
    return requests


def _request_from_line(line: str, where: str, base: Path) -> BatchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rid, image, question = obj.get("id"), obj.get("image"), obj.get("question")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        raise InvalidInputError(f'{where}: "id" must be a non-empty string or an integer')
    if not isinstance(question, str) or not question.strip():
        raise InvalidInputError(f'{where}: "question" must be a non-empty string')
    if image is not None and (not isinstance(image, str) or not image):
        raise InvalidInputError(f'{where}: "image" must be a path string or null')
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise InvalidInputError(f'{where}: "adapter" must be an adapter name or null')
    file = None if image is None else base / Path(image).expanduser()
    return BatchRequest(str(rid), image, file, question, adapter)


def _check_unique(requests: Sequence[BatchRequest]) -> None:
    seen: set[str] = set()
    for r in requests:
        if r.id in seen:
            raise InvalidInputError(f"request id {r.id!r} appears more than once")
        seen.add(r.id)


# ---------------------------------------------------------------------------- the run
@dataclass(frozen=True, slots=True)
class BatchSummary:
    """What one :func:`run_batch` call did. Token counts and TTFT cover this call's answered
    requests; ``hit_rate`` is token-weighted (cached / input positions); the three engine
    counters are their change during this call; ``engine`` is the final snapshot."""

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
    vision_encodes_skipped: int
    prefill_tokens_saved: int
    evictions: int
    engine: EngineStats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Tally:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        self.requests += 1
        metrics = record.get("metrics")
        if metrics is None:
            self.errors += 1
            return
        self.input_tokens += metrics["input_tokens"]
        self.cached_tokens += metrics["cached_tokens"]
        self.output_tokens += metrics["output_tokens"]
        self.ttft_ms.append(metrics["ttft_ms"])


def run_batch(
    engine: Engine,
    requests: Sequence[BatchRequest],
    out: str | Path,
    *,
    settings: dict[str, Any] | None = None,
    adapter: str | None = None,
    max_in_flight: int = 64,
    progress: bool = True,
) -> BatchSummary:
    """Answer every request whose id is not yet in ``out``, appending one JSON line per request
    (flushed as each result arrives). ``max_in_flight`` bounds the submitted-but-unfinished
    futures; a few times the engine's ``max_batch_size`` keeps its batch full."""
    if max_in_flight < 1:
        raise InvalidInputError(f"max_in_flight must be >= 1, got {max_in_flight}")
    _check_unique(requests)
    # What would fail every request fails the run instead, before a line is written.
    parse_settings(settings)
    named = {adapter, *(r.adapter for r in requests)} - {None}
    for name in sorted(named - set(engine.adapters() if named else ())):
        raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
    out = Path(out)
    done = completed_ids(out)
    todo = [r for r in requests if r.id not in done]
    tally = _Tally()
    before = engine.stats()
    start = time.perf_counter()
    with (
        open_for_append(out) as f,
        tqdm(total=len(todo), unit="req", disable=not progress, file=sys.stderr) as bar,
    ):

        def record(line: dict[str, Any]) -> None:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            tally.add(line)
            bar.set_postfix(errors=tally.errors, refresh=False)
            bar.update(1)

        RequestFeed(engine, record, max_in_flight, settings=settings, adapter=adapter).run(
            _group_by_image(todo)
        )
    wall_s = time.perf_counter() - start
    return _summarize(tally, len(requests) - len(todo), wall_s, before, engine.stats())


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
        self.kwargs = kwargs  # settings=, adapter= of every submit_query
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
                self.record(result_record(request, future.result()))
            except EngineClosedError:
                raise  # not the request's fault: no line, so it runs again on resume
            except KestrelError as exc:
                self.record(error_record(request, exc))


def _summarize(
    tally: _Tally, skipped: int, wall_s: float, before: EngineStats, after: EngineStats
) -> BatchSummary:
    ttft = np.asarray(tally.ttft_ms, dtype=np.float64)
    p50, p99 = (float(v) for v in np.percentile(ttft, [50, 99])) if ttft.size else (None, None)
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    return BatchSummary(
        requests=tally.requests,
        skipped=skipped,
        errors=tally.errors,
        wall_s=wall_s,
        requests_per_s=tally.requests * per_s,
        output_tokens_per_s=tally.output_tokens * per_s,
        ttft_p50_ms=p50,
        ttft_p99_ms=p99,
        input_tokens=tally.input_tokens,
        cached_tokens=tally.cached_tokens,
        output_tokens=tally.output_tokens,
        hit_rate=tally.cached_tokens / tally.input_tokens if tally.input_tokens else 0.0,
        vision_encodes_skipped=after.vision_encodes_skipped - before.vision_encodes_skipped,
        prefill_tokens_saved=after.prefill_tokens_saved - before.prefill_tokens_saved,
        evictions=after.evictions - before.evictions,
        engine=after,
    )


def summary_rows(s: Any) -> list[tuple[str, str]]:
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
