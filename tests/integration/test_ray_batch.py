"""``kestrel batch --ray`` (:mod:`kestrel.distributed`) on a local Ray instance with 2 CPUs and
the fixture model: image routing keeps every question about an image (by content: a copy under
another name included) on one replica, which encodes it once; the answers and lines are those
of one Engine and of ``kestrel batch``; corrupt images give error lines; the summary adds up;
resume skips what is done; a replica killed mid-job still leaves every row exactly once; on
Moondream 3 (md3-tiny-a) the answers are the Engine's."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kestrel import Engine  # noqa: E402
from kestrel.batch import requests_from_folder, run_batch  # noqa: E402
from kestrel.cli import main  # noqa: E402
from kestrel.distributed import (  # noqa: E402
    CrashOnce,
    RayBatchOptions,
    ReplicaOptions,
    run_ray_batch,
)
from tests.conftest import FIXTURES, fixture_dir  # noqa: E402

MODEL = fixture_dir()
SETTINGS = {"max_tokens": 4, "temperature": 0.0}  # greedy: answers are reproducible
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_pages": 6000, "max_batch_size": 4}
ENGINE_OPTS = [
    *("--model", str(MODEL), "--device", "cpu", "--dtype", "float32"),
    *("--kv-cache-pages", "6000", "--max-batch-size", "4", "--max-tokens", "4"),
    *("--temperature", "0", "--no-progress", "--json"),
]
# name in the folder -> fixture image; dup.png holds scene_800x600.png's pixels.
IMAGES = {
    "rgba_500x500.png": "rgba_500x500.png",
    "scene_800x600.png": "scene_800x600.png",
    "sub/shapes_378.png": "shapes_378.png",
    "dup.png": "scene_800x600.png",
}
CORRUPT = "broken.png"
QUESTIONS = ("What is in the picture?", "How many objects are there?")
ANSWER_KEYS = ["id", "image", "question", "answer", "finish_reason", "metrics", "replica"]
ERROR_KEYS = ["id", "image", "question", "error", "error_type", "replica"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # Ray keeps at most num_cpus idle workers by default and kills the rest within a second,
    # so each job here paid for fresh processes importing torch and kestrel for its reading and
    # writing tasks (the replicas and shuffle actors take worker slots too). A pool of 8 keeps
    # those workers warm from one job to the next; what the jobs do is unchanged.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        _system_config={"num_workers_soft_limit": 8},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray_batch")
    for name, src in IMAGES.items():
        (root / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(MODEL / "images" / src, root / "imgs" / name)
    (root / "imgs" / CORRUPT).write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "questions.txt").write_text("\n".join(QUESTIONS) + "\n")
    return root


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL, **ENGINE) as e:
        yield e


@pytest.fixture(scope="module")
def expected(engine) -> dict[tuple[str, str], str]:
    """One Engine's answer for each (image name, question)."""
    src = MODEL / "images"
    return {(n, q): engine.query(src / f, q, settings=SETTINGS).answer
            for n, f in IMAGES.items() for q in QUESTIONS}  # fmt: skip


@pytest.fixture(scope="module")
def routed(data, tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """One ``kestrel batch --ray`` run with 2 replicas, image routing, through the CLI."""
    out = tmp_path_factory.mktemp("out") / "results"
    argv = ["batch", "--ray", "--replicas", "2", "--images", str(data / "imgs")]
    argv += ["--questions", str(data / "questions.txt"), "--out", str(out), *ENGINE_OPTS]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return out, last_json(stdout), read_lines(out)


def last_json(stdout: io.StringIO) -> dict:
    """The summary: the last line (Ray may print its own warnings on the driver's stdout)."""
    return json.loads(stdout.getvalue().strip().splitlines()[-1])


def read_lines(folder: Path) -> list[dict]:
    return [json.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.open()]


def all_ids() -> list[str]:
    names = [*IMAGES, CORRUPT]
    return sorted(f"{n}#{i}" for n in names for i in range(len(QUESTIONS)))


def check_line(line: dict, expected: dict) -> None:
    name = line["image"]
    assert line["question"] == QUESTIONS[int(line["id"].rsplit("#", 1)[1])]
    if name == CORRUPT:
        assert list(line) == ERROR_KEYS and line["error_type"] == "InvalidInputError"
        assert CORRUPT in line["error"]
    else:
        assert list(line) == ANSWER_KEYS
        assert line["answer"] == expected[name, line["question"]]


# ---------------------------------------------------------------------------- the routed run
def test_every_row_once_with_one_engines_answers(routed, expected):
    _, _, lines = routed
    assert sorted(line["id"] for line in lines) == all_ids()
    for line in lines:
        check_line(line, expected)


def test_image_routing_keeps_each_image_on_one_replica(routed):
    _, summary, lines = routed
    by_pixels: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        by_pixels[IMAGES.get(line["image"], line["image"])].append(line)
    assert len({line["replica"] for line in lines}) == 2  # both replicas served
    for group in by_pixels.values():
        assert len({line["replica"] for line in group}) == 1, group
    # Each image (dup.png and its original are one) ran the vision encoder exactly once.
    for name, group in by_pixels.items():
        if name != CORRUPT:
            assert sum(x["metrics"]["cached_tokens"] == 0 for x in group) == 1, name
    assert summary["vision_encodes"] == 3


def test_summary_adds_up(routed):
    _, s, lines = routed
    answered = [x for x in lines if "metrics" in x]
    assert (s["requests"], s["skipped"], s["errors"]) == (len(lines), 0, 2) == (10, 0, 2)
    assert s["input_tokens"] == sum(x["metrics"]["input_tokens"] for x in answered)
    assert s["cached_tokens"] == sum(x["metrics"]["cached_tokens"] for x in answered)
    assert s["output_tokens"] == 4 * len(answered)
    assert s["hit_rate"] == pytest.approx(s["cached_tokens"] / s["input_tokens"])
    assert s["vision_encodes"] + s["vision_encodes_skipped"] == len(answered)
    ttfts = sorted(x["metrics"]["ttft_ms"] for x in answered)  # percentiles to 0.6%
    assert ttfts[0] * 0.99 <= s["ttft_p50_ms"] <= s["ttft_p99_ms"] <= ttfts[-1] * 1.01
    replicas = s["replicas"]
    assert sum(r["requests"] for r in replicas) == s["requests"]
    assert sum(r["errors"] for r in replicas) == s["errors"]
    assert sum(r["cached_tokens"] for r in replicas) == s["cached_tokens"]
    for r in replicas:
        mine = [x for x in lines if x["replica"] == r["replica"]]
        assert r["requests"] == len(mine)


def test_lines_are_kestrel_batchs(routed, data, engine, tmp_path):
    """The same request gives the same line as ``kestrel batch``, plus the replica."""
    out = tmp_path / "plain.jsonl"
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    run_batch(engine, requests, out, settings=SETTINGS, progress=False)
    plain = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    for line in routed[2]:
        want = plain[line["id"]]
        assert list(line) == [*want, "replica"]
        if "metrics" in want:
            assert line["metrics"]["input_tokens"] == want["metrics"]["input_tokens"]
            line, want = {**line, "metrics": None}, {**want, "metrics": None}
        assert {k: v for k, v in line.items() if k != "replica"} == want


# ---------------------------------------------------------------------------- resume
def test_resume_skips_done_ids_and_cuts_a_partial_line(routed, data, tmp_path):
    out = tmp_path / "results"
    shutil.copytree(routed[0], out)
    files = sorted(out.glob("*.jsonl"))
    with files[0].open("a") as f:
        f.write('{"id": "dup.png#')  # a line cut short by a killed job
    argv = ["batch", "--ray", "--images", str(data / "imgs"), "--questions"]
    argv += [str(data / "questions.txt"), "--out", str(out), *ENGINE_OPTS]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    summary = last_json(stdout)
    assert (summary["requests"], summary["skipped"]) == (0, 10)
    assert sorted(out.glob("*.jsonl")) == files  # nothing new written
    assert sorted(x["id"] for x in read_lines(out)) == all_ids()  # every line parses


def test_out_must_be_a_folder(data, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_text("")
    argv = ["batch", "--ray", "--images", str(data / "imgs"), "--questions"]
    argv += [str(data / "questions.txt"), "--out", str(out), *ENGINE_OPTS]
    assert main(argv) == 2
    assert "names a folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------- JSONL in, Parquet out
def test_jsonl_input_random_routing_parquet_output(data, expected, tmp_path):
    """A text-only question, a missing image, random routing; Parquet files, resumable."""
    rows = [
        {"id": "a", "image": "imgs/scene_800x600.png", "question": QUESTIONS[0]},
        {"id": 7, "image": "imgs/dup.png", "question": QUESTIONS[1]},
        {"id": "text", "image": None, "question": "Say hello."},
        {"id": "gone", "image": "imgs/missing.png", "question": QUESTIONS[0]},
    ]
    (data / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.parquet"
    argv = ["batch", "--ray", "--replicas", "2", "--routing", "random", "--input"]
    argv += [str(data / "in.jsonl"), "--out", str(out), *ENGINE_OPTS]
    for rerun in (False, True):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            assert main(argv) == 0
        summary = last_json(stdout)
        assert (summary["requests"], summary["skipped"]) == ((0, 4) if rerun else (4, 0))
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.column_names == [*ANSWER_KEYS[:3], "adapter", *ANSWER_KEYS[3:6], "error",
                                  "error_type", "replica"]  # fmt: skip
    got = {r["id"]: r for r in table.to_pylist()}
    assert sorted(got) == ["7", "a", "gone", "text"]
    assert got["a"]["answer"] == expected["scene_800x600.png", QUESTIONS[0]]
    assert got["7"]["answer"] == expected["dup.png", QUESTIONS[1]]
    assert got["text"]["image"] is None and got["text"]["answer"] and got["text"]["error"] is None
    assert got["gone"]["error_type"] == "InvalidInputError" and got["gone"]["answer"] is None
    assert summary["errors"] == 0 and summary["vision_encodes"] == 0  # the rerun did nothing


# ---------------------------------------------------------------------------- a replica dies
def test_a_replica_killed_mid_job_leaves_every_row_once(routed, data, expected, tmp_path):
    """Half the lines are already there (resume); of the rest, the first replica to answer 2
    rows kills its process mid-block; Ray restarts it and retries its block."""
    out = tmp_path / "results"
    out.mkdir()
    done = [x for x in routed[2] if x["image"] in ("rgba_500x500.png", "scene_800x600.png")]
    (out / "earlier.jsonl").write_text("".join(json.dumps(x) + "\n" for x in done))
    marker = tmp_path / "crashed"
    replica = ReplicaOptions(
        model=str(MODEL), engine=ENGINE, settings=SETTINGS, crash=CrashOnce(2, str(marker))
    )
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    summary = run_ray_batch(requests, out, replica, RayBatchOptions(replicas=2, progress=False))

    killed = marker.read_text()  # the pid of the replica that died
    lines = read_lines(out)
    assert sorted(x["id"] for x in lines) == all_ids()  # every row exactly once
    for line in lines:
        check_line(line, expected)
    assert (summary.requests, summary.skipped) == (10 - len(done), len(done))
    served = {r.replica: r.requests for r in summary.replicas}
    assert sum(served.values()) == summary.requests
    print(
        f"\nreplica killed: pid {killed}; rows run {summary.requests}, skipped "
        f"{summary.skipped}, lines written {len(lines)}; served per replica {served}"
    )


# ---------------------------------------------------------------------------- Moondream 3
def test_md3_ray_batch_answers_equal_the_engines(tmp_path):
    """``kestrel batch --ray`` on md3-tiny-a (2 images x 2 questions, one replica on the same
    local Ray): every answer equals the local Engine's, which the md3 front-door tests tie to
    the first-party reference."""
    md3 = FIXTURES / "md3-tiny-a"
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("scene_800x600.png", "shapes_378.png"):
        shutil.copy(md3 / "images" / name, images / name)
    (tmp_path / "q.txt").write_text("\n".join(QUESTIONS) + "\n")
    out = tmp_path / "results"
    opts = [str(md3) if x == str(MODEL) else x for x in ENGINE_OPTS]
    argv = ["batch", "--ray", "--replicas", "1", "--images", str(images), "--questions"]
    argv += [str(tmp_path / "q.txt"), "--out", str(out), *opts]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    summary, lines = last_json(stdout), read_lines(out)
    assert (summary["requests"], summary["errors"]) == (4, 0)
    assert sorted((x["image"], x["question"]) for x in lines) == sorted(
        (n, q) for n in ("scene_800x600.png", "shapes_378.png") for q in QUESTIONS
    )
    with Engine(md3, **ENGINE) as engine:
        assert engine.config.family == "moondream3"
        for line in lines:
            want = engine.query(images / line["image"], line["question"], settings=SETTINGS)
            assert line["answer"] == want.answer, line


def test_a_json_schema_job_writes_parsed_values(data, tmp_path):
    """``kestrel batch --ray --json-schema``: every line carries ``parsed``, the answer's
    value, which validates against the schema (JSONL folder and Parquet alike)."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "required": ["colour"], "additionalProperties": False,
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "q.txt").write_text(QUESTIONS[0] + "\n")
    images = tmp_path / "imgs"
    images.mkdir()
    shutil.copy(MODEL / "images" / "scene_800x600.png", images / "scene.png")
    shutil.copy(MODEL / "images" / "shapes_378.png", images / "shapes.png")
    for out in (tmp_path / "results", tmp_path / "results.parquet"):
        argv = ["batch", "--ray", "--replicas", "1", "--images", str(images), "--questions",
                str(tmp_path / "q.txt"), "--out", str(out), *ENGINE_OPTS, "--max-tokens", "32",
                "--json-schema", str(tmp_path / "schema.json")]  # fmt: skip
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            assert main(argv) == 0
        assert (last_json(stdout)["requests"], last_json(stdout)["errors"]) == (2, 0)
        if out.suffix == ".parquet":
            import pyarrow.parquet as pq

            values = [json.loads(v) for v in pq.read_table(out).column("parsed").to_pylist()]
        else:
            values = [line["parsed"] for line in read_lines(out)]
        assert len(values) == 2
        for value in values:
            jsonschema.validate(value, schema)
