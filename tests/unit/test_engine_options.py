"""One options object and one call value per skill (issue #50): ``EngineOptions`` is what
``Engine``, ``load_runtime``, the command line and the Ray replicas share, and each skill's
calls (``submit_*``, the blocking call, the ``a*`` twin, the desk's draft) are made from one
frozen call value. So a new option is one field: these tests read the source (``ast``) for the
signatures that still spell an option out, and the live signatures, flags and protocol for
where a field must reach."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
from pathlib import Path

import pytest

from kestrel import Engine
from kestrel.cli import common, engine_flags
from kestrel.engine import setup
from kestrel.engine.calls import SkillCalls
from kestrel.engine.options import EngineOptions
from kestrel.engine.skill_calls import CALLS, SkillCall, face

ROOT = Path(__file__).resolve().parents[2]
MAX_SALTED_SIGNATURES = 6  # was 28: every call, twin, future and draft spelled it out


def _signatures(root: Path):
    """(file, line, name, parameter names) of every function under ``root``."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                yield path.relative_to(ROOT), node.lineno, node.name, names, a.kwarg


def test_cache_salt_is_spelled_out_in_few_signatures() -> None:
    salted = [(f"{p}:{line}", name) for p, line, name, names, _ in _signatures(ROOT / "kestrel")
              if "cache_salt" in names]  # fmt: skip
    assert 0 < len(salted) <= MAX_SALTED_SIGNATURES, salted


@pytest.mark.parametrize(("path", "name"), [("engine/engine.py", "__init__"),
                                            ("engine/setup.py", "load_runtime")])  # fmt: skip
def test_engine_and_load_runtime_take_the_options_object(path: str, name: str) -> None:
    """In the source: ``(model, options, **overrides)``; live: every field a keyword."""
    found = [(names, kwarg) for p, _, n, names, kwarg in _signatures(ROOT / "kestrel")
             if str(p) == f"kestrel/{path}" and n == name]  # fmt: skip
    assert len(found) == 1, found
    names, kwarg = found[0]
    assert [n for n in names if n != "self"] == ["model", "options"] and kwarg is not None
    fields = [f.name for f in dataclasses.fields(EngineOptions)]
    for fn in (Engine, setup.load_runtime):
        params = inspect.signature(fn).parameters
        assert list(params)[2:] == fields, fn
        assert all(params[f.name].default == f.default for f in dataclasses.fields(EngineOptions))


def test_options_are_one_value_and_keywords_override_it() -> None:
    base = EngineOptions(device="cpu", max_batch_size=2)
    assert EngineOptions.of(base) is base and EngineOptions.of(None) == EngineOptions()
    assert EngineOptions.of(base, max_batch_size=3) == EngineOptions(device="cpu", max_batch_size=3)
    assert EngineOptions.of({"device": "cpu", "max_batch_size": 2}) == base
    with pytest.raises(TypeError, match="bogus"):
        EngineOptions.of(base, bogus=1)
    with pytest.raises(TypeError, match="EngineOptions"):
        EngineOptions.of("cpu")  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.device = "cuda"  # type: ignore[misc]


def test_bad_options_are_refused_before_anything_loads() -> None:
    """The checks moved with the values: the same messages as the keywords got."""
    with pytest.raises(setup.InvalidInputError, match="max_batch_size must be >= 1"):
        setup.load_runtime(None, EngineOptions(device="cpu", max_batch_size=0))
    with pytest.raises(setup.InvalidInputError, match="lookahead must be True, False or None"):
        Engine(None, EngineOptions(device="cpu"), lookahead="yes")


# an example value for each engine flag that takes one (a flag added without one fails here)
SAMPLES = {"--device": "meta", "--dtype": "float16", "--max-batch-size": "3",
           "--kv-cache-pages": "7", "--attention-backend": "torch", "--image-memory-mb": "64",
           "--embedding-cache-mb": "5", "--host-kv-gb": "1", "--moe-weights": "fp8",
           "--kv-dtype": "fp8"}  # fmt: skip


def test_every_option_has_a_flag_or_a_reason() -> None:
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    flagged, excused = set(engine_flags.ENGINE_FLAGS), set(engine_flags.NOT_ON_CLI)
    assert not flagged & excused, flagged & excused
    assert flagged | excused == fields, (fields - flagged - excused, (flagged | excused) - fields)
    assert all(len(why) > 20 for why in engine_flags.NOT_ON_CLI.values())


@pytest.mark.parametrize("option", list(engine_flags.ENGINE_FLAGS))
def test_each_flag_reaches_its_option(option: str) -> None:
    """Given alone, a flag changes its own field of the command line's EngineOptions and no
    other; not given, the field keeps the Engine's default."""
    parser = argparse.ArgumentParser()
    common.add_engine_options(parser)
    flag = engine_flags.ENGINE_FLAGS[option][0]
    takes_value = parser._option_string_actions[flag].nargs != 0
    assert not takes_value or flag in SAMPLES, f"give {flag} an example value in SAMPLES"
    argv = [flag, SAMPLES[flag]] if takes_value else [flag]
    given = common.engine_options(parser.parse_args(argv))
    default = common.engine_options(parser.parse_args([]))
    assert default == EngineOptions()
    changed = [f.name for f in dataclasses.fields(EngineOptions)
               if getattr(given, f.name) != getattr(default, f.name)]  # fmt: skip
    assert changed == [option]


CALL_OF = {call.skill: call for call in CALLS}


def _fields(call: type[SkillCall]) -> list[str]:
    return [f.name for f in dataclasses.fields(call)]


@pytest.mark.parametrize("skill", list(CALL_OF))
def test_every_face_of_a_skill_takes_its_call_values_fields(skill: str) -> None:
    """``submit_<skill>``, ``<skill>`` and ``a<skill>`` take exactly the call value's fields
    (and ``stream`` where the skill streams, but for a future): a field added to the value, or
    to :class:`SkillCall`, is a keyword of every call."""
    call = CALL_OF[skill]
    assert {"settings", "adapter", "cache_salt"} <= set(_fields(call))
    for name, streams in ((f"submit_{skill}", False), (skill, call.streams),
                          (f"a{skill}", call.streams)):  # fmt: skip
        params = list(inspect.signature(getattr(Engine, name)).parameters)
        want = [*_fields(call), *(["stream"] if streams else [])]
        assert params[0] == "self" and sorted(params[1:]) == sorted(want), name
    assert inspect.iscoroutinefunction(getattr(Engine, f"a{skill}"))


def test_a_new_field_reaches_every_face() -> None:
    """What "a new option is one field" means: a call value with one more field gets it in
    its faces' signatures, and the value the desk receives carries it."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class TimedQuery(CALL_OF["query"]):  # type: ignore[misc, valid-type]
        deadline_s: float | None = dataclasses.field(default=None, kw_only=True)

    drafted = []

    class Desk:
        def draft(self, value):
            drafted.append(value)
            return value

    class Requests:
        def submit(self, draft):
            return draft

    def method(self, *args, **options):
        value = TimedQuery(*args, **options)
        return self._requests.submit(self._drafts.draft(value))

    submit = face(method, TimedQuery, "submit")
    assert "deadline_s" in inspect.signature(submit).parameters
    owner = type("Owner", (), {"_drafts": Desk(), "_requests": Requests()})()
    value = submit(owner, None, "why?", cache_salt="t", deadline_s=2.0)
    assert drafted == [value] and (value.deadline_s, value.cache_salt) == (2.0, "t")


class _NoDesk:
    """Where a call is refused before it reaches the desk."""

    @property
    def _drafts(self):
        raise AssertionError("reached the desk")

    _requests = _drafts


@pytest.mark.parametrize(("name", "kwargs"), [
    ("point", {"stream": True}), ("submit_query", {"stream": True}), ("query", {"bogus": 1}),
    ("detect", {"spatial_refs": [[0.5, 0.5]]}), ("caption", {"question": "?"}),
])  # fmt: skip
def test_an_unknown_keyword_is_a_type_error_before_the_desk(name: str, kwargs: dict) -> None:
    method = getattr(SkillCalls, name)
    args = ("image.png",) if name == "caption" else ("image.png", "text")
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        method(_NoDesk(), *args, **kwargs)


def test_an_awaited_call_refuses_an_unknown_keyword_too() -> None:
    with pytest.raises(TypeError, match="stream"):
        asyncio.run(SkillCalls.adetect(_NoDesk(), "image.png", "car", stream=True))


def test_the_served_protocols_call_options_are_the_call_values() -> None:
    """The app's ``CallOptions`` (what every ServedEngine call takes) name SkillCall's
    fields: an option every call takes reaches the server's protocol too."""
    from kestrel.server.protocol import CallOptions

    assert list(CallOptions.__annotations__) == _fields(SkillCall)


def test_every_parsed_request_carries_the_call_options() -> None:
    """The routes pass ``call_options(call)`` on: each parsed request has every option."""
    pytest.importorskip("starlette", reason='needs the serve extra: pip install "kestrel[serve]"')
    from kestrel.server.chat import ChatCall
    from kestrel.server.payloads import Call
    from kestrel.server.protocol import CallOptions, call_options

    for parsed in (Call, ChatCall):
        names = {f.name for f in dataclasses.fields(parsed)}
        assert set(CallOptions.__annotations__) <= names, parsed
    stand_in = type("Parsed", (), {"settings": {"seed": 1}, "adapter": "a", "cache_salt": "t"})
    assert call_options(stand_in()) == {"settings": {"seed": 1}, "adapter": "a", "cache_salt": "t"}


def test_every_face_is_typed_for_editors() -> None:
    """Each generated face has a class annotation giving what it returns: a Future for
    ``submit_*``, an Awaitable for ``a*``, a stream beside the result exactly where the skill
    streams. A new skill's faces fail here until they are annotated."""
    from kestrel.engine.calls import SkillCalls
    from kestrel.engine.skill_calls import CALLS

    notes = SkillCalls.__annotations__
    for call in CALLS:
        for name, wrap in ((f"submit_{call.skill}", "Future["), (call.skill, ""),
                           (f"a{call.skill}", "Awaitable[")):  # fmt: skip
            note = notes[name]
            assert note.startswith(f"Callable[..., {wrap}"), (name, note)
            assert ("TextStream" in note) == (call.streams and wrap != "Future["), (name, note)
            assert callable(getattr(SkillCalls, name))
