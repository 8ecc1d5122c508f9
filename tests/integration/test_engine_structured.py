"""Structured answers through the Engine: generated JSON schemas, regex and choice answers of
the embedded model and the Moondream 2 and 3 fixtures, greedy and sampled, in batches shared
with free rows whose answers stay what they are alone; stop strings; logprobs."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from kestrel import Engine
from kestrel.errors import InvalidInputError
from kestrel.results import TextDelta
from kestrel.tiny import DEMO_DIR
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle
from tests.schemas import schemas

pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="in the test extra")

MODELS = {"tiny": None, "md2": FIXTURES / "md2-tiny-a", "md3": FIXTURES / "md3-tiny-a"}
IMAGE = Image.open(DEMO_DIR / "scene_0.png").convert("RGB")
QUESTION = "what colour is the circle?"
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.5, "top_p": 0.95}}
SCHEMAS = schemas(30)


@pytest.fixture(scope="module", params=list(MODELS))
def engine(request):
    e = Engine(MODELS[request.param], device="cpu", dtype="float32", max_batch_size=48,
               kv_cache_pages=20000)  # fmt: skip
    yield e
    assert_idle(e)
    e.close()


def _settings(mode: str, seed: int, max_tokens: int = 160) -> dict:
    return {**MODES[mode], "max_tokens": max_tokens, "seed": seed}


def _schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}


@pytest.mark.parametrize("mode", list(MODES))
def test_schemas_validate_in_batches_shared_with_free_rows(engine, mode) -> None:
    """30 schemas' answers and 10 free ones, all submitted at once: every constrained answer
    parses and validates; every free answer equals the one it gets alone."""
    free = [(i, f"{QUESTION} {'please ' * (i % 3)}".strip()) for i in range(10)]
    alone = {i: engine.query(IMAGE, q, settings=_settings(mode, i, 12)).answer for i, q in free}
    futures = []
    for j, s in enumerate(SCHEMAS):
        futures.append(
            (
                "schema",
                s,
                engine.submit_query(
                    IMAGE, QUESTION, settings=_settings(mode, 100 + j), response_format=_schema(s)
                ),
            )
        )
        if j % 3 == 0 and free:
            i, q = free.pop()
            futures.append(
                ("free", i, engine.submit_query(IMAGE, q, settings=_settings(mode, i, 12)))
            )
    for kind, what, future in futures:  # fmt: skip
        r = future.result()
        if kind == "free":
            assert r.answer == alone[what] and r.parsed is None
            continue
        assert r.finish_reason == "stop", r.answer
        jsonschema.validate(r.parsed, what)
        assert r.parsed == __import__("json").loads(r.answer)


@pytest.mark.parametrize("mode", list(MODES))
def test_regex_choice_and_any_object(engine, mode) -> None:
    pattern = r"(yes|no), [a-z]{1,6}( [a-z]{1,6}){0,2}"
    choices = ["red", "green", "blue circle", "a yellow square"]
    jobs = []
    for seed in range(6):
        s = _settings(mode, seed, 64)
        jobs.append(
            (
                "regex",
                engine.submit_query(
                    IMAGE, QUESTION, settings=s, response_format={"type": "regex", "regex": pattern}
                ),
            )
        )
        jobs.append(
            (
                "choice",
                engine.submit_query(
                    IMAGE,
                    QUESTION,
                    settings=s,
                    response_format={"type": "choice", "choices": choices},
                ),
            )
        )
        jobs.append(("object", engine.submit_query(
            IMAGE, QUESTION, settings=s, response_format={"type": "json_object"})))  # fmt: skip
    for kind, future in jobs:
        r = future.result()
        if kind == "regex":
            assert re.fullmatch(pattern, r.answer) and r.parsed == r.answer
        elif kind == "choice":
            assert r.answer in choices and r.parsed == r.answer
        elif r.finish_reason == "stop":  # an object's strings are unbounded: it may run out
            assert isinstance(r.parsed, dict)


def test_reasoning_thinks_freely_then_answers_in_shape(engine) -> None:
    r = engine.query(IMAGE, QUESTION, reasoning=True, settings=_settings("greedy", 0, 24),
                     response_format={"type": "choice", "choices": ["red", "blue"]})  # fmt: skip
    assert r.answer in ("red", "blue") and r.reasoning is not None


def test_bad_grammar_fails_before_the_queue_and_grammars_are_cached(engine) -> None:
    served = engine.stats().requests_served
    with pytest.raises(InvalidInputError, match="cannot be compiled"):
        engine.query(IMAGE, QUESTION, response_format={"type": "regex", "regex": "[a-"})
    with pytest.raises(InvalidInputError, match="response_format"):
        engine.query(IMAGE, QUESTION, response_format={"type": "xml"})
    assert engine.stats().requests_served == served
    grammars = engine._factory.grammars
    fmt = _schema(SCHEMAS[0])
    engine.query(IMAGE, QUESTION, settings=_settings("greedy", 0, 8), response_format=fmt)
    compiled = grammars.compiles
    engine.query(IMAGE, QUESTION, settings=_settings("greedy", 0, 8), response_format=fmt)
    assert grammars.compiles == compiled


def test_stop_cuts_the_answer_blocking_and_streamed(engine) -> None:
    s = _settings("greedy", 0, 16)
    whole = engine.query(IMAGE, QUESTION, settings=s)
    if len(whole.answer) < 4:
        pytest.skip(f"the answer {whole.answer!r} is too short to cut")
    stop = whole.answer[2:4]
    cut = engine.query(IMAGE, QUESTION, settings=s, stop=["zzzz", stop])
    want = whole.answer[: whole.answer.find(stop)]
    assert (cut.answer, cut.finish_reason) == (want, "stop")
    assert cut.tokens == whole.tokens[: len(cut.tokens)] and len(cut.tokens) < len(whole.tokens)
    stream = engine.query(IMAGE, QUESTION, settings=s, stop=stop, stream=True)
    deltas = list(stream)
    assert "".join(deltas) == want == stream.result().answer
    never = engine.query(IMAGE, QUESTION, settings=s, stop=["\x00never"])
    assert (never.answer, never.finish_reason) == (whole.answer, whole.finish_reason)
    parts = [{"type": "image", "image": IMAGE}, {"type": "text", "text": QUESTION}]
    chat = engine.chat([{"role": "user", "content": parts}], settings=s, stop=stop)
    assert (chat.content, chat.finish_reason) == (want, "stop")  # one turn: the query's prompt


def _shape(logprobs) -> list:
    """Each token's id, text, bytes and its alternatives' ids: all but the values."""
    return [(t.id, t.token, t.bytes, [x.id for x in t.top]) for t in logprobs]


def test_logprobs_match_the_tokens(engine) -> None:
    s = _settings("greedy", 0, 10)
    r = engine.query(IMAGE, QUESTION, settings=s, logprobs=3)
    assert r.logprobs is not None and [t.id for t in r.logprobs] == list(r.tokens)
    for t in r.logprobs:
        assert len(t.top) == 3 and t.logprob <= 0.0
        assert t.top[0].id == t.id  # greedy: the chosen token is the most likely one
        assert abs(t.top[0].logprob - t.logprob) <= 1e-5 * max(1.0, abs(t.logprob))
        assert t.top[0].logprob >= t.top[1].logprob >= t.top[2].logprob
    assert b"".join(t.bytes for t in r.logprobs).decode("utf-8", "replace") == r.answer
    stream = engine.query(IMAGE, QUESTION, settings=s, logprobs=3, stream=True)
    deltas = list(stream)
    assert all(isinstance(d, TextDelta) for d in deltas)
    final = stream.result()
    streamed = [t for d in deltas for t in d.logprobs]
    assert streamed == list(final.logprobs[: len(streamed)])
    # the same tokens and alternatives; the values within float noise (the first call missed
    # the cache, the stream hit it: another summation order)
    assert _shape(final.logprobs) == _shape(r.logprobs)
    scale = max(1.0, *(abs(t.logprob) for t in r.logprobs))
    for a, b in zip(final.logprobs, r.logprobs, strict=True):
        for x, y in zip((a, *a.top), (b, *b.top), strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-4 * scale
    assert engine.query(IMAGE, QUESTION, settings=s).logprobs is None


def test_lookahead_keeps_constrained_rows_and_their_answers() -> None:
    """With look-ahead (the next step queued before this one's tokens are read) a constrained
    row's mask is still filled after its previous token is known: the same answers."""
    answers = []
    for lookahead in (False, True):
        with Engine(None, device="cpu", dtype="float32", lookahead=lookahead) as e:
            futures = [
                e.submit_query(IMAGE, QUESTION, settings=_settings(mode, j, 48), stop=stop,
                               response_format=None if j % 2 else _schema(SCHEMAS[j]))
                for j in range(8) for mode in MODES for stop in (None, "e")
            ]  # fmt: skip
            answers.append([f.result().answer for f in futures])
            if lookahead:
                assert e._executor.lookahead_counters.steps > 0
    assert answers[0] == answers[1]
