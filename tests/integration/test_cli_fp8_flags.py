"""``--moe-weights {auto,fp8,dequantize}`` and ``--kv-dtype {auto,fp8}`` on every command that
loads a model: the Engine kwargs they become, the API's own messages for bad values, and the
model an FP8 checkpoint loads into with each."""

from __future__ import annotations

import argparse
import json

import pytest

import kestrel.engine
from kestrel import Engine
from kestrel.cli import build_parser, common, main
from kestrel.errors import InvalidInputError
from tests.conftest import FIXTURES

FP8 = FIXTURES / "md3-tiny-a-fp8"
IMAGE = str(FIXTURES / "md3-tiny-a" / "images" / "shapes_378.png")
OPTS = ["--model", str(FP8), "--device", "cpu", "--kv-cache-pages", "2000", "--max-tokens", "3",
        "--temperature", "0"]  # fmt: skip


def model_commands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand that takes ``--model`` (so loads one)."""
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if "--model" in p._option_string_actions}


def test_every_model_loading_command_has_both_flags() -> None:
    commands = model_commands()
    assert {"query", "caption", "point", "detect", "chat", "batch", "serve", "demo"} <= set(
        commands
    )
    for name, parser in commands.items():
        actions = parser._option_string_actions
        for flag in ("--moe-weights", "--kv-dtype"):
            assert flag in actions, f"kestrel {name} lacks {flag}"
            assert actions[flag].default is None, (name, flag)


@pytest.mark.parametrize(
    ("argv", "moe_weights", "kv_dtype"),
    [
        ([], None, None),
        (["--moe-weights", "auto", "--kv-dtype", "auto"], None, None),
        (["--moe-weights", "fp8"], "fp8", None),
        (["--moe-weights", "dequantize", "--kv-dtype", "fp8"], "dequantize", "fp8"),
    ],
)
def test_the_flags_become_the_engine_kwargs(argv, moe_weights, kv_dtype) -> None:
    parser = argparse.ArgumentParser()
    common.add_engine_options(parser)
    kwargs = common.engine_kwargs(parser.parse_args(argv))
    assert (kwargs["moe_weights"], kwargs["kv_dtype"]) == (moe_weights, kv_dtype)


@pytest.mark.parametrize(
    ("flag", "kwarg", "bad"),
    [("--moe-weights", "moe_weights", "fp16"), ("--kv-dtype", "kv_dtype", "int8")],
)
def test_a_bad_value_gets_the_apis_message(flag, kwarg, bad, capsys) -> None:
    with pytest.raises(InvalidInputError) as api:
        Engine(str(FP8), device="cpu", **{kwarg: bad})
    for command in (["query", IMAGE, "hi"], ["serve"], ["batch", "in.jsonl", "--output", "o"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, flag, bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {api.value}" in err, err
        assert "auto" in err  # the command line's spelling of None


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Engine]:
    """The engines the command line builds (kestrel.cli imports Engine when it needs one)."""
    engines: list[Engine] = []

    class Recording(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(kestrel.engine, "Engine", Recording)
    return engines


@pytest.mark.parametrize(("value", "fp8"), [("auto", True), ("fp8", True), ("dequantize", False)])
def test_moe_weights_reaches_the_model(value, fp8, built, capsys) -> None:
    """md3-tiny-a-fp8 keeps its FP8 experts (auto, fp8) or widens them (dequantize); the answer
    is the Engine's own for the same kwargs."""
    code = main(
        ["query", IMAGE, "What is in the picture?", "--json", *OPTS, "--moe-weights", value]
    )
    out = capsys.readouterr().out
    assert code == 0
    (engine,) = built
    assert engine.runtime.model.text.blocks[1].moe.fp8 is fp8
    moe_weights = None if value == "auto" else value
    with Engine(str(FP8), device="cpu", kv_cache_pages=2000, moe_weights=moe_weights) as e:
        want = e.query(IMAGE, "What is in the picture?", settings={"max_tokens": 3,
                                                                   "temperature": 0.0})  # fmt: skip
    assert json.loads(out)["answer"] == want.answer


def test_kv_dtype_fp8_reaches_the_loader(capsys) -> None:
    """md3-tiny-a-fp8 has no KV scales: the loader's refusal comes back through the CLI."""
    code = main(["query", IMAGE, "hi", *OPTS, "--kv-dtype", "fp8"])
    err = capsys.readouterr().err
    assert code != 0 and "kv_dtype='fp8' needs FP8 KV scales" in err, err
