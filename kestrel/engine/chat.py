"""Conversations: OpenAI-shaped messages -> validated turns and their images.

Messages are ``{"role": "system" | "developer" | "user" | "assistant", "content": ...}`` where
``content`` is a string or a list of parts: ``{"type": "text", "text"}``, ``{"type":
"image_url", "image_url": {"url": "data:image/...;base64,..."}}`` or, from Python, ``{"type":
"image", "image": <anything Engine.query accepts>}``. A leading system (or developer) message is
folded into the first user turn's text; then user and assistant messages alternate, ending with
the user turn to answer. Images only in user messages, at most :data:`MAX_IMAGES` per
conversation (and as many as the model's context holds: 729 positions each for Moondream 2),
in any user turn; each turn's go before its block. Everything is checked, and images decoded,
on the caller's thread (the request desk, :mod:`kestrel.engine.desk`, drafts the reply).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from kestrel.errors import InvalidInputError
from kestrel.images import PreparedImage, image_hash_int, prepare_image
from kestrel.skills import ChatTurn
from kestrel.tokens import ImageToken

__all__ = ["MAX_IMAGES", "Conversation", "parse_messages"]

MAX_IMAGES = 4
_SYSTEM_ROLES = frozenset({"system", "developer"})
_ROLES = _SYSTEM_ROLES | {"user", "assistant"}
_UNSUPPORTED_KEYS = ("tool_calls", "tool_call_id", "function_call", "audio")
_DATA_PREFIX = "data:image/"
_Source = Callable[[], object]  # gives an image source, decoded only once counts are checked


@dataclass(frozen=True, slots=True, eq=False)
class Conversation:
    """Validated turns (the last awaits its reply) and the conversation's images, each with
    the index of the turn it belongs to, in order."""

    turns: tuple[ChatTurn, ...]
    images: tuple[tuple[int, PreparedImage], ...] = ()

    @property
    def image(self) -> PreparedImage | None:
        """The first image (it keys the conversation's cache namespace), or None."""
        return self.images[0][1] if self.images else None

    def placed(self, image_tokens: int) -> tuple[ChatTurn, ...]:
        """The turns with their images as cache tokens of ``image_tokens`` positions each."""
        turns = list(self.turns)
        for turn, image in self.images:
            token = ImageToken(image_hash_int(image.digest), image_tokens)
            turns[turn] = replace(turns[turn], images=(*turns[turn].images, token))
        return tuple(turns)


def _where(i: int, message: Mapping[str, Any]) -> str:
    return f"messages[{i}] ({message.get('role')})"


def _image_of_url(value: object, where: str) -> bytes:
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url.startswith(_DATA_PREFIX) or ";base64," not in url:
        raise InvalidInputError(
            f"{where}: image_url must be a data:image/...;base64, URL (remote URLs are not fetched)"
        )
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"{where}: image_url holds invalid base64 data") from None
    if not data:
        raise InvalidInputError(f"{where}: image_url holds no image data")
    return data


def _given(image: object) -> object:
    return image


def _parts(i: int, message: Mapping[str, Any]) -> tuple[str, list[_Source]]:
    """The message's text (its text parts joined by newlines) and its image sources."""
    where = _where(i, message)
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise InvalidInputError(f"{where}: content must be a string or a list of parts")
    texts: list[str] = []
    images: list[_Source] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            images.append(partial(_image_of_url, part.get("image_url"), where))
        elif kind == "image" and part.get("image") is not None:
            images.append(partial(_given, part["image"]))
        else:
            raise InvalidInputError(
                f"{where}: each part must be {{'type': 'text', 'text': str}}, "
                f"{{'type': 'image_url', ...}} or {{'type': 'image', ...}}; got {part!r:.80}"
            )
    return "\n".join(texts), images


def _check_message(i: int, message: object) -> str:
    if not isinstance(message, Mapping):
        raise InvalidInputError(f"messages[{i}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidInputError(
            f"messages[{i}]: role must be one of {sorted(_ROLES)}, got {role!r:.40}"
        )
    for key in _UNSUPPORTED_KEYS:
        if message.get(key) is not None:
            raise InvalidInputError(f"messages[{i}]: '{key}' is not supported")
    return str(role)


def _turns(
    messages: Sequence[object],
) -> tuple[list[ChatTurn], list[tuple[int, _Source]]]:
    """Turns and (turn index, image source) pairs, roles checked; images not decoded yet."""
    system = ""
    start = 0
    if _check_message(0, messages[0]) in _SYSTEM_ROLES:
        system, images = _parts(0, messages[0])  # type: ignore[arg-type]
        if images:
            raise InvalidInputError("messages[0] (system): images belong in user messages")
        start = 1
    users: list[str] = []
    replies: list[str] = []
    found: list[tuple[int, _Source]] = []
    for i in range(start, len(messages)):
        role = _check_message(i, messages[i])
        want = "user" if (i - start) % 2 == 0 else "assistant"
        if role != want:
            raise InvalidInputError(
                f"messages[{i}] is {role!r}, expected {want!r}: after an optional leading "
                "system message, user and assistant messages alternate, starting with user"
            )
        text, images = _parts(i, messages[i])  # type: ignore[arg-type]
        if role == "assistant":
            if images:
                raise InvalidInputError(f"messages[{i}] (assistant): images belong in user turns")
            replies.append(text)
            continue
        if not text.strip():
            raise InvalidInputError(f"messages[{i}] (user) has no text")
        found.extend((len(users), src) for src in images)
        users.append(text)
    if len(users) == len(replies):
        raise InvalidInputError("the last message must be a user message (the turn to answer)")
    if system.strip():
        users[0] = f"{system}\n\n{users[0]}"
    turns = [ChatTurn(u, r) for u, r in zip(users, replies, strict=False)]
    return [*turns, ChatTurn(users[-1])], found


def parse_messages(
    messages: object, prepare: Callable[[object], PreparedImage] = prepare_image
) -> Conversation:
    """Validate OpenAI-shaped ``messages``; raises :class:`InvalidInputError` naming the fault.
    ``prepare`` decodes the image (the Engine's, with its image options)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidInputError("messages must be a non-empty list of message objects")
    turns, images = _turns(messages)
    if len(images) > MAX_IMAGES:
        raise InvalidInputError(
            f"this server accepts at most {MAX_IMAGES} images per conversation, got {len(images)}"
        )
    return Conversation(tuple(turns), tuple((turn, prepare(src())) for turn, src in images))
