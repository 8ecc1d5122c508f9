"""HTTP errors of the server: one exception type, one JSON body shape, one status table.

Every error response is ``{"error": {"type", "message"}, "request_id"}``. Engine errors map to
statuses by class (:func:`from_exception`); anything unexpected is a 500 whose message names
no internals (the traceback goes to the server log).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kestrel.errors import (
    CapacityError,
    EngineClosedError,
    InvalidInputError,
    KestrelError,
    ModelError,
    OverloadedError,
    PromptTooLongError,
    UnknownAdapterError,
    UnsupportedError,
)
from kestrel.skills.segment import NoPathError

__all__ = ["CLIENT_CLOSED", "ApiError", "error_body", "from_exception"]

# nginx's "client closed request": recorded in metrics when the client left; never sent.
CLIENT_CLOSED = 499

# Most specific class first.
_ENGINE_ERRORS: tuple[tuple[type[KestrelError], int, str], ...] = (
    (PromptTooLongError, 400, "prompt_too_long"),
    (InvalidInputError, 400, "invalid_request"),
    (UnknownAdapterError, 404, "unknown_adapter"),
    (CapacityError, 503, "capacity"),  # the request can never fit this server's KV pool
    (EngineClosedError, 503, "unavailable"),
    (OverloadedError, 503, "overloaded"),  # the image memory budget stayed full: retry
    (UnsupportedError, 501, "unsupported"),  # a skill the model does not have (segment)
    (NoPathError, 501, "unsupported"),  # a model without segmentation stopped after the box
    (ModelError, 500, "model_error"),
    (KestrelError, 500, "engine_error"),
)


class ApiError(Exception):
    """An error response: HTTP ``status``, a stable machine-readable ``type``, a message for
    people, and extra headers (``Retry-After``, ``WWW-Authenticate``)."""

    def __init__(
        self, status: int, type: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.headers = dict(headers or {})


def error_body(err: ApiError, request_id: str) -> dict[str, Any]:
    return {"error": {"type": err.type, "message": err.message}, "request_id": request_id}


def from_exception(exc: BaseException) -> ApiError:
    """The ApiError for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, KestrelError):
        for cls, status, type_ in _ENGINE_ERRORS:
            if isinstance(exc, cls):
                headers = {"Retry-After": "1"} if cls is OverloadedError else None
                return ApiError(status, type_, str(exc), headers)
    return ApiError(500, "internal_error", "the server failed to handle the request")
