"""Running an app under uvicorn on a socket bound beforehand, with a graceful SIGTERM.

Binding first lets the caller fail fast on a taken port, learn the real port (``--port 0``)
and announce it before the event loop starts; once the socket listens, connections made
before uvicorn runs wait in the backlog. On SIGTERM or SIGINT
uvicorn stops accepting, lets in-flight requests finish (up to ``shutdown_timeout`` seconds,
then cancels them, which cancels their engine requests) and returns.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from kestrel.server.memory import trim

__all__ = ["bind", "run_server"]


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 or IPv6 as ``host`` resolves), not yet
    listening: the port is taken (a clash fails now) but connections are refused until
    ``listen()`` (the caller's, or uvicorn's when it starts)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it once it is done, to the handler that was
    there before it started; with the default handler, SIGTERM would then kill the process
    (status 143) after a clean shutdown. A no-op handler meanwhile makes it a normal return."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(
    app: Any,
    sock: socket.socket,
    *,
    log_level: str = "info",
    access_log: bool = False,
    shutdown_timeout: float = 30.0,
) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM / SIGINT; returns after a graceful shutdown."""
    import uvicorn

    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout,
    )
    trim()  # the model load's temporaries go back to the system before serving starts
    with _signals_end_quietly():
        uvicorn.Server(config).run(sockets=[sock])
