"""Chat without a model: the conversation's prompt (query blocks) and message validation."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from kestrel.engine.chat import MAX_IMAGES, parse_messages
from kestrel.engine.replies import ReplyMemory
from kestrel.errors import InvalidInputError
from kestrel.skills import ChatSkill, ChatTurn, QuerySkill, Settings, chat_prompt
from kestrel.tokens import ImageToken, TextToken
from tests.unit.test_skills import ANSWER, EOS, THINKING, Script, drive


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, format="PNG")
    return out.getvalue()


def _ids(tokens) -> list[int]:
    return [t.token_id for t in tokens]


def test_one_turn_chat_is_the_query_prompt() -> None:
    ops = Script([])
    for reasoning in (False, True):
        chat = chat_prompt(ops, [ChatTurn("what is it")], reasoning=reasoning)
        query = QuerySkill(ops, "what is it", Settings(), reasoning=reasoning).prompt
        assert chat == query


def test_turn_n_plus_1_starts_with_turn_n_prompt_then_its_reply() -> None:
    ops = Script([])
    first = chat_prompt(ops, [ChatTurn("what is it")])
    second = chat_prompt(ops, [ChatTurn("what is it", "a red ball"), ChatTurn("why")])
    reply = [TextToken(i) for i in ops.encode("a red ball")]
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + len(reply)] == reply
    block = chat_prompt(ops, [ChatTurn("why")])[1:]  # the next query block, without BOS
    assert second[len(first) + len(reply) :] == block
    assert _ids(second).count(0) == 1  # BOS once, at the start
    thinking = chat_prompt(
        ops, [ChatTurn("what is it", "a red ball"), ChatTurn("why")], reasoning=True
    )
    assert _ids(thinking)[-2:] == [ANSWER, THINKING]
    assert _ids(thinking)[: len(first)] == _ids(first)  # earlier turns never reason


def test_chat_prompt_rejects_malformed_turn_lists() -> None:
    ops = Script([])
    with pytest.raises(InvalidInputError):
        chat_prompt(ops, [])
    with pytest.raises(InvalidInputError):
        chat_prompt(ops, [ChatTurn("a"), ChatTurn("b")])  # the first has no reply
    with pytest.raises(InvalidInputError):
        chat_prompt(ops, [ChatTurn("a", "b")])  # nothing left to answer


def test_chat_skill_decodes_like_the_query_skill() -> None:
    turns = [ChatTurn("what", "that"), ChatTurn("why")]
    skill = ChatSkill(Script([20, 21, EOS]), turns, Settings())
    assert drive(skill) == [TextToken(20), TextToken(21)]
    assert skill.finish_reason == "stop" and skill.output_tokens() == (20, 21)
    assert skill.max_feeds == Settings().max_tokens


def test_messages_fold_the_system_prompt_and_alternate() -> None:
    conv = parse_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A ball.", "reasoning": {"text": "ignored"}},
            {"role": "user", "content": "Colour?"},
        ]
    )
    assert conv.turns == (ChatTurn("Be brief.\n\nWhat?", "A ball."), ChatTurn("Colour?"))
    assert conv.image is None
    assert parse_messages([{"role": "user", "content": "hi"}]).turns == (ChatTurn("hi"),)


def test_one_image_in_the_first_user_turn_is_decoded_once() -> None:
    url = "data:image/png;base64," + base64.b64encode(_png((9, 8, 7))).decode()
    for part in (
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image", "image": _png((9, 8, 7))},
    ):
        conv = parse_messages([{"role": "user", "content": [part, {"type": "text", "text": "Q"}]}])
        assert conv.image is not None and conv.image.pixels.shape == (6, 8, 3)


IMG = {"type": "image", "image": b"never decoded"}
TEXT = {"type": "text", "text": "q"}
USER = {"role": "user", "content": "hi"}
BAD = [
    ("not-a-list", "hello"),
    ("empty", []),
    ("not-an-object", ["hi"]),
    ("unknown-role", [{"role": "tool", "content": "x"}]),
    ("tool-calls", [{"role": "user", "content": "x", "tool_calls": [{}]}]),
    ("ends-with-assistant", [USER, {"role": "assistant", "content": "x"}]),
    ("two-users", [USER, USER]),
    ("starts-with-assistant", [{"role": "assistant", "content": "x"}, USER]),
    (
        "late-system",
        [USER, {"role": "assistant", "content": "x"}, {"role": "system", "content": "x"}],
    ),
    ("empty-text", [{"role": "user", "content": "  "}]),
    ("content-number", [{"role": "user", "content": 5}]),
    ("bad-part", [{"role": "user", "content": [{"type": "audio"}]}]),
    ("image-in-assistant", [USER, {"role": "assistant", "content": [IMG]}, USER]),
    ("image-in-system", [{"role": "system", "content": [IMG]}, USER]),
    (
        "too-many-images",
        [{"role": "user", "content": [IMG] * (MAX_IMAGES + 1) + [TEXT]}],
    ),
    (
        "remote-url",
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                    {"type": "text", "text": "q"},
                ],
            }
        ],
    ),
    (
        "bad-base64",
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
                    {"type": "text", "text": "q"},
                ],
            }
        ],
    ),
    ("not-an-image", [{"role": "user", "content": [IMG, {"type": "text", "text": "q"}]}]),
]


@pytest.mark.parametrize(("messages",), [(m,) for _, m in BAD], ids=[n for n, _ in BAD])
def test_bad_messages_raise_invalid_input(messages) -> None:
    with pytest.raises(InvalidInputError):
        parse_messages(messages)


def test_the_image_limit_is_named() -> None:
    many = [{"role": "user", "content": [IMG] * (MAX_IMAGES + 1) + [TEXT]}]
    with pytest.raises(InvalidInputError, match=f"at most {MAX_IMAGES} images"):
        parse_messages(many)  # counted before anything is decoded (IMG is not an image)


def test_images_in_several_turns_are_placed_before_their_blocks() -> None:
    red, blue = _png((200, 0, 0)), _png((0, 0, 200))
    conv = parse_messages(
        [
            {"role": "user", "content": [{"type": "image", "image": red}, TEXT]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "no image"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "image", "image": blue}, TEXT]},
        ]
    )
    assert [turn for turn, _ in conv.images] == [0, 2]
    assert conv.image is conv.images[0][1]  # the first image keys the namespace
    turns = conv.placed(5)
    assert [len(t.images) for t in turns] == [1, 0, 1]
    assert turns[0].images[0] != turns[2].images[0]
    assert all(t.images[0].kv_length() == 5 for t in (turns[0], turns[2]))
    ops = Script([])
    prompt = chat_prompt(ops, turns)
    plain = chat_prompt(ops, conv.turns)
    at = [i for i, t in enumerate(prompt) if isinstance(t, ImageToken)]
    assert at[0] == 1  # right after BOS, as for a query
    # the third turn's image opens its block: right after the second reply
    assert prompt[at[1] + 1 :] == plain[at[1] - 1 :]
    assert [t for t in prompt if not isinstance(t, ImageToken)] == plain


def test_a_reply_with_ids_replays_them_instead_of_tokenizing() -> None:
    ops = Script([])
    spelled = chat_prompt(ops, [ChatTurn("q", "a red ball"), ChatTurn("why")])
    replayed = chat_prompt(ops, [ChatTurn("q", "a red ball", (7, 8, 9)), ChatTurn("why")])
    first = len(chat_prompt(ops, [ChatTurn("q")]))
    reply = len(ops.encode("a red ball"))
    assert _ids(replayed)[first : first + 3] == [7, 8, 9]
    assert replayed[first + 3 :] == spelled[first + reply :]  # the next block is unchanged


def test_reply_memory_is_bounded_per_namespace_and_over_namespaces() -> None:
    memory = ReplyMemory(per_namespace=2, namespaces=2)
    memory.remember("a", "one", [1])
    memory.remember("a", "two", [2])
    assert memory.recall("a", "one") == (1,)  # refreshed: "two" is now the oldest
    memory.remember("a", "three", [3])
    assert memory.recall("a", "two") is None and memory.recall("a", "three") == (3,)
    assert memory.recall("b", "one") is None  # per namespace
    memory.remember("b", "one", [4])
    memory.remember("c", "one", [5])  # three namespaces: the least recent ("a") goes
    assert memory.recall("a", "one") is None and memory.recall("b", "one") == (4,)
    assert len(memory) == 2
    memory.remember("c", "", [6])  # nothing to replay
    memory.remember("c", "x", [])
    assert memory.recall("c", "") is None and memory.recall("c", "x") is None
    turns = memory.replay("c", [ChatTurn("q", "one"), ChatTurn("q", "two"), ChatTurn("r")])
    assert [t.reply_ids for t in turns] == [(5,), None, None]
    build = memory.recording("d", lambda *a: type("R", (), {"content": "z", "tokens": (9,)})())
    build(object(), object())
    assert memory.recall("d", "z") == (9,)
    with pytest.raises(ValueError):
        ReplyMemory(per_namespace=0)
