"""The scripts/ folder on ``sys.path`` while a test module imports a script as a module (the
scripts import their neighbours, ``harness`` and the like, by their bare names)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SCRIPTS", "on_path"]

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextmanager
def on_path() -> Iterator[Path]:
    """scripts/ first on ``sys.path`` inside the block (a module-scoped fixture's import)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield SCRIPTS
    finally:
        sys.path.remove(str(SCRIPTS))
