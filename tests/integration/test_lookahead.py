"""Decode look-ahead (``runtime/lookahead.py``): the next step is queued before this one's
tokens are read. It must change no answer, leak no page, keep every invariant between steps,
and leave a steady step with no read that waits on an empty queue."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kestrel.errors import InvalidInputError
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.executor import BatchExecutor
from kestrel.runtime.sequence import PENDING
from kestrel.skills.base import Draw
from kestrel_kernels.backends import TORCH
from kestrel_kernels.counting import LaunchCounter, active_counter
from tests.integration.conftest import scheduler_paused, text_tokens
from tests.tolerance import assert_close

SAMPLED = {"temperature": 0.5, "top_p": 0.3, "max_tokens": 30}


def _submit_mix(engine, images) -> list:
    """Queries (greedy, seeded sampled, reasoning), captions, points and detects at once, some
    with budgets that run out mid-answer."""
    a, b = list(images.values())[:2]
    return [
        engine.submit_query(a, "What is in the image?", settings={"max_tokens": 40}),
        engine.submit_query(b, "Describe the colors.", settings={**SAMPLED, "seed": 3}),
        engine.submit_query(a, "Where is it?", settings={**SAMPLED, "seed": 4}, reasoning=True),
        engine.submit_query(b, "Count them.", settings={"max_tokens": 1}),
        engine.submit_caption(a, length="short", settings={"max_tokens": 25}),
        engine.submit_point(b, "the object", settings={"max_objects": 2}),
        engine.submit_detect(a, "the object", settings={"max_objects": 2}),
        engine.submit_query(None, "Say something.", settings={**SAMPLED, "seed": 5}),
    ]


def _answers(engine, images) -> list:
    with scheduler_paused(engine):
        futures = _submit_mix(engine, images)
    out = []
    for f in futures:
        r = f.result(timeout=300)
        out.append(
            (
                getattr(r, "answer", None),
                getattr(r, "caption", None),
                getattr(r, "points", None),
                getattr(r, "objects", None),
                getattr(r, "finish_reason", None),
            )
        )
    return out


def test_lookahead_changes_no_answer_and_leaks_nothing(make_engine, images) -> None:
    plain = make_engine()
    ahead = make_engine(lookahead=True)
    assert plain._executor.lookahead is False  # a CPU engine does not look ahead by default
    with pytest.raises(InvalidInputError, match="lookahead"):
        make_engine(lookahead="yes")
    want = _answers(plain, images)
    got = _answers(ahead, images)
    assert got == want
    c = ahead._executor.lookahead_counters
    assert c.steps > 0 and c.kept > 0, c
    assert c.kept + c.rolled_back == c.rows, c
    # what the runs left in the cache is the same (nothing pending was retained)
    p, a = plain.stats(), ahead.stats()
    assert (a.pages_cached, a.pages_free) == (p.pages_cached, p.pages_free)
    assert ahead.runtime.counters.retained_tokens == plain.runtime.counters.retained_tokens
    # make_engine checks both idle (every invariant, no page held) when the test ends


def test_invariants_hold_between_steps_with_look_ahead_pending(make_engine, images) -> None:
    """Step the scheduler by hand: after every step (a look-ahead position pending on most
    rows) the integrity checks pass; cancelling a running request mid-answer leaks nothing."""
    engine = make_engine()
    engine._executor.lookahead = True
    sched = engine._scheduler
    steps = []

    def drive():
        while sched.has_work():
            sched.step()
            sched.check_integrity()
            pending = sum(s.ahead for s in engine.runtime.active_sequences)
            steps.append(pending)
            if pending and not futures[1].done():  # cancel it with its look-ahead pending
                futures[1].cancel()

    with scheduler_paused(engine):
        futures = _submit_mix(engine, images)
    engine._loop.call(drive)  # on the scheduler thread, after the submissions
    assert max(steps) > 0, "no step left a look-ahead position pending"
    assert futures[1].cancelled()
    assert engine._executor.lookahead_counters.rolled_back > 0  # the cancelled row's, at least
    for f in futures[:1] + futures[2:]:
        f.result(timeout=300)


@pytest.mark.parametrize("settings", [{"max_tokens": 12}, SAMPLED])
def test_a_steady_step_reads_back_without_a_sync(make_engine, images, settings) -> None:
    """With look-ahead a running batch's step reads its tokens after the next step is queued:
    a deferred read, no sync. Without it, one sync per step. The forward counts as one launch
    (a graph replay) and nothing inside it: on a CPU the torch attention backend reads its
    lengths."""
    results = {}
    for lookahead in (False, True):
        engine = make_engine()
        engine._executor.lookahead = lookahead
        forward = engine.runtime.decoder.forward

        def model_only(*a, _forward=forward, **k):  # one launch, as a graph replay is
            counter = active_counter()
            with counter.opaque("forward") if counter is not None else contextlib.nullcontext():
                return _forward(*a, **k)

        engine.runtime.decoder.forward = model_only
        executor, original, steps = engine._executor, engine._executor.decode, []

        def counted(handles, tokens, _original=original, _steps=steps, **kw):
            with LaunchCounter() as c:
                out = _original(handles, tokens, **kw)
            _steps.append((c.syncs, c.deferred_reads))
            return out

        executor.decode = counted
        image = next(iter(images.values()))
        with scheduler_paused(engine):
            futures = [
                engine.submit_query(image, f"Question {i}?", settings=settings) for i in range(4)
            ]
        for f in futures:
            f.result(timeout=300)
        results[lookahead] = steps
    assert results[False] and all(s == (1, 0) for s in results[False]), results[False]
    ahead = results[True]
    assert all(sum(s) == 1 for s in ahead), ahead  # every step reads back exactly once
    assert sum(s == (0, 1) for s in ahead) >= len(ahead) // 2, ahead


class _Greedy:
    def next_draw(self) -> Draw:
        return Draw(0.0, 1.0)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_wrong_guess_is_rolled_back_and_recomputed(make_runtime, model, static) -> None:
    """Row A is fed the token the device chose (its look-ahead position is kept), row B
    another one (its position is rolled back and computed again): the logits equal plain
    decode steps fed the same tokens, and the pages hold the same KV. ``static``: the step
    CUDA graphs capture (run uncaptured), fed the ids on the device."""
    t = model.config.tokenizer
    prompts = [text_tokens([t.bos_id, 5, 6, 7]), text_tokens([t.bos_id, 9, 3])]
    plain, rt = make_runtime(), make_runtime(attention_backend="torch")
    if static:
        rt.decode_graphs = DecodeGraphs(
            model, rt.kv, rt.page_table.page_table, max_batch_size=8, backend=TORCH,
            capture=False,
        )  # fmt: skip
    executor = BatchExecutor(rt, lookahead=True)
    ref = [plain.start_sequence(p, max_new_tokens=6) for p in prompts]
    got = [rt.start_sequence(p, max_new_tokens=6) for p in prompts]
    for s, _ in got:
        executor._next_draw[s.batch_idx] = _Greedy().next_draw
    states = [s for s, _ in got]
    first = [text_tokens([int(lg.argmax())])[0] for _, lg in got]
    rows, _ = executor.decode(states, first, lookahead=True)
    assert all(s.ahead and s.fed[-1] is PENDING for s in states)
    want = plain.decode_step([s for s, _ in ref], first)
    assert_close(torch.stack([r.logits_V for r in rows]), want, rel=1e-5)
    chosen = [r.chosen for r in rows]
    other = (chosen[1] + 1) % model.config.text.vocab_size
    second = text_tokens([chosen[0], other])
    rows, _ = executor.decode(states, second)  # no further look-ahead
    c = executor.lookahead_counters
    assert (c.steps, c.kept, c.rolled_back) == (1, 1, 1)
    want = plain.decode_step([s for s, _ in ref], second)
    # B is recomputed alone (batch 1, not 2): the sums may reorder
    assert_close(torch.stack([r.logits_V for r in rows]), want, rel=1e-5)
    for s, (r, _) in zip(states, ref, strict=True):
        assert not s.ahead and s.fed == r.fed and s.length == r.length
        pages = rt.page_table.page_table[s.batch_idx, : s.length]
        ref_pages = plain.page_table.page_table[r.batch_idx, : r.length]
        for layer in range(model.config.text.n_layers):
            want_k = plain.kv.k[layer][ref_pages]
            assert_close(rt.kv.k[layer][pages], want_k, rel=1e-5)
    if static:
        assert rt.decode_graphs.replays == 0  # uncaptured: the static step ran
    rt.check_integrity()
    for s in states:
        executor.release(s)
    for r, _ in ref:
        plain.release_sequence(r)


def test_cli_no_lookahead_flag() -> None:
    """``--no-lookahead`` on every engine command turns it off; without it the Engine decides
    (on for CUDA)."""
    import argparse

    from kestrel.cli import common

    parser = argparse.ArgumentParser()
    common.add_engine_options(parser)
    assert common.engine_kwargs(parser.parse_args([]))["lookahead"] is None
    assert common.engine_kwargs(parser.parse_args(["--no-lookahead"]))["lookahead"] is False


def test_an_answers_last_token_costs_no_forward(make_engine, images, monkeypatch) -> None:
    """An answer cut at max_tokens ends with its last token unfed: a lone request makes one
    decode forward per fed token, and look-ahead queues no step for the last one (a step of
    rows that all end would be computed for nothing)."""
    engine = make_engine(lookahead=True)
    rt, forwards = engine.runtime, []
    for name in ("decode_step", "decode_ahead"):
        real = getattr(rt, name)

        def counted(handles, *args, _real=real, _name=name):
            forwards.append((_name, len(handles)))
            return _real(handles, *args)

        monkeypatch.setattr(rt, name, counted)
    image, cut = images["shapes_378"], 0
    for settings in ({"max_tokens": 3}, {**SAMPLED, "max_tokens": 4, "seed": 7}):
        forwards.clear()
        r = engine.query(image, "What is in the image?", settings=settings)
        # the prefill chose the first token; each forward feeds one and chooses the next (the
        # eos after the last, when the answer stops on its own)
        assert len(forwards) == len(r.tokens) - (r.finish_reason == "length"), forwards
        cut += r.finish_reason == "length"
    assert cut, "no answer reached max_tokens: the case under test never ran"
    assert engine._executor.lookahead_counters.steps > 0  # look-ahead did run
