"""The shape issue #50 item 1 promised the attention entry, read from the syntax (``ast``):

- no function in ``kestrel_kernels/`` takes more than ``MAX_PARAMETERS`` parameters, bar the
  one ``torch.library`` op boundary (``WIDE_ALLOWED``: a schema takes tensors and scalars one
  by one, not values made of them) and ``@triton.jit`` kernels (their parameters are the
  launch ABI: pointers, strides and constexprs, which Triton takes one by one);
- the attention backend is an object below the runtime's constructor: no parameter or
  dataclass field named ``backend`` / ``attention_backend`` is annotated with ``str`` (or
  defaults to a string) in ``kestrel/runtime/``, ``kestrel/moondream/`` or ``kestrel_kernels/``,
  bar the constructor's option and the op boundary (``STRING_ALLOWED``);
- ``kestrel_kernels/__init__.py`` is a face: a docstring, imports and ``__all__``, nothing else.

Each exemption must still be needed (a stale one fails), and planted breaches show that each
check can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_PARAMETERS = 8
WIDE_ALLOWED = {"kestrel_kernels/compile_op.py: _paged_attention_op"}
STRING_ALLOWED = {
    "kestrel/runtime/build.py: RuntimeOptions.attention_backend",  # the constructor's option
    "kestrel_kernels/compile_op.py: _paged_attention_op.backend",  # the op's schema: str
}
BACKEND_NAMES = ("backend", "attention_backend")
BELOW_CONSTRUCTOR = ("kestrel/runtime", "kestrel/moondream", "kestrel_kernels")


def _modules(root: Path, folders: tuple[str, ...]) -> Iterator[tuple[str, ast.Module]]:
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root).as_posix(), ast.parse(path.read_text())


def _defs(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class with its qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _defs(node, name + ".")


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    extra = [x for x in (a.vararg, a.kwarg) if x is not None]
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *extra]


def _triton_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def wide_functions(root: Path) -> dict[str, int]:
    """``path: qualified name`` -> parameter count, for every function of ``kestrel_kernels/``
    over ``MAX_PARAMETERS`` that is not a Triton kernel."""
    found = {}
    for rel, tree in _modules(root, ("kestrel_kernels",)):
        for name, node in _defs(tree):
            if isinstance(node, ast.ClassDef) or _triton_jit(node):
                continue
            n = len(_parameters(node))
            if n > MAX_PARAMETERS:
                found[f"{rel}: {name}"] = n
    return found


def _stringly(annotation: ast.expr | None, default: ast.expr | None) -> bool:
    """An annotation naming ``str`` (also inside a string annotation), or a string default."""
    if isinstance(default, ast.Constant) and isinstance(default.value, str):
        return True
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "str" for n in ast.walk(annotation))


def _function_strings(name: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = [
        *zip(positional, defaults, strict=True),
        *zip(a.kwonlyargs, a.kw_defaults, strict=True),
    ]
    for arg, default in pairs:
        if arg.arg in BACKEND_NAMES and _stringly(arg.annotation, default):
            yield f"{name}.{arg.arg}"


def backend_strings(root: Path) -> list[str]:
    """``path: qualified name`` of every parameter or class field named ``backend`` /
    ``attention_backend`` that is annotated ``str`` or defaults to a string, below the
    runtime's constructor."""
    found = []
    for rel, tree in _modules(root, BELOW_CONSTRUCTOR):
        for name, node in _defs(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.AnnAssign)
                        and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in BACKEND_NAMES
                        and _stringly(stmt.annotation, stmt.value)
                    ):
                        found.append(f"{rel}: {name}.{stmt.target.id}")
            else:
                found += [f"{rel}: {s}" for s in _function_strings(name, node)]
    return found


def face_breaches(init: Path) -> list[str]:
    """Statements of a package's ``__init__`` other than its docstring, imports and
    ``__all__``, and ``__all__`` names it does not import."""
    tree = ast.parse(init.read_text())
    bad, imported, exported = [], set(), []
    for i, stmt in enumerate(tree.body):
        if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
            continue
        is_all = isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == [
            "__all__"
        ]
        if is_all:
            exported = [e.value for e in stmt.value.elts]  # type: ignore[attr-defined]
            continue
        bad.append(f"line {stmt.lineno}: {ast.unparse(stmt).splitlines()[0]}")
    bad += [f"__all__ names {name!r}, which is not imported" for name in exported
            if name not in imported]  # fmt: skip
    return bad


# --- the rules hold ----------------------------------------------------------------------------


def test_no_kernel_function_takes_more_than_eight_parameters() -> None:
    wide = wide_functions(ROOT)
    assert set(wide) == WIDE_ALLOWED, (
        f"functions over {MAX_PARAMETERS} parameters (name, count): {wide}; the allowed "
        f"(and still needed) ones: {sorted(WIDE_ALLOWED)}"
    )


def test_the_backend_is_an_object_below_the_constructor() -> None:
    found = set(backend_strings(ROOT))
    assert found == STRING_ALLOWED, (
        f"backend strings below the runtime's constructor: {sorted(found - STRING_ALLOWED)}; "
        f"stale exemptions: {sorted(STRING_ALLOWED - found)}"
    )


def test_the_kernels_package_init_is_a_face() -> None:
    assert face_breaches(ROOT / "kestrel_kernels" / "__init__.py") == []


# --- the checks can fail -------------------------------------------------------------------------


def _plant(tmp_path: Path, rel: str, code: str) -> Path:
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    return path


def test_planted_breaches_are_found(tmp_path: Path) -> None:
    _plant(tmp_path, "kestrel_kernels/wide.py", "def f(a, b, c, d, e, f, g, h, *, i=0): ...\n"
           "@triton.jit\ndef k(a, b, c, d, e, f, g, h, i): ...\n"
           "class C:\n    def m(self, a, b, c, d, e, f, g, h): ...\n")  # fmt: skip
    assert wide_functions(tmp_path) == {"kestrel_kernels/wide.py: f": 9,
                                        "kestrel_kernels/wide.py: C.m": 9}  # fmt: skip
    _plant(tmp_path, "kestrel/runtime/x.py", "def run(x, backend: str): ...\n"
           "def fine(x, backend: object, compiler: str = 'inductor'): ...\n"
           "class S:\n    attention_backend: str | None = None\n"
           "    def go(self, *, backend='auto'): ...\n")  # fmt: skip
    _plant(tmp_path, "kestrel/moondream/y.py", "def g(backend: 'str | None' = None): ...\n")
    assert sorted(backend_strings(tmp_path)) == [
        "kestrel/moondream/y.py: g.backend",
        "kestrel/runtime/x.py: S.attention_backend",
        "kestrel/runtime/x.py: S.go.backend",
        "kestrel/runtime/x.py: run.backend",
    ]
    init = _plant(tmp_path, "pkg/__init__.py", '"""Doc."""\nfrom a import b\n'
                  "__all__ = ['b', 'c']\n\ndef helper():\n    return 1\n")  # fmt: skip
    assert face_breaches(init) == [
        "line 5: def helper():",
        "__all__ names 'c', which is not imported",
    ]
