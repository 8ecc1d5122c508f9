"""What the server refuses before any work is done: unauthenticated callers, a full queue,
oversized bodies. No engine calls here.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from kestrel.images import DEFAULT_MAX_PIXELS
from kestrel.server.errors import ApiError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_QUEUE",
    "AdmissionGate",
    "ApiKey",
    "ServerLimits",
    "drain_body",
    "read_body",
]

# Requests admitted at once (queued or running): a client's burst of a few hundred calls fits
# (neither official client retries a 503); each holds its decoded image until it is encoded.
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 32 << 20  # a 12 MP JPEG at quality 95 is ~8 MB as base64
DEFAULT_MAX_IMAGE_PIXELS = DEFAULT_MAX_PIXELS
# After refusing a request whose body is still arriving, read (and drop) up to this much of
# it before answering: a client that is still sending when the server closes the socket gets
# a connection reset instead of the error response.
DRAIN_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """``max_body_bytes``: request bodies above it get 413. ``max_queue``: requests admitted
    at once (queued or running in the engine, or being decoded); one more gets 503 with
    ``Retry-After: retry_after_s``. ``max_image_pixels``: larger images (checked from the
    header, before decoding) get 400."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_queue", "max_image_pixels", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class AdmissionGate:
    """Counts requests in flight; touched only from the event loop thread, so no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def enter(self, retry_after_s: int) -> None:
        """Take a slot or raise the 503 that tells the client to come back later."""
        if self.in_flight >= self.limit:
            raise ApiError(
                503,
                "overloaded",
                f"the server is at its limit of {self.limit} requests in flight; retry shortly",
                {"Retry-After": str(retry_after_s)},
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


class ApiKey:
    """The shared secret of ``--api-key``, sent as ``X-Moondream-Auth: KEY`` (what the moondream
    client sends) or ``Authorization: Bearer KEY``. Both sides are hashed before
    ``hmac.compare_digest``, so the comparison takes the same time whatever the key's length."""

    def __init__(self, key: str) -> None:
        if not key.isascii() or not key.isprintable() or key.split() != [key]:
            raise ValueError("the API key must be non-empty printable ASCII without spaces")
        self._digest = hashlib.sha256(key.encode("ascii")).digest()

    def check(self, headers: Mapping[str, str]) -> None:
        given = headers.get("x-moondream-auth")
        if given is None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
        if given is None:
            raise _unauthorized("missing X-Moondream-Auth header")
        digest = hashlib.sha256(given.encode("latin-1", "replace")).digest()
        if not hmac.compare_digest(digest, self._digest):
            raise _unauthorized("wrong API key")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


def _too_large(limit: int) -> ApiError:
    message = f"the request body is over the limit of {limit:,} bytes"
    return ApiError(413, "payload_too_large", message)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of a Starlette request, refusing (413) as soon as it passes ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def drain_body(request: Request) -> None:
    """Read and drop what is left of the body, up to :data:`DRAIN_BYTES` (see there)."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_BYTES:
                return
    except (RuntimeError, ClientDisconnect):  # already consumed, or the client is gone
        return
