"""``kestrel serve``: the HTTP API of the official ``moondream`` client, over one Engine.

Needs the ``serve`` extra (``pip install "kestrel[serve]"``); the server modules are imported
only when the command runs. The port is bound before the model loads (a taken port fails at
once) and listens once the model is ready; SIGTERM or Ctrl-C shut it down gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kestrel.errors import KestrelError

from . import common

API_KEY_ENV = "KESTREL_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = common.add_command(
        subparsers, "serve", run,
        help="serve the moondream HTTP API (md.vl(endpoint=...)); needs kestrel[serve]",
        description="Serve the model over HTTP with the API of the official moondream client: "
        "POST /v1/query, /v1/caption, /v1/point, /v1/detect, /v1/segment, /v1/chat/completions; "
        "GET /v1/health, /v1/models, /v1/stats, /metrics. Stop with SIGTERM or Ctrl-C "
        "(in-flight requests finish first).",
    )  # fmt: skip
    _add_server_options(parser)
    _add_limit_options(parser)
    _add_ray_options(parser)
    _add_log_options(parser)
    common.add_engine_options(parser)
    parser.set_defaults(adapter=None)  # adapter: the one-file option of other commands


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    """Where to listen, who may call, and the adapters to load."""
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
    server.add_argument(
        "--allow-origin",
        dest="allow_origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (https://app.example, or *) call the API, with CORS "
        "headers (repeatable); pages from other sites are refused",
    )


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    """The queue, body and image limits, and how long a graceful shutdown may take."""
    limits = parser.add_argument_group("limits")
    for flag, help_text in (
        (
            "--max-queue",
            "requests in flight before 503 + Retry-After (default: 256, or "
            "4 x --max-batch-size if more); raise it for batch clients that send thousands",
        ),
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


def _add_log_options(parser: argparse.ArgumentParser) -> None:
    logs = parser.add_argument_group("logging")
    logs.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    logs.add_argument("--access-log", action="store_true", help="log every request")


def run(args: argparse.Namespace) -> int:
    from kestrel import server

    if server.missing_dependencies():
        raise KestrelError(f"kestrel serve needs the 'serve' extra: {server.SERVE_EXTRA}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    _check_before_load(args, api_key)
    _check_ray_flags(args)
    try:
        sock = server.bind(args.host, args.port)
    except OSError as exc:
        raise common.UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    if args.ray:
        with sock:
            return _run_ray(args, sock, api_key)
    server.tune_allocator()  # before the model loads: bounded malloc arenas (glibc)
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


def _add_ray_options(parser: argparse.ArgumentParser) -> None:
    group = common.add_ray_options(
        parser,
        ray="serve from replicas on Ray Serve (one engine each), requests routed by image",
        replicas="engine replicas (default: one per GPU, else 2)",
        routing="image: a consistent-hash ring on the image's digest (default); random: any "
        "live replica, for comparison",
    )
    group.add_argument(
        "--ray-app",
        default="kestrel-replica",
        metavar="NAME",
        help="the replicas' Ray Serve applications are NAME-0, NAME-1, ... (default: %(default)s)",
    )
    group.add_argument(
        "--ray-attach",
        action="store_true",
        help="start no replicas: front the ones another kestrel serve --ray runs on the cluster "
        "(--ray-address, --ray-app); the model options are theirs",
    )


def _check_ray_flags(args: argparse.Namespace) -> None:
    """The Ray options mean nothing without --ray: refuse them rather than ignore them."""
    given = {
        "--ray-address": args.ray_address is not None,
        "--replicas": args.replicas is not None,
        "--routing": args.routing != "image",
        "--ray-app": args.ray_app != "kestrel-replica",
        "--ray-attach": args.ray_attach,
    }
    named = [flag for flag, set_ in given.items() if set_]
    if named and not args.ray:
        raise common.UsageError(f"{', '.join(named)} only apply with --ray")
    if args.ray_attach and (args.replicas is not None or args.adapters):
        raise common.UsageError("--ray-attach starts no replicas: --replicas and --adapter are "
                                "the running replicas' own")  # fmt: skip


def _run_ray(args: argparse.Namespace, sock, api_key: str | None) -> int:
    """``kestrel serve --ray``: the same app over the replicas' front (docs/distributed.md)."""
    from kestrel import server

    try:
        from kestrel.distributed import serving
    except ImportError as exc:
        why = exc.__cause__ or exc
        raise KestrelError(f'--ray needs Ray Serve: pip install "kestrel[ray]" ({why})') from None
    options = serving.ServeOptions(replicas=args.replicas, routing=args.routing,
                                   shutdown_timeout_s=args.shutdown_timeout,
                                   app_prefix=args.ray_app, attach=args.ray_attach)  # fmt: skip
    replica = serving.ReplicaOptions(
        model=args.model, engine=common.engine_options(args), adapters=_adapter_paths(args)
    )
    with serving.serve_cluster(args.ray_address, replica, options) as door:
        app = server.create_app(door, api_key=api_key, **_limits(args))
        serving.add_replica_metrics(app, door)
        sock.listen(2048)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(serving.startup_line(door, f"http://{host}:{sock.getsockname()[1]}/v1"), flush=True)
        _warn_if_open(args, api_key)
        server.run_server(
            app, sock, log_level=args.log_level, access_log=args.access_log,
            shutdown_timeout=args.shutdown_timeout,
        )  # fmt: skip
    return 0


def _adapter_paths(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--adapter NAME=PATH`` as absolute paths: every replica loads them (the same path must
    exist on every node)."""
    return tuple((name, str(path.resolve())) for name, path in args.adapters)


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
    from kestrel.server.guard import normalize_origin

    for origin in args.allow_origins:
        try:
            normalize_origin(origin)
        except ValueError as exc:
            raise common.UsageError(f"--allow-origin: {exc}") from None


def _limits(args: argparse.Namespace) -> dict[str, object]:
    """The app's options from the command line: its limits, and who may call it."""
    given = {
        "max_queue": args.max_queue,
        "max_body_bytes": args.max_body_bytes,
        "max_image_pixels": args.max_image_pixels,
    }
    options: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    return {**options, "bind_host": args.host, "allow_origins": tuple(args.allow_origins)}


def _announce(args: argparse.Namespace, port: int, engine, api_key: str | None) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    adapters = ", ".join(engine.adapters()) or "none"
    print(
        f"kestrel serve: {engine.model_path} ({engine.config.family}) on "
        f"http://{host}:{port}/v1 (adapters: {adapters})",
        flush=True,
    )
    _warn_if_open(args, api_key)


def _warn_if_open(args: argparse.Namespace, api_key: str | None) -> None:
    from kestrel.server.guard import is_loopback_host  # the app's own reading of a host

    if api_key is None and not is_loopback_host(args.host):
        print(
            f"kestrel serve: warning: listening on {args.host} without --api-key",
            file=sys.stderr,
            flush=True,
        )


def _port(text: str) -> int:
    return common.int_in(text, 0, 65535, "a port number in 0..65535")


def _adapter_spec(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), Path(path.strip()).expanduser()
