"""scripts/bench_images.py and scripts/bench_crop_parts.py, small: each checks its variants
agree (the same pixels, the same crops) before timing, and prints one row per variant."""

from __future__ import annotations

import importlib
import json

import pytest

from tests.scripts import on_path


@pytest.fixture(scope="module")
def scripts():
    with on_path():
        yield {n: importlib.import_module(n) for n in ("bench_images", "bench_crop_parts")}


def test_image_decode_bench_compares_pil_with_prepare_image(scripts, capsys) -> None:
    scripts["bench_images"].main(["--allow-busy", "--rounds", "1", "--repeats", "2", "--json",
                                  "--large-side", "2100", "--large-repeats", "1"])  # fmt: skip
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["figures"]
    for name in ("12 MP JPEG", "49 MP PNG"):  # large images: in full against shrunk on load
        assert figures[f"{name}: full decode"]["ms"]["median"] > 0
        assert figures[f"{name}: shrink on load"]["ms"]["median"] > 0
    for name in ("chart PNG", "chart JPEG", "1280x960 JPEG"):  # each input's own figures
        assert figures[f"{name}: PIL"]["ms"]["median"] > 0
        assert figures[f"{name}: prepare_image"]["ms"]["median"] > 0
        assert figures[f"{name}: prepare_image / {name}: PIL: ms"]["median"] > 0
        assert figures[f"{name}: sent again"]["ms"]["median"] > 0


def test_crop_parts_bench_runs_serial_and_parts(scripts, capsys) -> None:
    scripts["bench_crop_parts"].main(["--allow-busy", "--rounds", "1", "--repeats", "2",
                                      "--parts", "2", "--size", "480x640"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| serial |" in out and "| 2 parts |" in out and "1.00x" in out
    assert "on the device" not in out


def test_crop_parts_bench_times_up_to_the_encoders_input_with_a_device(scripts, capsys) -> None:
    """``--device``: every variant up to the encoder's input there, and the crops made on the
    device from the image (checked equal to the host's first, or the bench stops)."""
    args = ["--parts", "2", "--size", "300x400", "--device", "cpu"]
    scripts["bench_crop_parts"].main(["--allow-busy", "--rounds", "1", "--repeats", "2", *args])
    out = capsys.readouterr().out
    assert "| serial |" in out and "| on the device |" in out
