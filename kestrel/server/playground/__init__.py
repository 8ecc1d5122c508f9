"""The playground: ``GET /`` serves one page for trying the model in a browser.

The page (``static/``: HTML, plain JavaScript modules and CSS, no build step) talks to the
server's own API routes: ``/v1/chat/completions`` and the skill routes, ``/v1/health`` for the
model and its adapters, ``/v1/stats`` to learn whether an API key is needed. It loads nothing
from anywhere else, and its Content-Security-Policy says so. The page and its files need no API
key (they hold no data); the API routes it calls keep their own checks.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

__all__ = ["ASSETS", "STATIC", "playground_routes"]

STATIC = Path(__file__).parent / "static"
ASSETS = "/playground"  # where the page's scripts and stylesheet are served
# Same origin only: no CDN, no remote fonts; images are picked files (data: / blob: URLs).
_POLICY = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": _POLICY, "Cache-Control": "no-cache"}


async def _page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)


def playground_routes() -> list[BaseRoute]:
    """``GET /`` (the page) and ``GET /playground/<file>`` (its scripts and stylesheet)."""
    return [
        Route("/", _page, methods=["GET"]),
        Mount(ASSETS, app=StaticFiles(directory=STATIC), name="playground"),
    ]
