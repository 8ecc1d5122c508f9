"""The chat route's stop, logprobs and response_format, read back through the ``openai``
client's parsed objects: blocking and streamed, and ``chat.completions.parse`` with a
Pydantic model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")
pytest.importorskip("openai", reason="the openai client is in the test extra")
pytest.importorskip("jsonschema", reason="in the test extra")

import jsonschema
import openai
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from kestrel.server import create_app
from tests.server.conftest import SHAPES, data_url

QUESTION = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(SHAPES)}},
    {"type": "text", "text": "What is in the picture?"},
]}]  # fmt: skip
OPTIONS = {"model": "m", "messages": QUESTION, "temperature": 0, "max_tokens": 24}


class Shape(BaseModel):
    colour: str = Field(max_length=8)  # bounded: a weak model's string may not end by itself
    count: int = Field(ge=0, le=9)
    round: bool


@pytest.fixture(scope="module")
def oa(engine):
    with TestClient(create_app(engine)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def _stream(oa, **options):
    """(content, finish_reason, logprob entries) of a streamed completion."""
    text, finish, entries = "", None, []
    for chunk in oa.chat.completions.create(stream=True, **{**OPTIONS, **options}):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if choice.logprobs is not None and choice.logprobs.content:
            entries += choice.logprobs.content
    return text, finish, entries


def test_stop_blocking_and_streamed(oa) -> None:
    whole = oa.chat.completions.create(**OPTIONS).choices[0].message.content
    if len(whole) < 4:
        pytest.skip(f"the answer {whole!r} is too short to cut")
    stop = whole[2:4]
    got = oa.chat.completions.create(**OPTIONS, stop=[stop, "\x01"]).choices[0]
    assert (got.message.content, got.finish_reason) == (whole[: whole.find(stop)], "stop")
    assert _stream(oa, stop=stop)[:2] == (got.message.content, "stop")


def test_logprobs_blocking_and_streamed(oa) -> None:
    got = oa.chat.completions.create(**OPTIONS, logprobs=True, top_logprobs=2).choices[0]
    entries = got.logprobs.content
    assert entries and "".join(e.token for e in entries) == got.message.content
    assert bytes(b for e in entries for b in e.bytes).decode() == got.message.content
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0.0
        assert e.top_logprobs[0].token == e.token  # greedy
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    text, finish, streamed = _stream(oa, logprobs=True, top_logprobs=2)
    assert (text, finish) == (got.message.content, got.finish_reason)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    plain = oa.chat.completions.create(**OPTIONS).choices[0]
    assert plain.logprobs is None
    only = oa.chat.completions.create(**OPTIONS, logprobs=True).choices[0].logprobs.content
    assert [e.token for e in only] == [e.token for e in entries]
    assert all(e.top_logprobs == [] for e in only)


def test_response_format_json_schema_and_object(oa) -> None:
    schema = Shape.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": schema,
                                                  "strict": True}}  # fmt: skip
    got = oa.chat.completions.create(**{**OPTIONS, "max_tokens": 64}, response_format=fmt)
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    text, finish, _ = _stream(oa, max_tokens=64, response_format=fmt)
    assert (text, finish) == (got.choices[0].message.content, "stop")
    obj = oa.chat.completions.create(**OPTIONS, response_format={"type": "json_object"})
    choice = obj.choices[0]
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        oa.chat.completions.create(**OPTIONS, response_format={"type": "regex", "regex": "(("})


def test_parse_with_a_pydantic_model(oa) -> None:
    parse = getattr(getattr(oa, "beta", oa).chat.completions, "parse", None)
    if parse is None:
        pytest.skip("this openai client has no chat.completions.parse")
    got = parse(**{**OPTIONS, "max_tokens": 64}, response_format=Shape)
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Shape)
    assert parsed == Shape.model_validate_json(got.choices[0].message.content)
