"""The house rules as tests (docs/architecture.md, "The map"): imports point down the layers, no
file imports itself round a circle, the package root holds only its listed modules, no source
file outside tests/ passes 400 lines, the model package imports nothing of the runtime, the
image wing (``kestrel/crops``) stands between the runtime above and the model below, no module
is loaded from its file, and nothing in the packages imports the testing room. Each check fails
naming the offending import or file; a planted breach in a copy of the tree shows that it can."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel.testing.layers import (
    MAX_LINES,
    ROOT_MODULES,
    SOURCES,
    breaches,
    copy_sources,
    file_circles,
    read_house,
    root_modules,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def house():
    return read_house(ROOT)


@pytest.mark.parametrize(
    "rule",
    [
        "imports running back up",
        "import circles between files",
        "root modules beyond the listed ones",
        f"files over {MAX_LINES} lines outside tests/",
        "model package imports beyond itself, tokens and kernels",
        "image wing imports beyond itself, the model, images and kernels",
        "runtime, image wing and model out of layer order",
        "modules loaded by their file path",
        "imports of the testing room from the packages",
    ],
)
def test_rule_holds(house, rule: str) -> None:
    found = breaches(house)[rule]
    assert not found, f"{rule}:\n" + "\n".join(found)


def test_every_listed_root_module_is_there(house) -> None:
    assert root_modules(house) == ROOT_MODULES


def test_the_layers_read_from_the_tree(house) -> None:
    layer = house.layer()
    assert layer["kestrel/cli"] > layer["kestrel/server"] > layer["kestrel/engine"]
    assert layer["kestrel/engine"] > layer["kestrel/scheduler"] > layer["kestrel/skills"]
    assert layer["kestrel/runtime"] > layer["kestrel/prefix_cache"] > layer["kestrel/kv"]
    assert "kestrel/runtime" in house.units["kestrel/engine"]
    assert layer["kestrel/runtime"] > layer["kestrel/crops"] > layer["kestrel/moondream"]
    assert "kestrel/crops" in house.units["kestrel/runtime"]
    assert "kestrel/moondream" in house.units["kestrel/crops"]


def _copy(tmp_path: Path) -> Path:
    return copy_sources(ROOT, tmp_path, SOURCES)


def _plant(root: Path, rel: str, line: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + f"\n{line}\n")


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert not any(breaches(read_house(root)).values())  # the copy is as clean as the tree
    _plant(root, "kestrel/kv/pool.py", "from kestrel.engine.engine import Engine")
    found = breaches(read_house(root))
    back = found["imports running back up"]
    assert back, found
    assert any("kestrel.kv.pool -> kestrel.engine.engine" in b for b in back), back
    assert found["import circles between files"]  # engine reaches kv: now a circle too


def test_planted_breaches_of_the_other_rules_are_caught(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _plant(root, "kestrel/moondream/rope.py", "import kestrel.errors")
    _plant(root, "kestrel/runtime/decode.py", "from kestrel.testing import layers")
    (root / "kestrel" / "extra.py").write_text("X = 1\n")
    long = root / "kestrel_kernels" / "transfer.py"
    long.write_text(long.read_text() + "\n" * MAX_LINES)
    found = breaches(read_house(root))
    assert found["model package imports beyond itself, tokens and kernels"] == [
        "kestrel.moondream.rope -> kestrel.errors"
    ]
    assert found["imports of the testing room from the packages"] == [
        "kestrel.runtime.decode -> kestrel.testing.layers"
    ]
    assert found["root modules beyond the listed ones"] == ["kestrel/extra.py"]
    assert [f.split(":")[0] for f in found[f"files over {MAX_LINES} lines outside tests/"]] == [
        "kestrel_kernels/transfer.py"
    ]


def test_the_wing_stays_between_the_runtime_and_the_model(tmp_path: Path) -> None:
    """The image wing importing the runtime, or the model importing the wing, breaks a rule
    (each also runs an import back up); so does a module loaded from its file."""
    root = _copy(tmp_path)
    _plant(root, "kestrel/crops/maker.py", "from kestrel.runtime import sequence")
    _plant(root, "kestrel/moondream/vision.py", "from kestrel.crops.overlap import CropError")
    _plant(root, "kestrel/crops/procs.py", "import runpy; runpy.run_path('worker.py')")
    found = breaches(read_house(root))
    assert found["image wing imports beyond itself, the model, images and kernels"] == [
        "kestrel.crops.maker -> kestrel.runtime.sequence"
    ]
    assert found["model package imports beyond itself, tokens and kernels"] == [
        "kestrel.moondream.vision -> kestrel.crops.overlap"
    ]
    assert found["runtime, image wing and model out of layer order"]
    assert found["imports running back up"]
    assert [f.split(":")[0] for f in found["modules loaded by their file path"]] == [
        "kestrel/crops/procs.py"
    ]


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert file_circles(graph) == [["a", "b", "c"]]


def test_a_submodule_imported_from_its_package_is_that_submodule(tmp_path: Path) -> None:
    """``from pkg import sub`` is ``import pkg.sub``; ``from pkg import name`` reads pkg's face."""
    pkg = tmp_path / "kestrel_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from kestrel_kernels.sub import f\n")
    (pkg / "sub.py").write_text("def f(): ...\n")
    (pkg / "user.py").write_text("from kestrel_kernels import sub\n")
    (pkg / "face.py").write_text("from kestrel_kernels import f\n")
    (tmp_path / "kestrel").mkdir()
    house = read_house(tmp_path)
    assert house.imports["kestrel_kernels.user"] == {"kestrel_kernels.sub"}
    assert house.imports["kestrel_kernels.face"] == {"kestrel_kernels"}
    assert breaches(house)["import circles between files"] == []
