"""``kestrel chat [IMAGE ...]``: a conversation in the terminal, or scripted with ``--json``.

Interactive: each line typed is a user turn and the answer streams back; ``/image PATH`` adds
an image to the next turn (the IMAGE arguments go with the first); after each answer the
share of the prompt the prefix cache reused is shown dimly on stderr; Ctrl-D ends.

``--json``: stdin holds JSON Lines, each a message object or a list of them (OpenAI shape;
from the command line an image part may be ``{"type": "image", "image": "PATH"}``). Every
line that ends with a user message is answered: one JSON line per answer on stdout,
``{"message", "finish_reason", "metrics"}``, and the reply joins the conversation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable
from typing import Any

from kestrel.errors import InvalidInputError

from . import common

_DIM, _RESET = "\x1b[2m", "\x1b[0m"
_IMAGE_COMMAND = "/image"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = common.add_command(
        subparsers, "chat", run, help="hold a conversation (about images, if given)",
        description="Hold a conversation: type a line, the answer streams; '/image PATH' adds "
        "an image to the next turn; Ctrl-D ends. With --json, read messages from stdin "
        "(JSON Lines) and print one JSON line per answer.",
    )  # fmt: skip
    parser.add_argument("images", metavar="IMAGE", nargs="*", help="images for the first turn")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    parser.add_argument("--reasoning", action="store_true", help="think before answering")
    parser.add_argument(
        "--json", action="store_true", help="read JSON Lines messages from stdin (for scripts)"
    )
    common.add_engine_options(parser)
    common.add_generation_options(parser)


def run(args: argparse.Namespace) -> int:
    for image in args.images:
        common.check_image_arg(image)
    messages: list[Any] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    with common.open_engine(args) as engine:
        chat = _Chat(engine, args, messages, [_image_part(p) for p in args.images])
        return chat.scripted(sys.stdin) if args.json else chat.interactive(sys.stdin)


def _image_part(path: str) -> dict[str, Any]:
    return {"type": "image", "image": path}


def cached_share(metrics: Any, *, dim: bool) -> str:
    """``[cached 744 of 750 positions: 99%]``, dim on a terminal."""
    total, cached = metrics.input_tokens, metrics.cached_tokens
    text = f"[cached {cached} of {total} positions: {100 * cached // max(total, 1)}%]"
    return f"{_DIM}{text}{_RESET}" if dim else text


class _Chat:
    """One conversation: the messages so far and the images waiting for the next turn."""

    def __init__(self, engine: Any, args: argparse.Namespace, messages: list, images: list):
        self.engine, self.messages, self.pending = engine, messages, images
        self.kwargs = {
            "settings": common.settings_from_args(args),
            "adapter": common.adapter_name(args),
            "reasoning": args.reasoning,
        }

    def _user(self, content: Any) -> dict[str, Any]:
        """A user message with the waiting images before its content (which they then leave)."""
        if self.pending:
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            content, self.pending = [*self.pending, *parts], []
        return {"role": "user", "content": content}

    def interactive(self, lines: Iterable[str]) -> int:
        tty = sys.stdin.isatty()
        dim = sys.stderr.isatty()
        for line in _prompted(lines, tty):
            text = line.strip()
            if not text:
                continue
            if text.startswith(_IMAGE_COMMAND + " ") or text == _IMAGE_COMMAND:
                self._add_image(text[len(_IMAGE_COMMAND) :].strip())
                continue
            pending, message = list(self.pending), self._user(text)
            try:
                stream = self.engine.chat([*self.messages, message], stream=True, **self.kwargs)
                result = common.print_stream(stream)
            except InvalidInputError as exc:  # too long, a bad image: this turn only
                print(f"kestrel: error: {exc}", file=sys.stderr)
                self.pending = pending  # the images wait for the next try
                continue
            self.messages += [message, result.message]
            print(cached_share(result.metrics, dim=dim), file=sys.stderr)
        return 0

    def _add_image(self, path: str) -> None:
        try:
            common.check_image_arg(path or "")
        except InvalidInputError as exc:
            print(f"kestrel: error: {exc}", file=sys.stderr)
            return
        self.pending.append(_image_part(path))
        print(f"(image {path} goes with your next message)", file=sys.stderr)

    def scripted(self, lines: Iterable[str]) -> int:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"stdin line {number} is not JSON: {exc}") from None
            new = value if isinstance(value, list) else [value]
            if self.pending and new and isinstance(new[0], dict) and new[0].get("role") == "user":
                new[0] = {**new[0], **self._user(new[0].get("content"))}  # IMAGE arguments
            self.messages += new
            if not new or not isinstance(new[-1], dict) or new[-1].get("role") != "user":
                continue
            result = self.engine.chat(self.messages, **self.kwargs)
            self.messages.append(result.message)
            out = {"message": result.message, "finish_reason": result.finish_reason}
            out["metrics"] = common.result_to_dict(result.metrics)
            common.print_json(out)
        return 0


def _prompted(lines: Iterable[str], tty: bool) -> Iterable[str]:
    """Lines typed at a ``> `` prompt (with line editing) on a terminal, else read as given."""
    if not tty:
        yield from lines
        return
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        try:
            yield input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
