"""Sampled answers through the Engine: the batch is sampled on the device together, and a
seeded request answers the same whatever shares its batch; unseeded requests differ."""

from __future__ import annotations

from kestrel_kernels.counting import LaunchCounter, active_counter

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12}


def test_a_seeded_answer_does_not_depend_on_its_batch(make_engine, images) -> None:
    engine = make_engine(max_batch_size=8)
    image = next(iter(images.values()))
    seeded = {**SAMPLED, "seed": 1234}
    alone = engine.query(image, "What is in the picture?", settings=seeded)
    gate = engine._loop.pause()  # everything below arrives in one batch
    others = [engine.submit_query(image, f"Question {i}?", settings={**SAMPLED, "seed": i})
              for i in range(5)]  # fmt: skip
    mine = engine.submit_query(image, "What is in the picture?", settings=seeded)
    gate.set()
    batched = mine.result(timeout=120)
    assert batched.answer == alone.answer
    answers = {f.result(timeout=120).answer for f in others}
    assert len(answers) > 1, "five seeds gave one answer: the draws are not seeded per request"


def test_decode_steps_read_the_batch_back_once(make_engine, images) -> None:
    """The sampler reads a sampled decode step back in one transfer, however many rows (the
    forward itself is left out: on a CPU the torch attention backend reads lengths)."""
    engine = make_engine(max_batch_size=8)
    executor = engine._executor
    steps: list[int] = []
    original = executor.decode
    forward = engine.runtime.decode_step

    def model_only(handles, tokens):  # the forward's own CPU reads are not the sampler's
        with active_counter().paused():
            return forward(handles, tokens)

    engine.runtime.decode_step = model_only

    def counted(handles, tokens, **kw):
        with LaunchCounter() as c:
            out = original(handles, tokens, **kw)
        steps.append(c.syncs)
        return out

    executor.decode = counted
    image = next(iter(images.values()))
    gate = engine._loop.pause()
    futures = [engine.submit_query(image, f"Question {i}?", settings=SAMPLED) for i in range(6)]
    gate.set()
    for f in futures:
        f.result(timeout=120)
    assert steps and all(n == 1 for n in steps), steps
