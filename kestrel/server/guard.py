"""Who may talk to the server at all: the Host and Origin checks that keep web pages out.

A browser lets any page it shows send requests to ``127.0.0.1``: a form or ``text/plain`` POST
needs no CORS preflight, and a DNS name rebound to ``127.0.0.1`` makes the page's own origin
reach the local port. Three checks close those doors:

- **Content-Type** (:func:`require_json`, called by the model routes): a JSON body must be
  labelled ``application/json``. Pages cannot send that label cross-origin without a preflight,
  which this server only answers for origins it was told to trust.
- **Host** (this middleware, when the server listens on loopback): the ``Host`` header must
  name a loopback address or ``localhost`` (or the host of an allowed origin, for a reverse
  proxy). A rebound name arrives with the attacker's host name and is refused.
- **Origin** (this middleware, always): a request that carries an ``Origin`` must come from
  the server's own origin (the playground page) or from one listed with ``--allow-origin``.

Allowed origins also get CORS headers (Starlette's ``CORSMiddleware``, stacked inside this
one), so a web app served from such an origin can call the API.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kestrel.server.errors import ApiError

__all__ = ["RequestGuard", "is_loopback_host", "normalize_origin", "require_json"]

Refuse = Callable[[ApiError], Response]  # the server's error response (request id, metrics)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 maybe in brackets) is this machine only."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """The name part of a ``Host`` header (``[::1]:2020`` -> ``[::1]``, ``a:80`` -> ``a``)."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1] or host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case (a trailing slash dropped); ``*`` and ``null``
    stay as they are. Raises ValueError for anything else."""
    origin = origin.strip()
    if origin in ("*", "null"):
        return origin
    parts = urlsplit(origin.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
        raise ValueError(f"an origin is scheme://host[:port], got {origin!r}")
    return f"{parts.scheme}://{parts.netloc}".lower()


def require_json(headers: Mapping[str, str]) -> None:
    """415 unless the body is labelled ``application/json`` (parameters such as charset ok)."""
    given = headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != "application/json":
        shown = f"'{given[:60]}'" if given else "none"
        raise ApiError(
            415,
            "unsupported_media_type",
            f"the body must be sent as Content-Type: application/json (got {shown})",
        )


class RequestGuard:
    """ASGI middleware: refuses (403) a foreign ``Origin``, and a non-loopback ``Host`` when
    ``loopback`` is set, before any route runs."""

    def __init__(
        self, app: ASGIApp, *, loopback: bool, allow_origins: Iterable[str], refuse: Refuse
    ) -> None:
        self.app = app
        self.loopback = loopback
        self.origins = self.origins_of(allow_origins)
        self.any_origin = "*" in self.origins
        self.proxy_hosts = frozenset(
            urlsplit(o).hostname or "" for o in self.origins if o not in ("*", "null")
        )
        self.refuse = refuse

    @staticmethod
    def origins_of(allow_origins: Iterable[str]) -> frozenset[str]:
        return frozenset(normalize_origin(o) for o in allow_origins)

    def check(self, headers: Mapping[str, str]) -> None:
        host = headers.get("host", "")
        name = _host_name(host)
        foreign = host and not is_loopback_host(name)
        if self.loopback and foreign and name.strip("[]").lower() not in self.proxy_hosts:
            raise ApiError(
                403,
                "forbidden_host",
                f"this server listens on loopback and answers only requests addressed to "
                f"localhost or a loopback address, not Host: {host[:80]!r}",
            )
        origin = headers.get("origin")
        if origin is None or self.any_origin:
            return
        try:
            normal = normalize_origin(origin)
        except ValueError:
            normal = origin
        if normal in self.origins or (host and normal.split("://", 1)[-1] == host.lower()):
            return
        raise ApiError(
            403,
            "forbidden_origin",
            f"requests from the web page at {origin[:80]!r} are refused; start the server "
            f"with --allow-origin {origin[:80]} to let that site use it",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self.check(headers)
        except ApiError as err:
            await self.refuse(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)
