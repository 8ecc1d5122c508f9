"""Batch image QA (``kestrel batch`` and :mod:`kestrel.batch`) on the fixture model: one line
per request, errors only for the corrupt image, resume, JSONL input, the summary's figures."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from kestrel import Engine, EngineClosedError, InvalidInputError
from kestrel.batch import (
    completed_ids,
    format_summary,
    requests_from_folder,
    requests_from_jsonl,
    run_batch,
)
from kestrel.cli import main
from tests.conftest import fixture_dir

MODEL = fixture_dir()
ENGINE_OPTS = [
    "--model",
    str(MODEL),
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--kv-cache-pages",
    "6000",
    "--max-batch-size",
    "4",
    "--max-tokens",
    "4",
    "--temperature",
    "0",
]
SETTINGS = {"max_tokens": 4, "temperature": 0.0}  # greedy: answers are reproducible
IMAGES = ("rgba_500x500.png", "scene_800x600.png", "sub/shapes_378.png")
QUESTIONS = ("What is in the picture?", "How many objects are there?", "What colour is it?")
CORRUPT = "sub/broken.png"


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL, device="cpu", dtype="float32", kv_cache_pages=6000, max_batch_size=4) as e:
        yield e


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """3 images (one in a subfolder) + a corrupt one + a non-image, and 3 questions."""
    root = tmp_path_factory.mktemp("batch")
    for name in IMAGES:
        (root / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(MODEL / "images" / Path(name).name, root / "imgs" / name)
    (root / "imgs" / CORRUPT).write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "imgs" / "notes.txt").write_text("not an image")
    (root / "questions.txt").write_text("\n".join(QUESTIONS[:2]) + "\n\n  \n" + QUESTIONS[2] + "\n")
    return root


@pytest.fixture(scope="module")
def expected(engine) -> dict[tuple[str, str], str]:
    """The engine's own answer for each (image name, question)."""
    src = MODEL / "images"
    return {
        (n, q): engine.query(src / Path(n).name, q, settings=SETTINGS).answer
        for n in IMAGES
        for q in QUESTIONS
    }


@pytest.fixture(scope="module")
def first_run(data, tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """One ``kestrel batch`` over the folder, through the CLI (its own engine, cold cache)."""
    out = tmp_path_factory.mktemp("out") / "results.jsonl"
    argv = ["batch", "--images", str(data / "imgs"), "--questions", str(data / "questions.txt")]
    code = main([*argv, "--out", str(out), "--json", "--no-progress", *ENGINE_OPTS])
    assert code == 0
    return out, argv, read_lines(out)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def summary_of(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------- the folder run
def test_one_line_per_request_errors_only_for_the_corrupt_image(first_run, expected):
    _, _, lines = first_run
    ids = [line["id"] for line in lines]
    names = sorted([*IMAGES, CORRUPT])
    assert sorted(ids) == sorted(f"{n}#{i}" for n in names for i in range(3))
    for line in lines:
        name, index = line["id"].rsplit("#", 1)
        assert line["image"] == name
        assert line["question"] == QUESTIONS[int(index)]
        if name == CORRUPT:
            assert line["error_type"] == "InvalidInputError"
            assert "broken.png" in line["error"]
            assert "answer" not in line and "metrics" not in line
        else:
            assert "error" not in line
            assert line["answer"] == expected[name, line["question"]]
            assert line["finish_reason"] == "length"
            assert line["metrics"]["output_tokens"] == 4


def test_summary_agrees_with_the_lines(first_run, data, capsys):
    out, argv, _ = first_run
    copy = out.with_name("copy.jsonl")
    shutil.copy(out, copy)
    # A rerun does nothing new: every id is already in the output.
    assert main([*argv, "--out", str(copy), "--json", "--no-progress", *ENGINE_OPTS]) == 0
    rerun = summary_of(capsys)
    assert (rerun["requests"], rerun["skipped"], rerun["errors"]) == (0, 12, 0)
    assert copy.read_text() == out.read_text()

    # The first run's summary, recomputed from its lines.
    copy.unlink()
    assert main([*argv, "--out", str(copy), "--json", "--no-progress", *ENGINE_OPTS]) == 0
    summary = summary_of(capsys)
    metrics = [line["metrics"] for line in read_lines(copy) if "metrics" in line]
    assert (summary["requests"], summary["errors"], summary["skipped"]) == (12, 3, 0)
    assert summary["input_tokens"] == sum(m["input_tokens"] for m in metrics)
    assert summary["cached_tokens"] == sum(m["cached_tokens"] for m in metrics)
    assert summary["output_tokens"] == sum(m["output_tokens"] for m in metrics) == 9 * 4
    assert summary["hit_rate"] == pytest.approx(summary["cached_tokens"] / summary["input_tokens"])
    # Three questions per image: the second and third reuse the image's cached prefix.
    assert summary["hit_rate"] > 0
    assert summary["vision_encodes_skipped"] > 0
    ttfts = sorted(m["ttft_ms"] for m in metrics)
    assert ttfts[0] <= summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] <= ttfts[-1]
    assert summary["requests_per_s"] > 0
    assert summary["engine"]["requests_served"] >= 9
    assert summary["engine"]["pages_locked"] == 0


def test_resume_reruns_only_the_deleted_lines(first_run, data, engine, tmp_path):
    out = tmp_path / "results.jsonl"
    lines = first_run[2]
    dropped = {lines[0]["id"], lines[5]["id"], lines[-1]["id"]}
    out.write_text("".join(json.dumps(x) + "\n" for x in lines if x["id"] not in dropped))
    with out.open("a") as f:
        f.write('{"id": "scene_800x600.png#')  # a line cut short by a crash
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    summary = run_batch(engine, requests, out, settings=SETTINGS, progress=False)
    assert summary.requests == 3 and summary.skipped == 9
    after = read_lines(out)  # every line parses: the partial one was dropped
    assert len(after) == 12
    assert {x["id"] for x in after[-3:]} == dropped
    assert sorted(x["id"] for x in after) == sorted(x["id"] for x in lines)
    assert completed_ids(out) == {x["id"] for x in lines}
    assert "3 (+9 already done" in format_summary(summary)


# ---------------------------------------------------------------------------- JSONL input
def test_jsonl_input(data, engine, expected, tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copytree(data / "imgs", jobs / "pics")
    rows = [
        {"id": "a", "image": "pics/scene_800x600.png", "question": QUESTIONS[0]},
        {"id": 7, "image": "pics/scene_800x600.png", "question": QUESTIONS[1]},
        {"id": "c", "image": str(jobs / "pics" / IMAGES[2]), "question": QUESTIONS[2]},
        {"id": "d", "image": "pics/missing.png", "question": QUESTIONS[0]},
        {"id": "e", "image": "pics/" + CORRUPT, "question": QUESTIONS[0]},
    ]
    (jobs / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    requests = requests_from_jsonl(jobs / "in.jsonl")
    assert [r.id for r in requests] == ["a", "7", "c", "d", "e"]
    out = tmp_path / "out.jsonl"
    summary = run_batch(engine, requests, out, settings=SETTINGS, progress=False)
    got = {x["id"]: x for x in read_lines(out)}
    assert got["a"]["answer"] == expected["scene_800x600.png", QUESTIONS[0]]
    assert got["7"]["answer"] == expected["scene_800x600.png", QUESTIONS[1]]
    assert got["c"]["answer"] == expected[IMAGES[2], QUESTIONS[2]]
    assert got["a"]["image"] == "pics/scene_800x600.png"  # as written in the input
    assert "missing.png" in got["d"]["error"] and "broken.png" in got["e"]["error"]
    assert (summary.requests, summary.errors) == (5, 2)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"id": "a", "image": "x.png", "question": "q"}\nnot json\n', ":2: not valid JSON"),
        ('{"id": "a", "question": "q"}\n{"id": "a", "question": "r"}\n', "more than once"),
        ('{"image": "x.png", "question": "q"}\n', '"id"'),
        ('{"id": "a", "image": "x.png", "question": " "}\n', '"question"'),
        ("\n\n", "no requests"),
    ],
)
def test_bad_jsonl_input(tmp_path, content, needle):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(InvalidInputError) as exc:
        requests_from_jsonl(tmp_path / "in.jsonl")
    assert needle in str(exc.value)


# ---------------------------------------------------------------------------- the feed
class CountingEngine:
    """The real engine, counting prepared images and the futures in flight at once."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.prepared, self.in_flight, self.peak = engine, [], 0, 0
        self.lock = threading.Lock()

    def prepare_image(self, image):
        self.prepared.append(image)
        return self.engine.prepare_image(image)

    def submit_query(self, *args, **kwargs):
        future = self.engine.submit_query(*args, **kwargs)
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        future.add_done_callback(lambda _: self._done())
        return future

    def _done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def stats(self):
        return self.engine.stats()


def test_each_image_prepared_once_and_in_flight_bounded(data, engine, expected, tmp_path):
    counting = CountingEngine(engine)
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    out = tmp_path / "out.jsonl"
    summary = run_batch(counting, requests, out, settings=SETTINGS, max_in_flight=2, progress=False)
    assert sorted(map(str, counting.prepared)) == sorted(
        str(data / "imgs" / n) for n in [*IMAGES, CORRUPT]
    )
    assert 1 <= counting.peak <= 2
    assert (summary.requests, summary.errors) == (12, 3)
    answers = {(x["image"], x["question"]): x["answer"] for x in read_lines(out) if "answer" in x}
    assert answers == expected


# ---------------------------------------------------------------------------- input errors
@pytest.mark.parametrize(
    "case", ["missing images dir", "empty questions", "no images", "bad settings", "missing model"]
)
def test_cli_input_errors(case, data, tmp_path, capsys):
    """Nothing is written: a bad option fails the run, not each request."""
    images, questions, model = data / "imgs", data / "questions.txt", str(MODEL)
    extra = ["--temperature", "-1"] if case == "bad settings" else []
    if case == "missing images dir":
        images = tmp_path / "nope"
    elif case == "empty questions":
        questions = tmp_path / "q.txt"
        questions.write_text("\n   \n")
    elif case == "no images":
        images = tmp_path / "empty"
        images.mkdir()
    elif case == "missing model":
        model = str(tmp_path / "no-model")
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--images", str(images), "--questions", str(questions), "--out", str(out)]
    code = main([*argv, *ENGINE_OPTS, "--model", model, "--no-progress", *extra])
    _, err = capsys.readouterr()
    assert code == (1 if case == "missing model" else 2)  # a ModelLoadError is not bad input
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1, err
    assert not out.exists() or out.read_text() == ""


def test_a_closed_engine_stops_the_run_without_writing_its_requests(data, tmp_path):
    with Engine(MODEL, device="cpu", dtype="float32", kv_cache_pages=6000) as closed:
        pass
    out = tmp_path / "out.jsonl"
    requests = requests_from_folder(data / "imgs", data / "questions.txt")
    with pytest.raises(EngineClosedError):
        run_batch(closed, requests, out, settings=SETTINGS, progress=False)
    assert read_lines(out) == []  # the first image's first request stopped the run


def test_cli_input_choice(data, tmp_path, capsys):
    out = str(tmp_path / "out.jsonl")
    both = ["--input", str(data / "in.jsonl"), "--images", str(data / "imgs")]
    for argv, needle in [(both, "not both"), (["--images", str(data / "imgs")], "--questions")]:
        assert main(["batch", *argv, "--out", out, *ENGINE_OPTS]) == 2
        _, err = capsys.readouterr()
        assert err.startswith("kestrel: error: ") and needle in err, err
    rows = [{"id": "q1", "image": "imgs/scene_800x600.png", "question": QUESTIONS[0]}]
    (data / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(
        [
            "batch",
            "--input",
            str(data / "in.jsonl"),
            "--out",
            out,
            "--json",
            "--no-progress",
            *ENGINE_OPTS,
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1
    assert [x["id"] for x in read_lines(Path(out))] == ["q1"]


def test_per_line_adapters(data, tmp_path, capsys):
    """JSONL lines name adapters loaded with --load-adapter; each line is answered with its
    own adapter (or none), and an unknown name fails the run before a line is written."""
    src = MODEL / "images" / "shapes_378.png"
    lines = [
        {"id": "base", "image": str(src), "question": QUESTIONS[0]},
        {"id": "lora", "image": str(src), "question": QUESTIONS[0], "adapter": "fix"},
    ]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    adapter = f"fix={MODEL / 'adapter'}"
    rc = main(
        [
            "batch",
            "--input",
            str(jsonl),
            "--out",
            str(out),
            "--no-progress",
            "--load-adapter",
            adapter,
            *ENGINE_OPTS,
        ]
    )
    assert rc == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    with Engine(MODEL, device="cpu", dtype="float32", kv_cache_pages=3000) as e:
        e.load_adapter("fix", MODEL / "adapter")
        want_base = e.query(src, QUESTIONS[0], settings=SETTINGS).answer
        want_lora = e.query(src, QUESTIONS[0], settings=SETTINGS, adapter="fix").answer
    assert got["base"]["answer"] == want_base and "adapter" not in got["base"]
    assert got["lora"]["answer"] == want_lora and got["lora"]["adapter"] == "fix"
    assert want_base != want_lora

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**lines[1], "adapter": "nope"}) + "\n")
    rc = main(
        [
            "batch",
            "--input",
            str(bad),
            "--out",
            str(tmp_path / "o2.jsonl"),
            "--no-progress",
            *ENGINE_OPTS,
        ]
    )
    assert rc == 2 and "nope" in capsys.readouterr().err
    assert not (tmp_path / "o2.jsonl").exists() or not (tmp_path / "o2.jsonl").read_text()
