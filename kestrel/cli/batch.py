"""``kestrel batch``: answer many image questions into a resumable JSONL file; with ``--ray``,
on a Ray cluster (``kestrel.distributed``, imported only then: it needs ``kestrel[ray]``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kestrel import batch
from kestrel.errors import KestrelError

from . import common
from .query import response_format


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="answer every image x every question into a JSONL file (resumable)",
        description="Answer every image under --images x every non-empty line of --questions "
        '(ids "<image path>#<question index>"), or each {"id", "image", "question"} line of '
        "--input, appending one JSON line per request to --out. Ids already in --out are "
        "skipped, so an interrupted run picks up where it stopped.",
    )
    source = parser.add_argument_group("input (either --images and --questions, or --input)")
    source.add_argument("--images", metavar="DIR", help="folder of images (searched recursively)")
    source.add_argument("--questions", metavar="FILE", help="one question per line")
    source.add_argument("--input", metavar="FILE", help='JSONL of {"id", "image", "question"}')
    parser.add_argument(
        "--out",
        metavar="FILE",
        required=True,
        help="JSONL results (appended); with --ray a folder of JSONL files, or of Parquet files "
        "when it ends with .parquet",
    )
    parser.add_argument(
        "--max-in-flight",
        type=common.positive_int,
        default=None,
        metavar="N",
        help="requests submitted at once (default: 4 x --max-batch-size)",
    )
    parser.add_argument(
        "--load-adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help='load a LoRA adapter under NAME for JSONL lines with "adapter": NAME (repeatable)',
    )
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        type=Path,
        help='hold every answer to the JSON schema in FILE; each line gets "parsed", its value',
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    common.add_ray_options(
        parser,
        ray="run on a Ray cluster: one engine per replica, questions routed by image",
        replicas="engine replicas (default: one per GPU, else one per 4 CPUs)",
        routing="image: all questions about an image go to one replica (default); random: "
        "Ray's plain shuffle, for comparison",
    )
    common.add_engine_options(parser)
    common.add_generation_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    requests = _requests(args)  # bad input fails here, before the model loads
    shape = response_format(args.json_schema)
    adapters = [_named_path(spec) for spec in args.load_adapter]
    max_in_flight = args.max_in_flight or 4 * args.max_batch_size
    if args.ray:
        return _run_ray(args, requests, adapters, max_in_flight, shape)
    with common.open_engine(args) as engine:
        for name, path in adapters:
            engine.load_adapter(name, path)
        summary = batch.run_batch(
            engine,
            requests,
            args.out,
            settings=common.settings_from_args(args),
            adapter=common.adapter_name(args),
            max_in_flight=max_in_flight,
            progress=not args.no_progress,
            response_format=shape,
        )
    if args.json:
        common.print_json(summary.to_dict())
    else:
        print(batch.format_summary(summary))
    return 0


def _run_ray(
    args, requests, adapters: list[tuple[str, str]], max_in_flight: int, shape: dict | None
) -> int:
    try:
        from kestrel import distributed
    except ImportError as exc:  # as `kestrel serve` without its extra: exit status 1
        why = exc.__cause__ or exc
        raise KestrelError(f'--ray needs Ray Data: pip install "kestrel[ray]" ({why})') from None
    if args.adapter is not None:
        if not Path(args.adapter).expanduser().exists():
            raise common.UsageError(f"no such adapter file or folder: {args.adapter}")
        adapters = [*adapters, (common.ADAPTER, str(Path(args.adapter).expanduser()))]
    replica = distributed.ReplicaOptions(
        model=args.model,
        engine=common.engine_options(args),
        adapters=tuple(adapters),
        settings=common.settings_from_args(args),
        adapter=common.adapter_name(args),
        response_format=shape,
        max_in_flight=max_in_flight,
    )
    options = distributed.RayBatchOptions(
        replicas=args.replicas, routing=args.routing, progress=not args.no_progress
    )
    with distributed.ray_session(args.ray_address):
        summary = distributed.run_ray_batch(requests, args.out, replica, options)
    if args.json:
        common.print_json(summary.to_dict())
    else:
        print(distributed.format_ray_summary(summary))
    return 0


def _requests(args: argparse.Namespace) -> list[batch.BatchRequest]:
    if args.input is not None:
        if args.images is not None or args.questions is not None:
            raise common.UsageError("give either --input or --images with --questions, not both")
        return batch.requests_from_jsonl(args.input)
    if args.images is None or args.questions is None:
        raise common.UsageError("give --images DIR and --questions FILE (or --input FILE.jsonl)")
    return batch.requests_from_folder(args.images, args.questions)


def _named_path(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise common.UsageError(f"--load-adapter wants NAME=PATH, got {spec!r}")
    return name, path
