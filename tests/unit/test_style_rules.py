"""The house rules read from the syntax (docs/architecture.md, "The map"): one typing dialect,
slotted dataclasses, functions under 60 lines (bar named exemptions that must still be needed),
``import kestrel`` / ``import kestrel_kernels`` loading no optional extra's module, and the
scripts' two: no private member touched from ``scripts/`` (bar named third-party exemptions),
and every script with a ``main`` named by a test. Each check fails naming ``file:line`` and the
function or class; a planted breach shows that it can.

``tests/unit/test_kernels.py`` and ``tests/unit/test_compile_op.py`` check that *using* the
kernels and the compile op loads neither FlashAttention nor dynamo; here the plain imports are
held to every optional module at once."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

from kestrel.testing.layers import SOURCES, copy_sources
from kestrel.testing.script_rules import PRIVATE_ACCESS, private_access, scripts_without_test
from kestrel.testing.style_rules import (
    EXTRA_MODULES,
    LONG_FUNCTIONS,
    MAX_FUNCTION_LINES,
    OPTIONAL_MODULES,
    eager_imports,
    extra_only_modules,
    function_lengths,
    long_functions,
    style_breaches,
    typing_dialect,
    unslotted_dataclasses,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    return style_breaches(ROOT, imports=False)


@pytest.mark.parametrize(
    "rule",
    [
        "modules off the typing dialect",
        "dataclasses without slots",
        f"functions over {MAX_FUNCTION_LINES} lines",
        "private members touched by scripts",
        "scripts run by no test",
    ],
)
def test_rule_holds(found, rule: str) -> None:
    assert not found[rule], f"{rule}:\n" + "\n".join(found[rule])


def test_import_loads_no_optional_module() -> None:
    """The listed modules, and every module installed here that only the extras (or their own
    dependencies: Ray's pyarrow, matplotlib's fontTools) bring in."""
    derived = extra_only_modules(ROOT) if find_spec("tomllib") else set()  # 3.11+ reads TOML
    installed = {m for m in ("starlette", "ray", "pyarrow", "matplotlib", "triton") if find_spec(m)}
    if find_spec("tomllib"):
        assert installed <= derived  # the derivation reaches through the extras' dependencies
    found = eager_imports(ROOT, forbidden=(*OPTIONAL_MODULES, *sorted(derived)))
    assert not found, "\n".join(found)


def test_every_optional_extra_is_listed() -> None:
    """Each requirement of each extra in pyproject.toml has its modules listed, and nothing
    listed is stale; a core dependency is never listed."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}

    extras = set().union(*(names(r) for r in project["optional-dependencies"].values()))
    assert extras == set(EXTRA_MODULES)
    assert not names(project["dependencies"]) & extras
    assert {m for mods in EXTRA_MODULES.values() for m in mods} <= set(OPTIONAL_MODULES)


def test_the_listed_modules_are_what_the_extras_install() -> None:
    """Where an extra's distribution is installed, at least one listed module is its own."""
    owners = importlib.metadata.packages_distributions()
    norm = {d: re.sub(r"[-_.]+", "-", d).lower() for d in EXTRA_MODULES}
    checked = 0
    for dist, modules in EXTRA_MODULES.items():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue  # flash-attn-4 on a CPU machine
        mine = {
            m
            for m in modules
            if norm[dist] in {re.sub(r"[-_.]+", "-", o).lower() for o in owners.get(m, ())}
        }
        assert mine, f"{dist} installs none of {modules}"
        checked += 1
    assert checked >= len(EXTRA_MODULES) // 2  # the test extra's environment has most of them


def _copy(tmp_path: Path) -> Path:
    return copy_sources(ROOT, tmp_path, SOURCES)  # no tests/: every script named by none


NAMING = "scripts run by no test"  # (in a copy without tests/, every script with a main)


def _write(root: Path, rel: str, source: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_planted_breaches_in_a_copy_are_caught(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    clean = style_breaches(root, imports=False)
    assert not any(v for k, v in clean.items() if k != NAMING)  # as clean as the tree
    tokens = root / "kestrel" / "tokens.py"
    tokens.write_text(tokens.read_text().replace("from __future__ import annotations\n", "", 1))
    line = ast.parse(tokens.read_text()).body[1].lineno  # its first statement after the doc
    pool = root / "kestrel" / "kv" / "pool.py"
    pool.write_text(
        pool.read_text()
        + "\nfrom typing import Optional\n\n\n@dataclass(frozen=True)\nclass Planted:\n"
        + "    x: Optional[int] = None\n"
    )
    n = len(pool.read_text().splitlines())
    body = "".join(f"    y = {i}\n" for i in range(MAX_FUNCTION_LINES + 1))
    _write(
        root,
        "scripts/planted.py",
        f'"""Doc."""\n\nfrom __future__ import annotations\n\n\ndef f():\n    """Doc."""\n{body}',
    )
    found = style_breaches(root, imports=False)
    assert found["modules off the typing dialect"] == [
        f"kestrel/kv/pool.py:{n - 5}: from typing import Optional",
        f"kestrel/tokens.py:{line}: does not start with from __future__ import annotations",
    ]
    assert found["dataclasses without slots"] == [
        f"kestrel/kv/pool.py:{n - 1} Planted: @dataclass without slots=True"
    ]
    assert found[f"functions over {MAX_FUNCTION_LINES} lines"] == [
        f"scripts/planted.py:6 f: {MAX_FUNCTION_LINES + 1} lines"
    ]
    doc = '"""Doc."""\n\nfrom __future__ import annotations\n\n\n'
    name = "_".join(("planted", "main"))  # no string in the tests names it
    _write(root, f"scripts/{name}.py", doc + "def main(engine):\n    return engine._runner\n")
    assert private_access(root) == [f"scripts/{name}.py:7 main: engine._runner (a private member)"]
    assert set(scripts_without_test(root)) - set(clean[NAMING]) == {
        f"scripts/{name}.py:6 main: no test names {name!r} (run it, --smoke)"
    }


def test_the_typing_dialect_reads_the_syntax(tmp_path: Path) -> None:
    _write(tmp_path, "kestrel/doc_only.py", '"""Only a docstring."""\n')
    _write(tmp_path, "kestrel/empty.py", "")
    _write(
        tmp_path,
        "kestrel/good.py",
        '"""D."""\n\nfrom __future__ import annotations\n\nX: dict[str, int | None] = {}\n',
    )
    _write(tmp_path, "kestrel/bare.py", "X = 1  # from __future__ import annotations\n")
    _write(tmp_path, "kestrel/late.py", "from __future__ import division, annotations\nimport os\n")
    _write(
        tmp_path,
        "kestrel/old.py",
        """\
        from __future__ import annotations

        import typing as t
        from typing import Callable, List

        def f(x: t.Union[int, str], g: Callable) -> List[int]: ...
        """,
    )
    assert typing_dialect(tmp_path, ("kestrel",)) == [
        "kestrel/bare.py:1: does not start with from __future__ import annotations",
        "kestrel/old.py:4: from typing import List",
        "kestrel/old.py:6: t.Union",
    ]


def test_every_dataclass_form_is_read(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "kestrel/d.py",
        """\
        from __future__ import annotations

        import dataclasses
        from dataclasses import dataclass

        @dataclass
        class A: ...

        @dataclass(frozen=True)
        class B: ...

        @dataclasses.dataclass(slots=False)
        class C: ...

        @dataclasses.dataclass(frozen=True, slots=True)
        class D: ...

        @dataclass(slots=True, eq=False)
        class E: ...

        class F: ...
        """,
    )
    assert unslotted_dataclasses(tmp_path, ("kestrel",)) == [
        "kestrel/d.py:7 A: @dataclass without slots=True",  # the class line, not the decorator
        "kestrel/d.py:10 B: @dataclass without slots=True",
        "kestrel/d.py:13 C: @dataclass without slots=True",
    ]


def test_function_length_is_the_body_past_the_docstring(tmp_path: Path) -> None:
    filler = [f"        y = {i}" for i in range(MAX_FUNCTION_LINES - 1)]
    source = [
        "class K:",
        "    def at_limit(self):",
        '        """A docstring',
        "        of three lines",
        '        is not counted."""',
        "        x = 0",
        *filler,
        "    def over(self):",
        "        def inner():",
        "            return 1",
        *filler,
    ]
    _write(tmp_path, "kestrel/f.py", "\n".join(source) + "\n")
    lengths = function_lengths(tmp_path, ("kestrel",))
    assert lengths["kestrel/f.py: K.at_limit"] == MAX_FUNCTION_LINES
    assert lengths["kestrel/f.py: K.over"] == MAX_FUNCTION_LINES + 1
    assert lengths["kestrel/f.py: K.over.inner"] == 1
    assert long_functions(tmp_path, exempt={}, folders=("kestrel",)) == [
        f"kestrel/f.py:{MAX_FUNCTION_LINES + 6} K.over: {MAX_FUNCTION_LINES + 1} lines"
    ]
    exempt = {"kestrel/f.py: K.over": "planted", "kestrel/f.py: K.at_limit": "not needed"}
    exempt["kestrel/f.py: gone"] = "renamed away"
    assert long_functions(tmp_path, exempt=exempt, folders=("kestrel",)) == [
        f"kestrel/f.py: K.at_limit: exempted but {MAX_FUNCTION_LINES} lines (stale exemption)",
        "kestrel/f.py: gone: exempted but no such function (stale exemption)",
    ]


def test_the_exemptions_are_exact_names_with_reasons() -> None:
    lengths = function_lengths(ROOT)
    for name, why in LONG_FUNCTIONS.items():
        assert lengths[name] > MAX_FUNCTION_LINES, name
        assert len(why.split()) >= 5, name


def test_a_planted_eager_import_is_caught(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    face = root / "kestrel" / "__init__.py"
    face.write_text(face.read_text() + "\nimport kestrel.server  # noqa\n")
    kernels = root / "kestrel_kernels" / "__init__.py"
    kernels.write_text(kernels.read_text() + "\nimport torch._dynamo  # noqa\n")
    forbidden = OPTIONAL_MODULES
    want = {"torch._dynamo", "kestrel.server"}  # (dynamo brings triton along)
    if find_spec("tomllib") and find_spec("sortedcontainers"):  # hypothesis's: test extra only
        shutil.copy(ROOT / "pyproject.toml", root)
        forbidden = (*forbidden, *sorted(extra_only_modules(root)))
        face.write_text(face.read_text() + "import sortedcontainers  # noqa\n")
        want.add("sortedcontainers")
    found = eager_imports(root, forbidden=forbidden)
    assert {f"import kestrel, kestrel_kernels loads {m}" for m in want} <= set(found), found


def test_private_access_reads_the_syntax(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "scripts/s.py",
        """\
        from __future__ import annotations

        import torch._dynamo
        from kestrel.engine import setup
        from kestrel.engine.setup import _load
        from kestrel._private import x

        class Bench:
            def run(self, engine, point):
                self._rows = engine._runner.lookahead  # self is fine, engine is not
                setattr(engine, "_scheduler", None)
                return point._replace(x=1), type(self).__name__, engine.__dict__

        def main():
            setup._load = None
        """,
    )
    assert private_access(tmp_path, exempt={}) == [
        "scripts/s.py:3 <module>: import torch._dynamo (a private member)",
        "scripts/s.py:5 <module>: from kestrel.engine.setup import _load (a private member)",
        "scripts/s.py:6 <module>: from kestrel._private import ... (a private member)",
        "scripts/s.py:10 Bench.run: engine._runner (a private member)",
        "scripts/s.py:11 Bench.run: setattr(..., '_scheduler') (a private member)",
        "scripts/s.py:15 main: setup._load (a private member)",
    ]
    exempt = {"scripts/s.py: engine._runner": "a planted reason", "scripts/s.py: gone._x": "old"}
    found = private_access(tmp_path, exempt=exempt)
    assert "scripts/s.py:10 Bench.run: engine._runner (a private member)" not in found
    assert found[-1] == "scripts/s.py: gone._x: exempted but not found (stale exemption)"


def test_the_private_access_exemptions_are_exact_sites_with_reasons() -> None:
    assert not private_access(ROOT)  # none stale, none missing
    for key, why in PRIVATE_ACCESS.items():
        assert key.startswith("scripts/") and ": " in key, key
        assert len(why.split()) >= 8, key


def test_every_script_with_a_main_is_named_by_a_test(tmp_path: Path) -> None:
    main = 'def main(argv=None):\n    pass\n\n\nif __name__ == "__main__":\n    main()\n'
    for name in ("named", "by_path", "in_a_docstring", "unnamed"):
        _write(tmp_path, f"scripts/{name}.py", main)
    _write(tmp_path, "scripts/shared.py", "import os\n\nX = 1\n\n\ndef f():\n    os.sync()\n")
    _write(tmp_path, "scripts/runs_on_import.py", "import os\n\nos.sync()\n")
    _write(
        tmp_path,
        "tests/test_x.py",
        '''\
        """Runs scripts/in_a_docstring.py (a docstring names nothing)."""

        import importlib

        def test_it():
            """in_a_docstring"""
            importlib.import_module("named").main(["--smoke"])
            assert SCRIPTS / "by_path.py"
        ''',
    )
    assert scripts_without_test(tmp_path) == [
        "scripts/in_a_docstring.py:1 main: no test names 'in_a_docstring' (run it, --smoke)",
        "scripts/runs_on_import.py:3: runs code on import and has no main",
        "scripts/unnamed.py:1 main: no test names 'unnamed' (run it, --smoke)",
    ]
