"""The one rule for comparing computed floating-point tensors in the tests.

Two computations of the same numbers (another kernel, another summation order, a cached path
against an uncached one, an AVX2 CPU against an AVX-512 one) differ by rounding, and rounding
is relative to the *magnitudes being summed*, not to each output element. An element that is
near zero because large terms cancelled carries an error of the order of those large terms'
rounding. A per-element bound (``atol=1e-5, rtol=1e-5``) therefore fails on such elements as
soon as the summation order changes, while a bound scaled to the tensor's largest magnitude
holds on every machine and still catches a real bug (a wrong element is wrong by about the
tensor's scale).

So every comparison of computed floats goes through :func:`assert_close` here:

    |actual - reference| <= max(rel, ULPS * eps(dtype)) * max|reference| + floor

for every element, where ``rel`` is the comparison's stated relative tolerance (a measured or
argued fraction of the tensor's scale), ``eps(dtype)`` the machine epsilon of the precision the
computation ran in (``dtype``, by default the reference's), and ``floor`` an optional absolute
term for quantities that are measured against an absolute error budget (the golden fixtures'
``atol``). Exact equality (``torch.equal``) is kept only where a result is bit-reproducible
by construction (copies, gathers, the same kernel on the same inputs), with a comment saying so.

``tests/unit/test_tolerance.py`` greps the tests for raw ``assert_close``/``allclose`` calls
with ``rtol``/``atol`` and fails naming each file:line, so the per-element form cannot return.
"""

from __future__ import annotations

import torch

__all__ = ["ULPS", "assert_close", "bound", "relative_error"]

# The least bound any comparison gets: this many machine epsilons of the computation's
# precision, relative to the reference's scale (float32: 4.8e-7, bfloat16: 3.1e-2). A result
# rounded once, or summed in another order over terms of about the result's size, lands within
# it; comparisons of longer computations state a larger ``rel``.
ULPS = 4


def _scale(reference: torch.Tensor) -> float:
    if reference.numel() == 0:
        return 0.0
    return float(reference.detach().abs().max().double())


def bound(
    reference: torch.Tensor,
    *,
    rel: float = 0.0,
    floor: float = 0.0,
    dtype: torch.dtype | None = None,
) -> float:
    """The largest absolute error a comparison against ``reference`` allows (see module doc)."""
    eps = torch.finfo(dtype or reference.dtype).eps
    return max(rel, ULPS * eps) * _scale(reference) + floor


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| / max |reference| (inf when the reference is all zeros and the
    two differ; 0 when they are equal)."""
    err = float((actual.detach().double() - reference.detach().double()).abs().max())
    scale = _scale(reference)
    if err == 0.0:
        return 0.0
    return err / scale if scale > 0 else float("inf")


def assert_close(
    actual: torch.Tensor,
    reference: torch.Tensor,
    *,
    rel: float = 0.0,
    floor: float = 0.0,
    dtype: torch.dtype | None = None,
    msg: str = "",
) -> float:
    """Assert ``actual`` equals ``reference`` within :func:`bound`; returns the largest error.

    Shapes must match; a NaN or infinity where the reference is finite fails. Both tensors
    are compared in float64 on the CPU, so the comparison itself adds no rounding."""
    where = f"{msg}: " if msg else ""
    assert isinstance(actual, torch.Tensor), f"{where}expected a tensor, got {type(actual)}"
    assert actual.shape == reference.shape, (
        f"{where}shape {list(actual.shape)} != reference {list(reference.shape)}"
    )
    if dtype is None and reference.dtype.is_floating_point:
        dtype = reference.dtype
    a = actual.detach().cpu().double()
    r = reference.detach().cpu().double()
    finite = torch.isfinite(r)
    assert torch.equal(torch.isfinite(a), finite) and torch.equal(a[~finite], r[~finite]), (
        f"{where}non-finite values differ"
    )
    if not bool(finite.any()):
        return 0.0
    a, r = a[finite], r[finite]
    allowed = bound(r, rel=rel, floor=floor, dtype=dtype or torch.float32)
    err = (a - r).abs()
    worst = int(err.argmax())
    largest = float(err[worst])
    assert largest <= allowed, (
        f"{where}max |err| {largest:.3g} exceeds the bound {allowed:.3g} "
        f"(rel {max(rel, ULPS * torch.finfo(dtype or torch.float32).eps):.3g} x max|reference| "
        f"{_scale(r):.4g} + floor {floor:.3g}); worst element {worst} (of the finite ones): "
        f"actual {float(a[worst]):.6g}, reference {float(r[worst]):.6g}"
    )
    return largest
