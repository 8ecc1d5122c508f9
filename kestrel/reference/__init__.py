"""The project's own oracle: the uncached, one-request-at-a-time eager path driving the same
skills (``eager.py``, results in ``types.py``). Checkpoint makers for tests live in
``kestrel.testing``, the training forward beside the tiny model (``kestrel.tiny``)."""

from __future__ import annotations
