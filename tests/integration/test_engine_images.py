"""Images as people have them through the Engine and the command line (docs/images.md): a file
stored in any EXIF orientation answers as its upright picture does (and shares its cache entry);
16-bit, transparent and animated files answer as the 8-bit pixels they are read as;
``exif_orientation=False`` / ``--keep-exif-orientation`` keep the stored pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kestrel import InvalidInputError
from kestrel.cli import main
from tests.conftest import fixture_dir
from tests.generated_images import STORED, UPRIGHT, animation, encode, stored_png

REGION = {"max_objects": 2}
GREEDY = {"temperature": 0.0, "max_tokens": 3}
ENGINE_OPTS = [
    "--model", str(fixture_dir()), "--device", "cpu", "--dtype", "float32",
    "--kv-cache-pages", "6000", "--max-batch-size", "4",
]  # fmt: skip
IMAGE_TOKENS = 729  # an image's block in the cache: a hit reuses at least this much


def orientation_files(folder: Path) -> dict[int, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {k: folder / f"stored_{k}.png" for k in STORED}
    for k, path in paths.items():
        path.write_bytes(stored_png(k))
    return paths


def sixteen_bit() -> tuple[bytes, np.ndarray]:
    levels = (UPRIGHT[..., 0].astype(np.uint16) * 257)[:, :, None]  # k -> 257 k: exact
    return encode(Image.fromarray(levels[..., 0])), np.repeat(UPRIGHT[..., :1], 3, axis=2)


def transparent() -> tuple[bytes, np.ndarray]:
    rgba = np.dstack([UPRIGHT, np.full(UPRIGHT.shape[:2], 255, np.uint8)])
    rgba[:3, :, 3] = 0  # the top half transparent: white, whatever colour it holds
    seen = UPRIGHT.copy()
    seen[:3] = 255
    return encode(Image.fromarray(rgba, "RGBA")), seen


def first_frame() -> tuple[bytes, np.ndarray]:
    return animation("GIF"), np.asarray(Image.new("RGB", (8, 6), (250, 0, 0)))


def test_every_orientation_detects_like_the_upright_picture(make_engine, tmp_path) -> None:
    engine = make_engine()
    upright = engine.detect(UPRIGHT, "square", settings=REGION)
    for k, path in orientation_files(tmp_path).items():
        result = engine.detect(path, "square", settings=REGION)
        assert result.objects == upright.objects, k
        assert result.metrics.cached_tokens >= IMAGE_TOKENS, k  # the same cache entry
        assert engine.prepare_image(path).digest == engine.prepare_image(UPRIGHT).digest


def test_exif_orientation_false_keeps_the_stored_pixels(make_engine, tmp_path) -> None:
    path = orientation_files(tmp_path)[6]
    engine = make_engine(exif_orientation=False)
    prepared = engine.prepare_image(path)
    assert np.array_equal(prepared.pixels, STORED[6]) and prepared.width == 6
    stored = engine.detect(STORED[6], "square", settings=REGION)
    result = engine.detect(path, "square", settings=REGION)
    assert result.objects == stored.objects and result.metrics.cached_tokens >= IMAGE_TOKENS
    assert prepared.digest != make_engine().prepare_image(path).digest


@pytest.mark.parametrize("case", [sixteen_bit, transparent, first_frame])
def test_file_answers_as_the_pixels_it_is_read_as(make_engine, case) -> None:
    data, seen = case()
    engine = make_engine()
    assert np.array_equal(engine.prepare_image(data).pixels, seen)
    want = engine.query(seen, "What is it?", settings=GREEDY)
    got = engine.query(data, "What is it?", settings=GREEDY)
    assert got.tokens == want.tokens and got.metrics.cached_tokens >= IMAGE_TOKENS


def test_bad_float_pixels_are_refused_by_the_engine(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidInputError, match=r"read as 0\.\.1"):
        engine.query(UPRIGHT.astype(np.float32), "What is it?")
    with pytest.raises(InvalidInputError, match="NaN"):
        engine.detect(np.full((4, 4), np.nan, np.float32), "square")
    ok = engine.prepare_image(UPRIGHT.astype(np.float32) / 255)
    assert np.array_equal(ok.pixels, UPRIGHT)


def test_batch_cli_reads_every_kind(make_engine, tmp_path, capsys) -> None:
    folder = tmp_path / "imgs"
    orientation_files(folder)
    (folder / "upright.png").write_bytes(encode(Image.fromarray(UPRIGHT)))
    cases = {"sixteen.png": sixteen_bit, "alpha.png": transparent, "anim.gif": first_frame}
    for name, case in cases.items():
        (folder / name).write_bytes(case()[0])
    (tmp_path / "q.txt").write_text("What is it?\n")
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--images", str(folder), "--questions", str(tmp_path / "q.txt")]
    assert main([*argv, "--out", str(out), "--no-progress", "--max-tokens", "3",
                 "--temperature", "0", *ENGINE_OPTS]) == 0  # fmt: skip
    capsys.readouterr()
    lines = {line["image"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert len(lines) == 12 and not [n for n, line in lines.items() if "error" in line]
    engine = make_engine()
    upright = engine.query(UPRIGHT, "What is it?", settings=GREEDY)
    same_picture = [lines[f"stored_{k}.png"] for k in STORED] + [lines["upright.png"]]
    assert {line["answer"] for line in same_picture} == {upright.answer}
    hits = [line["metrics"]["cached_tokens"] >= IMAGE_TOKENS for line in same_picture]
    assert sum(hits) == len(same_picture) - 1  # one picture: the vision encoder ran once
    for name, case in cases.items():
        want = engine.query(case()[1], "What is it?", settings=GREEDY)
        assert lines[name]["answer"] == want.answer, name


def test_keep_exif_orientation_flag(make_engine, tmp_path, capsys) -> None:
    path = orientation_files(tmp_path)[8]
    code = main(["detect", str(path), "square", "--max-objects", "2", "--json",
                 "--keep-exif-orientation", *ENGINE_OPTS])  # fmt: skip
    obj = json.loads(capsys.readouterr().out)
    assert code == 0
    want = make_engine().detect(STORED[8], "square", settings=REGION)
    assert obj["objects"] == [dict(b) for b in want.objects]
    assert obj["tokens"] == list(want.tokens)
