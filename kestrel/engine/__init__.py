"""The public ``Engine`` (sync calls, ``submit_*`` futures, ``a*`` asyncio twins) and what it
builds on the caller's side: requests (``requests.py``), the adapter registry, model loading
(``setup.py``) and text streams."""

from __future__ import annotations

from kestrel.engine.engine import Engine

__all__ = ["Engine"]
