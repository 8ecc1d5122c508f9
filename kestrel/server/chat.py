"""``POST /v1/chat/completions``: the OpenAI chat completions protocol over ``Engine.achat``.

The body is ``{"model", "messages", "stream"?, "stream_options"?: {"include_usage"},
"max_tokens" | "max_completion_tokens"?, "temperature"?, "top_p"?, "seed"?, "reasoning"?,
"stop"?, "response_format"?, "logprobs"?, "top_logprobs"?}`` plus Kestrel's ``"adapter"`` (or
``"variant"``) and ``"cache_salt"``. Any ``model`` string is accepted (one model is served; the
reply names it); ``<model>@<adapter>``, as ``/v1/models`` lists it, selects that adapter.
``response_format`` is ``text``, ``json_object``, ``json_schema`` or Kestrel's ``regex`` and
``choice`` (docs/structured.md); ``logprobs`` come in OpenAI's ``choices[0].logprobs.content``
shape, streamed with the chunks whose text their tokens complete. Fields the server cannot
honour (``tools``, ``n`` > 1, ...) are a 400 naming the field; a JSON ``null`` is "not set"
for every optional field OpenAI defines. ``stream_options`` without ``"stream": true`` is a
400. Image parts must be ``data:image/...;base64,`` URLs (or bare base64); they are decoded
here, in a worker thread, under the server's pixel limit. Everything else about the messages
is the engine's to check (:mod:`kestrel.engine.chat`).

The answer is a ``chat.completion`` object, or ``chat.completion.chunk`` server-sent events
ending in ``data: [DONE]``. ``usage`` counts KV positions: ``prompt_tokens`` includes the
image's block, ``prompt_tokens_details.cached_tokens`` the positions reused from the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from kestrel.engine.chat import MAX_IMAGES
from kestrel.errors import InvalidInputError
from kestrel.grammar import parse_response_format
from kestrel.results import ChatResult, RequestMetrics, TokenLogprob
from kestrel.server.errors import ApiError
from kestrel.server.payloads import Prepare, decode_data_url, load_object, typed
from kestrel.server.protocol import ServedEngine, call_options
from kestrel.server.responses import EventStream
from kestrel.skills.stops import parse_stop

__all__ = ["ChatCall", "chat_response", "parse_chat", "start_chat"]

_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed", "reasoning", "adapter", "variant", "cache_salt", "user",
    "stop", "response_format", "logprobs", "top_logprobs",
})  # fmt: skip
MAX_TOP_LOGPROBS = 20
# Optional OpenAI fields this server does not honour: a JSON null means "not set" (clients
# such as SGLang's send ``"top_logprobs": null``); any other value is a 400.
_NULL_OK = frozenset({
    "tools", "logit_bias", "metadata", "service_tier",
    "reasoning_effort", "functions", "function_call", "store", "prediction", "modalities",
    "audio", "web_search_options", "suffix", "echo", "best_of",
})  # fmt: skip
# Accepted only at the value that changes nothing (what some clients always send).
_NEUTRAL: dict[str, Any] = {
    "n": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "parallel_tool_calls": True, "tool_choice": "none",
}  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class ChatCall:
    """A validated chat completions request; image parts hold decoded PreparedImages."""

    model: str | None
    messages: list[Any]
    settings: dict[str, Any]
    adapter: str | None
    cache_salt: str | None
    reasoning: bool
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    response_format: dict[str, Any] | None = None
    logprobs: int | None = None  # None: not asked; else top_logprobs (0 to 20)


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def _check_fields(obj: Mapping[str, Any]) -> None:
    for key, value in obj.items():
        if key in _FIELDS or (key in _NEUTRAL and value in (None, _NEUTRAL[key])):
            continue
        if key in _NULL_OK and value is None:
            continue
        if key in _NEUTRAL:
            raise _invalid(f"'{key}' = {value!r:.40} is not supported by this server")
        raise _invalid(f"'{key}' is not supported by this server; supported: {sorted(_FIELDS)}")


def _settings(obj: Mapping[str, Any]) -> dict[str, Any]:
    limit = typed(obj, "max_completion_tokens", (int,), "an integer")
    legacy = typed(obj, "max_tokens", (int,), "an integer")
    if limit is not None and legacy is not None and limit != legacy:
        raise _invalid("'max_tokens' and 'max_completion_tokens' disagree; send one")
    raw = {
        "max_tokens": limit if limit is not None else legacy,
        "temperature": typed(obj, "temperature", (int, float), "a number"),
        "top_p": typed(obj, "top_p", (int, float), "a number"),
        "seed": typed(obj, "seed", (int,), "an integer"),
    }
    return {k: v for k, v in raw.items() if v is not None}


def _answer_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``stop``, ``response_format`` and the engine's ``logprobs`` (top_logprobs), checked."""
    try:
        stop = parse_stop(obj.get("stop"))
        response_format = typed(obj, "response_format", (dict,), "an object")
        parse_response_format(response_format)  # a 400 before anything is decoded
    except InvalidInputError as exc:
        raise _invalid(str(exc)) from None
    wanted = bool(typed(obj, "logprobs", (bool,), "true or false"))
    top = typed(obj, "top_logprobs", (int,), "an integer")
    if top is not None and not wanted:
        raise _invalid("'top_logprobs' needs \"logprobs\": true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return {
        "stop": stop,
        "response_format": response_format,
        "logprobs": (top or 0) if wanted else None,
    }


def _image_parts(messages: list[Any]) -> list[dict[str, Any]]:
    """The ``image_url`` parts of user messages (the only place images are decoded)."""
    found = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), list):
            found += [p for p in m["content"] if isinstance(p, dict) and "type" in p]
    for part in found:
        if part["type"] == "image":  # Python-only: a JSON value would be read as a path
            raise _invalid("image parts must be {'type': 'image_url', 'image_url': {'url'}}")
    return [p for p in found if p["type"] == "image_url"]


def _decoded(messages: list[Any], prepare: Prepare) -> list[Any]:
    """``messages`` with each user image_url part decoded into a PreparedImage."""
    parts = _image_parts(messages)
    if len(parts) > MAX_IMAGES:
        raise _invalid(f"at most {MAX_IMAGES} images per conversation, got {len(parts)}")
    decoded: dict[int, Any] = {}
    for part in parts:
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else None
        if not isinstance(url, str):
            raise ApiError(400, "invalid_image", "image_url must be {'url': 'data:image/...'}")
        try:
            image = prepare(decode_data_url(url))
        except InvalidInputError as exc:  # not an image, corrupt, or over the pixel limit
            raise ApiError(400, "invalid_image", str(exc)) from None
        decoded[id(part)] = {"type": "image", "image": image}

    def swap(m: Any) -> Any:
        if not (isinstance(m, dict) and isinstance(m.get("content"), list)):
            return m
        return {**m, "content": [decoded.get(id(p), p) for p in m["content"]]}

    return [swap(m) for m in messages]


def parse_chat(body: bytes, *, prepare: Prepare) -> ChatCall:
    """Validate the body of ``POST /v1/chat/completions``; raises :class:`ApiError` (400).
    Images are prepared by ``prepare`` (the app's ``KnownImages.prepare``: its pixel limit and
    EXIF option, and an image a client sent before is not decoded again)."""
    obj = load_object(body)
    _check_fields(obj)
    messages = typed(obj, "messages", (list,), "a list of message objects")
    if not messages:
        raise _invalid("'messages' is required: a non-empty list of message objects")
    typed(obj, "user", (str,), "a string")
    options = typed(obj, "stream_options", (dict,), "an object")
    unknown = sorted(set(options or {}) - {"include_usage"})
    if unknown:
        raise _invalid(f"stream_options {unknown} are not supported; only include_usage")
    stream = bool(typed(obj, "stream", (bool,), "true or false"))
    if options is not None and not stream:
        raise _invalid("'stream_options' is only allowed with \"stream\": true")
    adapter = typed(obj, "adapter", (str,), "a string")
    variant = typed(obj, "variant", (str,), "a string")
    if adapter is not None and variant is not None and adapter != variant:
        raise _invalid("'adapter' and 'variant' name different adapters; send one")
    return ChatCall(
        model=typed(obj, "model", (str,), "a string"),
        settings=_settings(obj),
        adapter=adapter if adapter is not None else variant,
        cache_salt=typed(obj, "cache_salt", (str,), "a string"),
        reasoning=bool(typed(obj, "reasoning", (bool,), "true or false")),
        stream=stream,
        include_usage=stream
        and bool(typed(options or {}, "include_usage", (bool,), "true or false")),
        **_answer_fields(obj),
        messages=_decoded(messages, prepare),  # last: the costly part
    )


def start_chat(engine: ServedEngine, call: ChatCall) -> Any:
    """The engine coroutine of a validated call (a ChatResult, or a stream)."""
    answer: dict[str, Any] = {}  # only what was asked (any ServedEngine takes the rest)
    if call.stop:
        answer["stop"] = list(call.stop)
    if call.response_format is not None:
        answer["response_format"] = call.response_format
    if call.logprobs is not None:
        answer["logprobs"] = call.logprobs
    return engine.achat(
        call.messages, reasoning=call.reasoning, stream=call.stream, **call_options(call),
        **answer,
    )  # fmt: skip


def _logprob(t: TokenLogprob) -> dict[str, Any]:
    # -9999.0 stands for -inf, as OpenAI writes it (JSON has no infinity)
    return {"token": t.token, "logprob": max(t.logprob, -9999.0), "bytes": list(t.bytes)}


def logprobs_body(found: Any) -> dict[str, Any] | None:
    """OpenAI's ``choices[].logprobs`` of some answer tokens (None: not asked for)."""
    if found is None:
        return None
    content = [{**_logprob(t), "top_logprobs": [_logprob(a) for a in t.top]} for t in found]
    return {"content": content, "refusal": None}


def usage(metrics: RequestMetrics) -> dict[str, Any]:
    """OpenAI's usage object: the completion counts the reasoning tokens too, and says how
    many of them there were."""
    completion = metrics.output_tokens + metrics.reasoning_tokens
    return {
        "prompt_tokens": metrics.input_tokens,
        "completion_tokens": completion,
        "total_tokens": metrics.input_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": metrics.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": metrics.reasoning_tokens},
    }


def _envelope(request_id: str, model: str, kind: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def completion_body(result: ChatResult, request_id: str, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object of a finished request."""
    choice = {"index": 0, "message": result.message, "finish_reason": result.finish_reason,
              "logprobs": logprobs_body(result.logprobs)}  # fmt: skip
    return {
        **_envelope(request_id, model, "chat.completion"),
        "choices": [choice],
        "usage": usage(result.metrics),
        "metrics": result.metrics.to_dict(),
    }


class ChatEventStream(EventStream):
    """``chat.completion.chunk`` events: the content deltas (the first names the role), a last
    chunk with the finish reason (and the reasoning, when asked), the usage chunk when asked,
    then ``data: [DONE]``."""

    TAIL = b"data: [DONE]\n\n"

    def __init__(self, stream: Any, *, request_id: str, model: str, include_usage: bool,
                 finish: Callable[[int, RequestMetrics | None], None]) -> None:  # fmt: skip
        super().__init__(stream, skill="chat", request_id=request_id, finish=finish)
        self.model = model
        self.include_usage = include_usage
        self._role_sent = False
        self._logprobs_sent = 0  # answer tokens whose logprobs went out with a delta

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        if not self._role_sent:
            delta = {"role": "assistant", **delta}
            self._role_sent = True
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = logprobs_body(logprobs)
        return {**_envelope(self.request_id, self.model, "chat.completion.chunk"),
                "choices": [choice]}  # fmt: skip

    def delta_event(self, delta: str) -> dict[str, Any]:
        found = getattr(delta, "logprobs", None)  # a TextDelta of a call with logprobs
        if found is not None:
            self._logprobs_sent += len(found)
        return self._chunk({"content": str(delta)}, None, found)

    def final_events(self, result: Any) -> list[dict[str, Any]]:
        delta = {} if result.reasoning is None else {"reasoning": result.reasoning.to_dict()}
        rest = None if result.logprobs is None else result.logprobs[self._logprobs_sent :]
        events = [self._chunk(delta, result.finish_reason, rest)]
        if self.include_usage:
            env = _envelope(self.request_id, self.model, "chat.completion.chunk")
            events.append({**env, "choices": [], "usage": usage(result.metrics)})
        return events


def chat_response(
    call: ChatCall,
    outcome: Any,
    *,
    request_id: str,
    model: str,
    finish: Callable[[int, RequestMetrics | None], None],
) -> Response:
    """The HTTP response of a request the engine accepted: JSON, or the event stream."""
    if call.stream:
        return ChatEventStream(outcome, request_id=request_id, model=model,
                               include_usage=call.include_usage, finish=finish)  # fmt: skip
    finish(200, outcome.metrics)
    body = completion_body(outcome, request_id, model)
    return JSONResponse(body, headers={"X-Request-ID": request_id})
