"""Every script's ``--smoke`` run, in this process: its ``main(argv)`` end to end at its
smallest sizes (mostly the embedded kestrel-tiny), checking what it prints, never a figure.

A script that needs what this machine lacks (a GPU, the public reference checkout) still has
its arguments parsed and its refusal checked here, and the rest skips saying why; the Ray legs
of ``bench_ray.py`` and ``bench_serve_ray.py`` (~30 s each on 2 cores, past this module's
budget) run with ``KESTREL_SMOKE_RAY=1``, while ``tests/integration/test_ray_batch.py``
and ``tests/server/test_server_ray.py`` cover those front doors. Scripts that another test
already runs (``bench_gpu``, ``bench_tiers``, ...) are left to it; ``kestrel/testing/
script_rules.py`` fails on a script with a ``main`` that no test names."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from kestrel_kernels import fused
from tests.scripts import on_path

RAY = os.environ.get("KESTREL_SMOKE_RAY") == "1"
NO_RAY = "the Ray legs start Ray (~30 s each here): KESTREL_SMOKE_RAY=1 runs them"


@pytest.fixture
def script(capsys):
    """``script(name)``: the module, imported from scripts/; what a run leaves behind is undone
    (torch's threads, the fused ops' backend, sys.path)."""
    threads, backend, path = torch.get_num_threads(), fused.get_fused_backend(), list(sys.path)
    with on_path():
        yield importlib.import_module
    torch.set_num_threads(threads)
    fused.set_fused_backend(backend)
    sys.path[:] = path
    capsys.readouterr()


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_batch_qa(script, capsys, tmp_path) -> None:
    script("batch_qa").main(["--smoke", "--out", str(tmp_path / "a.jsonl")])
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and all("answer" in x for x in lines)  # 6 scenes x 2 questions
    assert '"requests_served": 12' in capsys.readouterr().out


def test_bench_adapters(script, capsys) -> None:
    script("bench_adapters").main(["--smoke", "--json"])
    out = last_json(capsys.readouterr().out)
    assert out["smoke"] and out["rounds"] == 1
    assert "adapter compute overhead (base + salts / adapters)" in out["figures"]


def test_bench_attention(script, capsys) -> None:
    script("bench_attention").main(["--smoke"])
    out = capsys.readouterr().out
    assert "decode     2     1    40" in out and "prefill    1    40    40" in out


def test_bench_attention_plan(script, capsys) -> None:
    script("bench_attention_plan").main(["--smoke"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 4 and all(len(r.split()) == 4 for r in rows)  # batch 1 and 2, 2 sizes


def test_bench_batch_qa(script, capsys) -> None:
    script("bench_batch_qa").main(["--smoke", "--json"])
    out = last_json(capsys.readouterr().out)
    assert out["answers_identical"] and out["requests"] == 2
    assert {"eager, image encoded once per image", "Engine, cache on"} <= set(out["figures"])


def test_bench_decode(script, capsys) -> None:
    script("bench_decode").main(["--smoke", "--json"])
    figures = last_json(capsys.readouterr().out)["figures"]
    assert {"same image, B=2", "own image, B=2"} <= set(figures)


def test_bench_gpu_runtime_needs_cuda(script) -> None:
    bench = script("bench_gpu_runtime")
    if torch.cuda.is_available():
        bench.main(["--smoke"])
        return
    with pytest.raises(SystemExit):  # argparse's error: the reason, exit status 2
        bench.main(["--smoke"])
    pytest.skip("bench_gpu_runtime.py --smoke needs CUDA (its refusal was checked)")


def test_bench_prefix_cache(script, capsys) -> None:
    assert script("bench_prefix_cache").main(["--smoke", "--json"]) == 0
    figures = last_json(capsys.readouterr().out)["figures"]
    on, off = figures["cache on"], figures["cache off"]
    assert on["vision_encodes"]["median"] == 2 and off["vision_encodes"]["median"] == 4


def test_bench_radix(script, capsys) -> None:
    script("bench_radix").main(["--smoke", "--json"])
    figures = last_json(capsys.readouterr().out)["figures"]
    assert len(figures) == 12 and all(f["ours_us"]["median"] > 0 for f in figures.values())


def test_bench_ray(script, capsys) -> None:
    ray = script("bench_ray")
    ray.main(["--smoke", "--json", *([] if RAY else ["--no-ray"])])
    out = last_json(capsys.readouterr().out)
    assert out["rps_single"] > 0 and out["hit_rate_single"] is not None
    if not RAY:
        assert out["rps_image"] is None
        pytest.skip(f"bench_ray.py's one-Engine leg ran; {NO_RAY}")
    assert out["encodes_image"] == 2


def test_bench_reference(script, capsys) -> None:
    code = script("bench_reference").main(["--smoke"])
    out = capsys.readouterr().out
    assert code == 0
    if out.startswith("SKIPPED"):
        pytest.skip("bench_reference.py needs the reference checkout (MOONDREAM_REF)")
    assert "| Engine, cache on |" in out


def test_bench_serve_ray(script, capsys) -> None:
    serve = script("bench_serve_ray")
    variants = "ray image,ray random,one serve" if RAY else "one serve"
    serve.main(["--smoke", "--json", "--variants", variants])
    figures = last_json(capsys.readouterr().out)["figures"]
    assert figures["one serve"]["errors"]["median"] == 0
    assert figures["one serve"]["encodes_per_image"]["median"] == 1
    assert serve.server_cmd(serve.parse_args(["--smoke"]), "ray random")[-4:] == [
        "--replicas", "1", "--routing", "random"
    ]  # fmt: skip
    if not RAY:
        pytest.skip(f"bench_serve_ray.py's plain-serve variant ran; {NO_RAY}")


def test_bench_server(script, capsys) -> None:
    script("bench_server").main(["--smoke", "--json"])
    figures = last_json(capsys.readouterr().out)["figures"]
    for side in ("HTTP (kestrel serve)", "Engine (in-process)"):
        assert figures[side]["errors"]["median"] == 0
        assert figures[side]["requests_per_s"]["median"] > 0


def test_bench_vision(script, capsys) -> None:
    script("bench_vision").main(["--smoke", "--crops", "1", "--repeats", "1", "--json"])
    assert {"default", "gemms"} <= set(last_json(capsys.readouterr().out)["figures"])


def test_count_kernels(script, capsys) -> None:
    script("count_kernels").main(["--smoke", "--json"])
    out = last_json(capsys.readouterr().out)
    assert out["syncs_per_decode_step"] == 0 and out["decode_b1"] > 0
    assert out["prefill_miss"] > out["prefill_hit"] > 0 and out["host_us_step_b64"] > 0
    # a grammar's mask: the same graph, no sync, its table uploaded without blocking
    assert out["decode_b64_constrained"] == out["decode_b64"]
    assert out["syncs_per_decode_step_constrained"] == 0
    assert out["uploads_blocking_per_decode_step_constrained"] == 0
    assert out["uploads_nonblocking_per_decode_step_constrained"] >= 2  # the step's + the mask


def test_eval_tiny(script, capsys) -> None:
    script("eval_tiny").main(["--smoke", "--json", "--adapter", "french"])
    assert last_json(capsys.readouterr().out)["n"] == 2


def test_eval_tiny_quick(script, capsys) -> None:
    script("eval_tiny_quick").main(["--smoke"])
    out = last_json(capsys.readouterr().out)
    assert out["n"] == 2 and 0 <= out["query_acc"] <= 1


def test_make_demo_assets(script, tmp_path) -> None:
    """The scenes it writes are the ones the package ships (same seed, same drawing)."""
    from kestrel.tiny import DEMO_DIR

    script("make_demo_assets").main(["--smoke", "--out", str(tmp_path)])
    shipped = json.loads((DEMO_DIR / "scenes.json").read_text())
    assert json.loads((tmp_path / "scenes.json").read_text()) == shipped
    assert len(list(tmp_path.glob("scene_*.png"))) == len(shipped["scenes"])


def test_model_report(script, capsys) -> None:
    script("model_report").main(["--smoke"])
    out = capsys.readouterr().out
    assert "16-token prefill after the image prefix" in out and "params" in out


def test_package_map(script, capsys, tmp_path) -> None:
    png = tmp_path / "map.png"
    argv = ["--smoke", "--png", str(png)] if importlib.util.find_spec("matplotlib") else []
    script("package_map").main(argv or ["--smoke"])
    out = capsys.readouterr().out
    assert "imports running back up: 0" in out and "import circles between files: 0" in out
    assert not argv or png.stat().st_size > 0


def test_profile_request(script, capsys) -> None:
    script("profile_request").main(["--smoke", "--json"])
    figures = last_json(capsys.readouterr().out)["figures"]
    assert figures["decode step"]["total"]["median"] > 0 and "hit / miss TTFT" in figures


def test_soak_server(script, capsys) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("soak_server.py reads /proc (Linux)")
    script("soak_server").main(["--smoke"])
    out = capsys.readouterr().out
    served = int(out.split("requests: ")[1].split()[0])
    assert served > 0 and ", 0 failed" in out


def test_trace_image_route(script, capsys) -> None:
    script("trace_image_route").main(["--smoke"])
    out = capsys.readouterr().out
    assert out.startswith(" 1. engine/") and "modules entered:" in out
    assert "was not reached" not in out  # the route reaches the runtime's encoder call


def test_train_tiny(script, capsys, tmp_path) -> None:
    """Two base steps and one adapter step, to a checkpoint that loads; its training state
    exported the way ``eval_tiny_quick.py --state`` reads it."""
    from kestrel.moondream import MoondreamModel

    train = script("train_tiny")
    with pytest.raises(SystemExit):  # never over the bundled model by default
        train.main(["--smoke"])
    out, state = tmp_path / "model", tmp_path / "state"
    train.main(["--smoke", "--out", str(out), "--state-dir", str(state)])
    assert (out / "lora-french" / "adapter.safetensors").exists()
    MoondreamModel.from_pretrained(out)
    exported = tmp_path / "exported"
    exported.mkdir()
    script("eval_tiny_quick").export_state(state, exported)
    MoondreamModel.from_pretrained(exported)
