"""Batch image question answering through an :class:`~kestrel.Engine`, into a JSONL file:
requests (``requests.py``), the run (``run.py``), the output lines (``output.py``) and the
counts every batch summary is made of (``tally.py``, shared with ``kestrel.distributed``)."""

from __future__ import annotations

from kestrel.batch.output import completed_ids, error_record, result_record
from kestrel.batch.requests import (
    IMAGE_EXTENSIONS,
    BatchRequest,
    requests_from_folder,
    requests_from_jsonl,
)
from kestrel.batch.run import BatchSummary, RequestFeed, format_summary, run_batch

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
]
