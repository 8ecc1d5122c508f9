"""Stop sequences (kestrel/skills/stops.py): the text cut at the first stop string, and a
stream that never shows text a match could still claim."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.errors import InvalidInputError
from kestrel.skills.stops import MAX_STOPS, StopText, parse_stop


class Pieces:
    """A fake detokenizer: id ``i`` is ``pieces[i]``; ids >= 1000 are held back (empty) until
    the next id or the flush, as an incomplete UTF-8 sequence would be."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.held = pieces, ""

    def push(self, i: int) -> str:
        if i >= 1000:
            self.held += self.pieces[i - 1000]
            return ""
        out, self.held = self.held + self.pieces[i], ""
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def _run(pieces: list[str], stops: list[str], hold: set[int] = frozenset()) -> tuple:
    """Push every piece (ids in ``hold`` held back), taking the stream after each push."""
    text = StopText(Pieces(pieces), stops)
    shown = []
    for i in range(len(pieces)):
        matched = text.push(i + 1000 if i in hold else i)
        shown.append(text.take())
        if matched:
            break
    text.close()
    shown.append(text.take())
    return text, shown


def _expected(pieces: list[str], stops: list[str], hold: set[int]) -> tuple[str, bool]:
    """The answer as generation would end it: text arrives piece by piece (a held piece with
    the next one), and the first arrival that completes a stop string cuts the text at the
    earliest match in it (a later, longer stop string is never generated)."""
    arrivals, held = [], ""
    for i, piece in enumerate(pieces):
        held += piece
        if i not in hold:
            arrivals.append(held)
            held = ""
    arrivals.append(held)  # the flush
    text = ""
    for piece in arrivals:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="abc.", min_size=0, max_size=4), min_size=1, max_size=12),
    st.lists(st.text(alphabet="abc.", min_size=1, max_size=3), min_size=1, max_size=3),
    st.sets(st.integers(0, 11)),
)
def test_text_is_cut_at_the_first_match_and_the_stream_never_runs_ahead(pieces, stops, hold):
    want, matched = _expected(pieces, stops, hold)
    text, shown = _run(pieces, stops, hold)
    assert text.text == want
    assert text.matched == matched
    assert "".join(shown) == want  # the stream adds up to the answer, nothing past it
    emitted = ""
    for piece in shown:  # at every point the stream shows a prefix of the answer
        emitted += piece
        assert want.startswith(emitted)
    assert 0 <= text.kept <= len(pieces)


def test_a_possible_start_is_held_back_until_ruled_out() -> None:
    text = StopText(Pieces(["Hello", " wor", "ld", " EN", "D!"]), ["END"])
    assert (text.push(0), text.take()) == (False, "Hello")
    assert (text.push(1), text.take()) == (False, " wor")
    assert (text.push(2), text.take()) == (False, "ld")
    assert (text.push(3), text.take()) == (False, " ")  # "EN" held: the start of "END"
    assert text.push(4) is True
    assert (text.take(), text.text, text.kept) == ("", "Hello world ", 4)


def test_a_match_inside_one_piece_and_at_the_start() -> None:
    text, shown = _run(["ab.cd", "ef"], ["."])
    assert (text.text, text.kept, "".join(shown)) == ("ab", 1, "ab")
    text, shown = _run([".x"], ["."])
    assert (text.text, text.kept, shown) == ("", 0, ["", ""])


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, ()), ("x", ("x",)), (["a", "b", "a"], ("a", "b")), (("END",), ("END",))],
)
def test_parse_stop(value, want) -> None:
    assert parse_stop(value) == want


@pytest.mark.parametrize("value", [3, [""], ["a", 3], ["x" * 300], ["a"] * (MAX_STOPS + 1), {}])
def test_parse_stop_refuses(value) -> None:
    with pytest.raises(InvalidInputError, match="stop"):
        parse_stop(value)
