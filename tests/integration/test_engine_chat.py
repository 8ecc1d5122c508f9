"""Engine.chat on the fixture model: one skill (a one-turn chat is a query), the cache through
a conversation, greedy parity with a cache-off engine, stream == blocking, async, limits."""

from __future__ import annotations

import asyncio
import random
from itertools import pairwise

import pytest

from kestrel.engine.chat import MAX_IMAGES
from kestrel.errors import InvalidInputError, PromptTooLongError
from kestrel.skills.prompts import query_prompt
from tests.conftest import fixture_dir
from tests.integration.conftest import GREEDY, assert_idle

SHAPES = (fixture_dir() / "images" / "shapes_378.png").read_bytes()
SCENE = (fixture_dir() / "images" / "scene_800x600.png").read_bytes()
QUESTIONS = ("What is in the picture?", "Which colour is it?", "How many are there?")


def _user(text: str, image: object = None) -> dict:
    if image is None:
        return {"role": "user", "content": text}
    return {
        "role": "user",
        "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
    }


def _converse(engine, image, **kw) -> list:
    """Three turns, each reply sent back as the assistant message; the results in order."""
    messages = [{"role": "system", "content": "Answer briefly."}]
    results = []
    for i, question in enumerate(QUESTIONS):
        messages.append(_user(question, image if i == 0 else None))
        result = engine.chat(messages, settings=GREEDY, **kw)
        messages.append(result.message)
        results.append(result)
    return results


@pytest.fixture(scope="module")
def engines():
    from kestrel import Engine

    options = {"device": "cpu", "dtype": "float32", "kv_cache_pages": 6000}
    with (
        Engine(**options, model=str(fixture_dir())) as on,
        Engine(**options, model=str(fixture_dir()), enable_prefix_cache=False) as off,
    ):
        yield on, off
        assert_idle(on)
        assert_idle(off)


def test_one_turn_chat_equals_query(engines) -> None:
    on, _ = engines
    for reasoning in (False, True):
        want = on.query(SHAPES, "What is it?", settings=GREEDY, reasoning=reasoning)
        got = on.chat([_user("What is it?", SHAPES)], settings=GREEDY, reasoning=reasoning)
        assert (got.content, got.tokens, got.finish_reason) == (
            want.answer,
            want.tokens,
            want.finish_reason,
        )
        assert got.reasoning == want.reasoning
        assert got.message["role"] == "assistant" and got.message["content"] == want.answer
        assert ("reasoning" in got.message) == reasoning


@pytest.mark.parametrize("image", [SHAPES, None], ids=["image", "text-only"])
def test_conversation_hits_the_cache_through_every_earlier_prompt(engines, image) -> None:
    on, off = engines
    salt = f"chat-{image is None}"  # a namespace of its own: no earlier test warms it
    results = _converse(on, image, cache_salt=salt)
    baseline = _converse(off, image)
    assert [r.content for r in results] == [r.content for r in baseline]  # greedy parity
    assert [r.tokens for r in results] == [r.tokens for r in baseline]
    assert results[0].metrics.cached_tokens == 0
    for before, after in pairwise(results):
        # turn n+1's prompt contains turn n's prompt verbatim: all of it is cached
        assert after.metrics.cached_tokens >= before.metrics.input_tokens
        assert after.metrics.input_tokens > before.metrics.input_tokens
    assert all(r.metrics.cached_tokens == 0 for r in baseline)
    on.check_integrity()


def _turns(engine, image, replies=None, **kw) -> list:
    """Four turns; turn i+1 sends back ``replies[i]`` (default: the reply as returned)."""
    messages, results = [], []
    for i, question in enumerate((*QUESTIONS, "Anything else?")):
        messages.append(_user(question, image if i == 0 else None))
        result = engine.chat(messages, settings=GREEDY, **kw)
        reply = replies[i] if replies else result.content
        messages.append({"role": "assistant", "content": reply})
        results.append(result)
    return results


@pytest.mark.parametrize("image", [SHAPES, None], ids=["image", "text-only"])
def test_later_turns_compute_only_their_new_block(engines, image) -> None:
    """Answers are retained: turn n+1 hits through turn n's prompt AND its answer, so its
    uncached positions are only the new user block (its framing and text)."""
    on, off = engines
    salt = f"retain-{image is None}"
    results = _turns(on, image, cache_salt=salt)
    baseline = _turns(off, image)
    assert [r.tokens for r in results] == [r.tokens for r in baseline]  # greedy parity
    ops = on._factory.ops
    questions = (*QUESTIONS, "Anything else?")
    for i, (before, after) in enumerate(pairwise(results), start=1):
        assert before.tokens  # every generated token was fed, so every one is retained
        assert after.metrics.cached_tokens == before.metrics.input_tokens + len(before.tokens)
        block = query_prompt(ops.tokens, ops.encode, questions[i])[1:]  # no BOS: framing + text
        assert after.metrics.input_tokens - after.metrics.cached_tokens == len(block)
    on.check_integrity()
    assert on.runtime.counters.retained_tokens > 0


def test_without_retention_or_with_an_edited_reply_the_answer_is_recomputed(engines) -> None:
    from kestrel import Engine

    on, _ = engines
    options = {"device": "cpu", "dtype": "float32", "kv_cache_pages": 3000}
    with Engine(**options, model=str(fixture_dir()), retain_decoded=False) as plain:
        kept = _turns(plain, SHAPES)
        for before, after in pairwise(kept):  # the prompt hits, the answer does not
            assert after.metrics.cached_tokens == before.metrics.input_tokens
        assert plain.runtime.counters.retained_tokens == 0
        assert_idle(plain)
    edited = _turns(on, SHAPES, replies=[" edited", " also edited", " x", " y"], cache_salt="ed")
    assert [r.tokens for r in edited[:1]] == [kept[0].tokens]
    for before, after in pairwise(edited):  # correct, just not a hit through the answer
        assert before.metrics.input_tokens <= after.metrics.cached_tokens
        assert after.metrics.cached_tokens < before.metrics.input_tokens + len(before.tokens)


def test_a_returned_reply_replays_its_generated_ids(engines) -> None:
    """When re-tokenizing the returned text would spell it differently, the remembered ids
    are used, so the next turn still hits through the answer."""
    on, _ = engines
    first = on.chat([_user("Spell it?", SHAPES)], settings=GREEDY, cache_salt="spell")
    text, ops = first.content, on._factory.ops
    respelled = tuple(i for ch in text for i in ops.encode(ch))  # one token per character
    assert ops.decode(list(respelled)) == text and respelled != first.tokens
    key = (None, "spell", on.prepare_image(SHAPES).digest)
    assert on._replies.recall(key, text) == first.tokens
    messages = [_user("Spell it?", SHAPES), first.message, _user("Again?")]
    second = on.chat(messages, settings=GREEDY, cache_salt="spell")
    assert second.metrics.cached_tokens == first.metrics.input_tokens + len(first.tokens)
    on._replies.remember(key, text, respelled)  # a client's reply maps to other ids now
    third = on.chat(messages, settings=GREEDY, cache_salt="spell")
    assert third.metrics.input_tokens == (
        second.metrics.input_tokens - len(first.tokens) + len(respelled)
    )
    assert third.metrics.cached_tokens == first.metrics.input_tokens  # a miss from the reply on


def test_four_turns_over_two_images_compute_only_each_new_block(engines) -> None:
    """Turn 1 shows one image, turn 3 a second: every later turn's uncached positions are its
    new user block and, in turn 3, the new image's block; never the previous answer. Greedy
    answers equal a cache-off engine's; the namespace is the first image's."""
    on, off = engines
    ops, n = on._factory.ops, on.config.image_tokens
    questions = ("What is it?", "Which colour?", "And this one?", "Which is bigger?")
    images = {0: SHAPES, 2: SCENE}

    def converse(engine, **kw) -> list:
        messages, out = [], []
        for i, q in enumerate(questions):
            messages.append(_user(q, images.get(i)))
            out.append(engine.chat(messages, settings=GREEDY, **kw))
            messages.append(out[-1].message)
        return out

    encodes = on.runtime.counters.vision_encodes
    results, baseline = converse(on, cache_salt="two-images"), converse(off)
    assert on.runtime.counters.vision_encodes - encodes == 2  # each image once, in its turn
    assert [r.tokens for r in results] == [r.tokens for r in baseline]
    assert results[0].metrics.input_tokens == n + len(
        query_prompt(ops.tokens, ops.encode, questions[0])
    )
    for i, (before, after) in enumerate(pairwise(results), start=1):
        assert after.metrics.cached_tokens == before.metrics.input_tokens + len(before.tokens)
        block = len(query_prompt(ops.tokens, ops.encode, questions[i])) - 1 + (n if i == 2 else 0)
        assert after.metrics.input_tokens - after.metrics.cached_tokens == block
    # a conversation starting from the same first image shares turn 1 (same namespace)
    again = on.chat([_user(questions[0], SHAPES)], settings=GREEDY, cache_salt="two-images")
    assert again.metrics.cached_tokens == again.metrics.input_tokens - 1
    on.check_integrity()


def test_stream_equals_blocking_and_async_equals_sync(engines) -> None:
    on, _ = engines
    messages = [
        _user("What is it?", SHAPES),
        {"role": "assistant", "content": " a shape"},
        _user("And then?"),
    ]
    want = on.chat(messages, settings=GREEDY)
    stream = on.chat(messages, settings=GREEDY, stream=True)
    assert "".join(stream) == want.content
    assert stream.result().content == want.content
    assert on.submit_chat(messages, settings=GREEDY).result().content == want.content

    async def run() -> tuple[str, str]:
        got = await on.achat(messages, settings=GREEDY)
        astream = await on.achat(messages, settings=GREEDY, stream=True)
        return got.content, "".join([d async for d in astream])

    assert asyncio.run(run()) == (want.content, want.content)


def test_bad_conversations_fail_on_the_callers_thread(engines) -> None:
    on, _ = engines
    before = on.stats().requests_failed
    with pytest.raises(InvalidInputError, match=f"at most {MAX_IMAGES} images"):
        on.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": SHAPES}] * (MAX_IMAGES + 1)
                    + [{"type": "text", "text": "q"}],
                }
            ]
        )
    with pytest.raises(PromptTooLongError):  # three 729-position images overflow 2,048
        on.chat([_user("a", SHAPES), {"role": "assistant", "content": "b"}, _user("c", SCENE),
                 {"role": "assistant", "content": "d"}, _user("e", SHAPES)])  # fmt: skip
    with pytest.raises(PromptTooLongError):
        on.chat(
            [_user("word " * 600), {"role": "assistant", "content": "word " * 600}, _user("more?")]
        )
    with pytest.raises(InvalidInputError):
        on.chat([_user("hi")], cache_salt="")
    assert on.stats().requests_failed == before  # nothing reached the scheduler


def test_random_conversations_with_cancellations_end_idle(engines) -> None:
    """Twelve conversations (some over the image, some text only, two salts) advance a turn at
    a time through submit_chat and streams; some turns are cancelled and retried. Every page
    is free or cached at the end and every invariant holds."""
    on, _ = engines
    cancelled = on.stats().requests_cancelled
    rng = random.Random(19)
    chats = []
    for i in range(12):
        first = _user(f"Conversation {i}: what is it?", SHAPES if i % 3 else None)
        chats.append(([first], f"tenant-{i % 2}"))
    for turn in range(3):
        futures, streams = [], []
        for messages, salt in chats:
            settings = {"temperature": rng.choice([0, 0.7]), "max_tokens": rng.randint(1, 6),
                        "seed": rng.randrange(1000)}  # fmt: skip
            if rng.random() < 0.3:
                streams.append(on.chat(messages, settings=settings, cache_salt=salt, stream=True))
            future = on.submit_chat(messages, settings=settings, cache_salt=salt)
            if rng.random() < 0.25:
                future.cancel()
            futures.append(future)
        for stream in streams[::2]:
            stream.cancel()
        for stream in streams[1::2]:
            assert "".join(stream) == stream.result().content
        for (messages, _), future in zip(chats, futures, strict=True):
            if future.cancelled():
                continue  # the user retries the same turn next round
            messages += [future.result().message, _user(f"Turn {turn + 1}?")]
    assert on.stats().requests_cancelled > cancelled
    assert_idle(on)
