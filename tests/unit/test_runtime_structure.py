"""A runtime built in one place (issue #50, item 3): ``runtime/build.py`` makes and starts what
the runtime runs on, ``runtime.py`` stays small, the decode steps are an object the runtime
holds (not a base class), the scheduler's executor is named for what it is, and the names
that were dangling or renamed stay gone. Read from the source and the live classes: no
model is built."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import kestrel.scheduler as scheduler
from kestrel.runtime import build
from kestrel.runtime.decode_steps import DecodeSteps
from kestrel.runtime.executor import BatchExecutor
from kestrel.runtime.runtime import MoondreamRuntime

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "kestrel" / "runtime" / "runtime.py"
MAX_RUNTIME_LINES = 320  # was 398 of the house's 400
# what build.py made the runtime's constructor do once: construction and start-up
BUILT_ELSEWHERE = {"PageTable", "PagedKVCache", "RadixPrefixCache", "pool_pages",
                   "embedding_tier", "host_kv_tier", "choose_decode_kernels", "GraphSet",
                   "CompiledPrefill", "CropPool", "reserve"}  # fmt: skip
GONE = {  # name -> where it must not appear (the renamed and the dangling)
    "ModelRunner": ("kestrel", "scripts", "docs"),
    "RunnerOverloaded": ("kestrel", "scripts", "docs", "tests"),
    "kestrel.runtime.runner": ("kestrel", "scripts", "docs", "tests"),
    "runtime/runner.py": ("kestrel", "scripts", "docs", "tests"),
    "kestrel/kv/host_pool.py": ("kestrel", "scripts", "docs"),
    "kestrel.moondream.prompts": ("kestrel", "scripts", "docs"),
}


def _files(folders: tuple[str, ...]) -> list[Path]:
    out = []
    for folder in folders:
        for pattern in ("*.py", "*.md"):
            out += sorted((ROOT / folder).rglob(pattern))
    return [p for p in out if p.resolve() != Path(__file__).resolve()]


def test_runtime_py_is_small() -> None:
    lines = len(RUNTIME.read_text().splitlines())
    assert lines <= MAX_RUNTIME_LINES, f"runtime.py has {lines} lines"


def test_the_decode_steps_are_held_not_inherited() -> None:
    assert MoondreamRuntime.__bases__ == (object,)
    assert DecodeSteps not in MoondreamRuntime.__mro__
    # the runtime's decode calls are its own methods, each handing over to its decoder
    for name in ("decode_step", "decode_ahead", "settle_ahead", "confirm_ahead"):
        source = inspect.getsource(getattr(MoondreamRuntime, name))
        assert f"self.decoder.{name}(" in source, name
    # the decoder is given what it uses: it reads nothing private of anyone
    tree = ast.parse(inspect.getsource(DecodeSteps))
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr.startswith("_") and not n.attr.startswith("__")]  # fmt: skip
    assert private == [], private


def test_construction_and_start_up_live_in_build_py() -> None:
    """runtime.py names none of what it used to build; build.py names all of it."""

    def names(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        return found | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}

    assert not BUILT_ELSEWHERE & names(RUNTIME), BUILT_ELSEWHERE & names(RUNTIME)
    assert names(Path(build.__file__)) >= BUILT_ELSEWHERE
    assert "_start_up" not in names(RUNTIME)


def test_the_constructor_takes_the_options_by_name() -> None:
    """``MoondreamRuntime(model, tokenizer, **fields)`` as before, or ``options=``; an unknown
    keyword is still a TypeError."""
    params = list(inspect.signature(MoondreamRuntime.__init__).parameters)
    assert params == ["self", "model", "tokenizer", "options", "overrides"]
    fields = [f for f in build.RuntimeOptions.__dataclass_fields__]
    assert {"attention_backend", "kv_cache_pages", "max_batch_size", "cuda_graphs",
            "retain_decoded", "compile", "device_crops"} <= set(fields)  # fmt: skip
    o = build.RuntimeOptions.of(None, max_batch_size=3)
    assert o.max_batch_size == 3 and build.RuntimeOptions.of(o) is o
    with pytest.raises(TypeError, match="bogus"):
        build.RuntimeOptions.of(o, bogus=1)


def test_the_executor_is_named_for_what_it_is() -> None:
    assert BatchExecutor.__module__ == "kestrel.runtime.executor"
    assert {"Executor", "ExecutorOverloaded"} <= set(scheduler.__all__)
    assert not {"ModelRunner", "RunnerOverloaded"} & set(dir(scheduler))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kestrel.runtime.runner")
    executor = inspect.signature(scheduler.Scheduler).parameters["executor"]
    assert executor.annotation in ("Executor", scheduler.Executor)


@pytest.mark.parametrize("name", sorted(GONE))
def test_old_and_dangling_names_are_gone(name: str) -> None:
    found = [str(p.relative_to(ROOT)) for p in _files(GONE[name]) if name in p.read_text()]
    assert found == [], f"{name!r} is still named in {found}"
