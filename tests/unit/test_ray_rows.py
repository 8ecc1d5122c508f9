"""The pure parts of ``kestrel.distributed`` (no Ray cluster): output rows round-trip to exactly
``kestrel batch``'s records, and tallies merge into the summary's figures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from kestrel.batch.output import error_record, result_record
from kestrel.batch.requests import BatchRequest
from kestrel.distributed.rows import image_items, record_of, table_of_records
from kestrel.distributed.summary import Tally, format_ray_summary
from kestrel.errors import InvalidInputError
from kestrel.results import QueryResult, RequestMetrics


def _records() -> list[dict]:
    metrics = RequestMetrics(741, 733, 4, 12.5, 3.25, 40.0, 0.5)
    answer = QueryResult(" a cat", None, "length", (1, 2, 3, 4), metrics)
    cold = QueryResult(
        " a dog", None, "stop", (5,), RequestMetrics(741, 0, 1, 99.0, 98.0, 0.0, 1.0)
    )
    a0, a1 = (BatchRequest(f"a#{i}", "a.png", Path("/x/a.png"), "q?") for i in range(2))
    text = BatchRequest("t", None, None, "hi?", "fr")
    bad = BatchRequest("b#0", "b.png", Path("/x/b.png"), "q?")
    return [
        {**result_record(a0, answer), "replica": "r1"},
        {**result_record(text, cold), "replica": "r2"},
        {**result_record(a1, cold), "replica": "r1"},
        {**error_record(bad, InvalidInputError("bad image:\n  broken")), "replica": "r2"},
    ]


def test_output_rows_round_trip_to_kestrel_batch_records() -> None:
    records = _records()
    rows = table_of_records(records).to_pylist()
    back = [record_of(row) for row in rows]
    assert back == records
    assert [list(r) for r in back] == [list(r) for r in records]  # same keys, same order
    assert [json.dumps(r) for r in back] == [json.dumps(r) for r in records]


def test_image_items_group_requests_by_file() -> None:
    reqs = [
        BatchRequest("1", "a.png", Path("/x/a.png"), "q1"),
        BatchRequest("2", None, None, "text"),
        BatchRequest("3", "./a.png", Path("/x/a.png"), "q2"),
        BatchRequest("/x/a.png", None, None, "an id that looks like the path"),
    ]
    items = image_items(reqs)
    assert [i["path"] for i in items] == ["/x/a.png", None, None]
    ids = [[r[0] for r in json.loads(i["requests"])] for i in items]
    assert ids == [["1", "3"], ["2"], ["/x/a.png"]]


def test_tallies_merge_into_the_summary() -> None:
    records = _records()
    parts = [Tally(), Tally()]
    for i, record in enumerate(records):
        parts[i % 2].add(record)
    total = Tally()
    for part in parts:
        total.merge(part)
    s = total.summary(skipped=3, wall_s=2.0, routing="image")
    assert (s.requests, s.skipped, s.errors) == (4, 3, 1)
    assert (s.input_tokens, s.cached_tokens, s.output_tokens) == (3 * 741, 733, 6)
    assert s.hit_rate == pytest.approx(733 / (3 * 741))
    # The text-only row is no vision encode; a.png encoded once (a#1), skipped once (a#0).
    assert (s.vision_encodes, s.vision_encodes_skipped) == (1, 1)
    r1, r2 = s.replicas
    assert (r1.replica, r1.requests, r1.errors, r1.vision_encodes_skipped) == ("r1", 2, 0, 1)
    assert (r2.replica, r2.requests, r2.errors, r2.vision_encodes) == ("r2", 2, 1, 0)
    assert s.requests_per_s == 2.0
    text = format_ray_summary(s)
    assert "4 (+3 already done, skipped)" in text and "replica r2" in text


def test_ttft_percentiles_within_a_bin() -> None:
    rng = random.Random(0)
    values = [rng.lognormvariate(4, 1.5) for _ in range(5001)]
    tally = Tally()
    for v in values:
        tally.add({"replica": "r", "image": None, "metrics": {
            "input_tokens": 1, "cached_tokens": 0, "output_tokens": 1, "ttft_ms": v}})  # fmt: skip
    s = tally.summary(skipped=0, wall_s=1.0, routing="random")
    for got, q in ((s.ttft_p50_ms, 50), (s.ttft_p99_ms, 99)):
        want = float(np.percentile(values, q, method="inverted_cdf"))
        assert got == pytest.approx(want, rel=0.006)
    assert Tally().summary(skipped=0, wall_s=0.0, routing="image").ttft_p50_ms is None
