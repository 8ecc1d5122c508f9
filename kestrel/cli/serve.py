"""``kestrel serve``: the HTTP API of the official ``moondream`` client, over one Engine.

Needs the ``serve`` extra (``pip install "kestrel[serve]"``); the server modules are imported
only when the command runs. The port is bound before the model loads (a taken port fails at
once) and listens once the model is ready; SIGTERM or Ctrl-C shut it down gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from kestrel.errors import KestrelError

from . import common

API_KEY_ENV = "KESTREL_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the moondream HTTP API (md.vl(endpoint=...)); needs kestrel[serve]",
        description="Serve the model over HTTP with the API of the official moondream client: "
        "POST /v1/query, /v1/caption, /v1/point, /v1/detect; GET /v1/health, /v1/stats, "
        "/metrics. Stop with SIGTERM or Ctrl-C (in-flight requests finish first).",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=_port, default=2020, help="0 picks a free port")
    server.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require X-Moondream-Auth: KEY on every route but /v1/health "
        f"(default: ${API_KEY_ENV})",
    )
    server.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        type=_adapter_spec,
        default=[],
        metavar="NAME=PATH",
        help='load a LoRA adapter for requests with "adapter": NAME (repeatable)',
    )
    limits = parser.add_argument_group("limits")
    for flag, help_text in (
        ("--max-queue", "requests in flight before 503 (default: 4 x --max-batch-size)"),
        ("--max-body-bytes", "request body limit, 413 above (default: 32 MiB)"),
        ("--max-image-pixels", "image size limit, 400 above (default: 50,000,000)"),
    ):
        limits.add_argument(
            flag, type=common.positive_int, default=None, metavar="N", help=help_text
        )
    limits.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may take to finish",
    )
    logs = parser.add_argument_group("logging")
    logs.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    logs.add_argument("--access-log", action="store_true", help="log every request")
    common.add_engine_options(parser)
    parser.set_defaults(run=run, adapter=None)  # adapter: the one-file option of other commands


def run(args: argparse.Namespace) -> int:
    from kestrel import server

    if server.missing_dependencies():
        raise KestrelError(f"kestrel serve needs the 'serve' extra: {server.SERVE_EXTRA}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    _check_before_load(args, api_key)
    try:
        sock = server.bind(args.host, args.port)
    except OSError as exc:
        raise common.UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    with sock, common.open_engine(args) as engine:
        for name, path in args.adapters:
            engine.load_adapter(name, path)
        app = server.create_app(engine, api_key=api_key, **_limits(args))
        sock.listen(2048)
        _announce(args, sock.getsockname()[1], engine, api_key)
        server.run_server(
            app, sock, log_level=args.log_level, access_log=args.access_log,
            shutdown_timeout=args.shutdown_timeout,
        )  # fmt: skip
    return 0


def _check_before_load(args: argparse.Namespace, api_key: str | None) -> None:
    """Fail on bad options before the (slow) model load."""
    from kestrel.server.limits import ApiKey

    if api_key is not None:
        try:
            ApiKey(api_key)
        except ValueError as exc:
            raise common.UsageError(str(exc)) from None
    names = [name for name, _ in args.adapters]
    if len(set(names)) != len(names):
        raise common.UsageError(f"adapter names must be unique, got {names}")
    for name, path in args.adapters:
        if not path.exists():
            raise common.UsageError(f"no such adapter file or folder for {name!r}: {path}")
    if args.shutdown_timeout < 0:
        raise common.UsageError("--shutdown-timeout must be >= 0")


def _limits(args: argparse.Namespace) -> dict[str, int]:
    given = {
        "max_queue": args.max_queue,
        "max_body_bytes": args.max_body_bytes,
        "max_image_pixels": args.max_image_pixels,
    }
    return {k: v for k, v in given.items() if v is not None}


def _announce(args: argparse.Namespace, port: int, engine, api_key: str | None) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    adapters = ", ".join(engine.adapters()) or "none"
    print(
        f"kestrel serve: {engine.model_path} ({engine.config.family}) on "
        f"http://{host}:{port}/v1 (adapters: {adapters})",
        flush=True,
    )
    if api_key is None and not _is_loopback(args.host):
        print(
            f"kestrel serve: warning: listening on {args.host} without --api-key",
            file=sys.stderr,
            flush=True,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def _adapter_spec(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), Path(path.strip()).expanduser()
