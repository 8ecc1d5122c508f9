"""The public ``Engine``, built from one :class:`EngineOptions` (``options.py``; its fields are
also ``Engine``'s keywords), its calls (per skill a sync call, a ``submit_*`` future and an
``a*`` asyncio twin, ``calls.py`` and ``aio.py``, each made from the skill's call value,
``skill_calls.py``) and what it builds on the caller's side: the request desk (``desk.py``:
drafts, then submission), requests (``requests.py``), conversations (``chat.py``), the adapter
registry, model loading (``setup.py``) and text streams."""

from __future__ import annotations

from kestrel.engine.engine import Engine
from kestrel.engine.options import EngineOptions

__all__ = ["Engine", "EngineOptions"]
