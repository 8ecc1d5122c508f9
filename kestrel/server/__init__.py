"""kestrel.server: an HTTP server speaking the protocol of the official ``moondream`` client.

``create_app(engine)`` gives an ASGI app (Starlette) over one :class:`kestrel.Engine` (or any
engine with the members of :class:`kestrel.server.protocol.ServedEngine`);
``kestrel serve`` runs it under uvicorn. The web stack is the optional ``serve`` extra
(``pip install "kestrel[serve]"``): ``import kestrel`` never needs it, and this package
imports it only when an app is made. Routes, payloads, errors and metrics: docs/server.md.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

    from starlette.applications import Starlette

    from kestrel.server.protocol import ServedEngine

__all__ = [
    "SERVE_EXTRA",
    "bind",
    "create_app",
    "missing_dependencies",
    "run_server",
    "tune_allocator",
]

SERVE_EXTRA = 'pip install "kestrel[serve]"'
_MODULES = ("starlette", "uvicorn", "prometheus_client")


def missing_dependencies() -> list[str]:
    """The serve extra's modules that cannot be imported here (empty when all are there)."""
    return [m for m in _MODULES if importlib.util.find_spec(m) is None]


def _require() -> None:
    missing = missing_dependencies()
    if missing:
        raise ImportError(
            f"the Kestrel server needs {', '.join(missing)} (the 'serve' extra): {SERVE_EXTRA}"
        )


def create_app(engine: ServedEngine, **options: Any) -> Starlette:
    """See :func:`kestrel.server.app.create_app` (options: ``api_key``, ``max_body_bytes``,
    ``max_queue``, ``max_image_pixels``, ``retry_after_s``, ``bind_host``, ``allow_origins``)."""
    _require()
    from kestrel.server.app import create_app as make

    return make(engine, **options)


def tune_allocator() -> dict[str, int]:
    """Bound glibc's malloc arenas for a long-running server (see :mod:`kestrel.server.memory`;
    needs no extra). Returns what was applied."""
    from kestrel.server.memory import tune_allocator as tune

    return tune()


def bind(host: str, port: int) -> socket.socket:
    from kestrel.server.serving import bind as bind_socket

    return bind_socket(host, port)


def run_server(app: Any, sock: socket.socket, **options: Any) -> None:
    """Serve under uvicorn until SIGTERM / SIGINT (options: ``log_level``, ``access_log``,
    ``shutdown_timeout``)."""
    _require()
    from kestrel.server.serving import run_server as run

    run(app, sock, **options)
