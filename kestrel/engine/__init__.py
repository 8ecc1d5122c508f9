"""The public ``Engine`` (sync calls and ``submit_*`` futures in ``calls.py``, ``a*`` asyncio twins
in ``aio.py``) and what it builds on the caller's side: the request desk (``desk.py``: drafts,
then submission), requests (``requests.py``), conversations (``chat.py``), the adapter registry,
model loading (``setup.py``) and text streams."""

from __future__ import annotations

from kestrel.engine.engine import Engine

__all__ = ["Engine"]
