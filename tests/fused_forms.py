"""Running the fused ops both ways: the Triton kernels (under the interpreter on a CPU) and
their torch forms, for the tests that compare them."""

from __future__ import annotations

import pytest

from kestrel_kernels import fused

__all__ = ["both", "interpreted"]


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter on, the fused backend restored after the test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = fused.get_fused_backend()
    yield
    fused.set_fused_backend(before)


def both(fn):
    """``fn()`` with the Triton kernels, then with the torch forms."""
    fused.set_fused_backend("triton")
    a = fn()
    fused.set_fused_backend("torch")
    return a, fn()
