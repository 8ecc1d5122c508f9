"""The one error hierarchy of the public API.

Every failure a caller of :class:`kestrel.Engine` can see is a :class:`KestrelError`. Input
errors also subclass ``ValueError`` (and an unknown adapter ``KeyError``), so code written
against plain Python exceptions keeps working.
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "EngineClosedError",
    "InvalidInputError",
    "KestrelError",
    "ModelError",
    "ModelLoadError",
    "OverloadedError",
    "PromptTooLongError",
    "UnknownAdapterError",
    "UnsupportedError",
]


class KestrelError(Exception):
    """Base class of every error the engine reports."""


class InvalidInputError(KestrelError, ValueError):
    """A request that cannot be run as given: bad image, bad settings, empty question..."""


class PromptTooLongError(InvalidInputError):
    """The prompt (image block included) leaves no room for a single generated token."""


class UnknownAdapterError(KestrelError, KeyError):
    """A request named an adapter that is not loaded."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown adapter"


class CapacityError(KestrelError):
    """A request that can never fit the KV page pool or the model context."""


class UnsupportedError(KestrelError):
    """The served model cannot do what was asked: a skill its family does not have."""


class OverloadedError(KestrelError):
    """A limit that frees up as other requests finish was reached (the decoded image memory
    budget): the same request can succeed if sent again shortly."""


class EngineClosedError(KestrelError):
    """The engine was closed before (or while) the request ran."""


class ModelError(KestrelError):
    """An exception inside the model failed this request; the engine keeps serving.

    The original exception is the ``__cause__``.
    """


class ModelLoadError(KestrelError):
    """The model (or an adapter) could not be loaded: missing files, bad config, offline hub."""
