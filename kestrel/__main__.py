"""``python -m kestrel``: the ``kestrel`` command line."""

from __future__ import annotations

from kestrel.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
