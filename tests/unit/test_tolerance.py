"""The tests' one tolerance rule (tests/tolerance.py) and the guard that keeps it the only one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.tolerance import ULPS, assert_close, bound, relative_error

TESTS = Path(__file__).resolve().parents[1]
# Library comparisons that take per-element atol/rtol; tests call tests/tolerance.py instead.
RAW = {"assert_close", "allclose", "isclose", "assert_allclose"}
LIBRARIES = {"torch", "np", "numpy", "testing"}


def test_a_bound_scaled_to_the_largest_magnitude_passes_cancellation_noise() -> None:
    """The AVX2 failure in small: an element near zero moved by rounding of the tensor's scale
    fails a per-element 1e-5 bound and passes the scaled one."""
    want = torch.tensor([57.0, -31.0, 1e-3, 0.0])
    got = want + torch.tensor([0.0, 0.0, 1.8e-5, -1.2e-5])
    assert not torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # the old rule's failure
    assert assert_close(got, want, rel=1e-5) == pytest.approx(1.8e-5, rel=1e-3)


def test_a_wrong_element_fails_naming_it() -> None:
    want = torch.linspace(-3, 3, 50)
    got = want.clone()
    got[17] += 0.01 * 3  # one element off by 1% of the scale
    with pytest.raises(AssertionError, match=r"logits: max \|err\| 0\.03 .* worst element 17"):
        assert_close(got, want, rel=1e-3, msg="logits")


def test_the_dtype_sets_the_least_bound() -> None:
    want = torch.ones(8) * 2.0
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert bound(want) == pytest.approx(ULPS * eps32 * 2.0)
    assert bound(want, dtype=torch.bfloat16) == pytest.approx(ULPS * eps16 * 2.0)
    assert bound(want, rel=1e-3, floor=0.5) == pytest.approx(1e-3 * 2.0 + 0.5)
    got = want.bfloat16().float() + 0.9 * bound(want, dtype=torch.bfloat16)
    assert_close(got, want, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(got, want)  # float32 rounding does not allow a bfloat16 ulp


def test_shape_and_non_finite_mismatches_fail() -> None:
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(3), torch.zeros(1, 3))
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
    inf = torch.tensor([float("inf"), 1.0])
    assert_close(inf.clone(), inf)  # the same infinities agree
    assert relative_error(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])) == 0.25
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def raw_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, call) of every per-element float comparison in ``source``: a library
    ``assert_close``/``allclose``/``isclose``/``assert_allclose`` (torch, torch.testing, numpy),
    or any call of such a name given ``atol``/``rtol`` keywords."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in RAW:
            continue
        base = func.value if isinstance(func, ast.Attribute) else None
        library = isinstance(base, ast.Name | ast.Attribute) and (
            (base.id if isinstance(base, ast.Name) else base.attr) in LIBRARIES
        )
        tolerances = {k.arg for k in node.keywords} & {"atol", "rtol"}
        if library or tolerances:
            found.append((node.lineno, ast.unparse(node)[:80]))
    return sorted(found)


def test_the_guard_finds_the_forms_it_forbids() -> None:
    bad = (
        "torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)\n"
        "assert torch.allclose(a, b)\n"
        "assert not np.allclose(a, b, rtol=1e-6)\n"
        "from torch.testing import assert_close\n"
        "assert_close(a, b, rtol=1e-6)\n"
    )
    assert [line for line, _ in raw_comparisons(bad)] == [1, 2, 3, 5]
    good = "assert_close(a, b, rel=1e-5)\nnear(a, b)\nassert torch.equal(a, b)\n"
    assert raw_comparisons(good) == []


# The guard's own tests above call torch.allclose on purpose (to show the old rule's failure).
ALLOWED = {("unit/test_tolerance.py", "torch.allclose(got, want, atol=1e-05, rtol=1e-05)")}


def test_no_per_element_tolerance_in_the_tests() -> None:
    """Every computed-float comparison in tests/ goes through tests/tolerance.py."""
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel == "tolerance.py":
            continue
        for line, call in raw_comparisons(path.read_text()):
            if (rel, call) not in ALLOWED:
                offenders.append(f"tests/{rel}:{line}: {call}")
    assert not offenders, (
        "per-element float comparisons (use tests.tolerance.assert_close, a bound scaled to the "
        "reference's largest magnitude; torch.equal where bit-exact by construction):\n"
        + "\n".join(offenders)
    )
