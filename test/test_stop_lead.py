"""Stop strings and the hidden leading whitespace of a chat reply (the gap after "Assistant:",
which the chat route strips): with `hidden_lead` no stop string matches inside that gap, so
`stop` applies to the text the client is shown; without it (completions, tasks) the raw text
is matched as before. The HTTP side: test_openai.py
(test_chat_stop_strings_never_match_in_the_hidden_leading_whitespace)."""

from __future__ import annotations

import pytest

from server.engine.text import StopMatcher, StopStream, open_stream
from server.engine.types import SamplingParams


def matched(m: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    """(the text m lets out of chunks fed one by one, then flushed; whether a stop string hit)"""
    out = ""
    for c in chunks:
        t, hit = m.feed(c)
        out += t
        if hit:
            return out, True
    return out + m.flush(), False


@pytest.mark.parametrize("stops,chunks,expect", [
    (("\n",), ["\n\n", "Hello\n", "x"], ("\n\nHello", True)),  # QA's case: was ("", True)
    (("\n",), ["\n", "\n", "Hi"], ("\n\nHi", False)),
    (("\n\n",), ["\n\n\n", "a\n\nb"], ("\n\n\na", True)),
    ((" ",), ["\t\t  ", " word", " more"], ("\t\t   word", True)),
    ((" Hello",), [" Hello world"], (" Hello world", False)),  # begins in the gap: shown "Hello world"
    (("ab",), ["  a", "b"], ("  ", True)),  # a partial match right after the gap is held back
    (("x",), ["\xa0\u3000 ", "yx"], ("\xa0\u3000 y", True)),  # the gap is what str.lstrip strips
    (("\n",), [" \n "], (" \n ", False)),  # a reply of whitespace only: nothing is shown, nothing stops
])  # fmt: skip
def test_no_stop_string_matches_in_the_hidden_leading_whitespace(stops, chunks, expect):
    assert matched(StopMatcher(stops, hidden_lead=True), chunks) == expect


@pytest.mark.parametrize("stops,chunks,expect", [
    (("\n",), ["\n\n", "Hello\n"], ("", True)),
    ((" Hello",), [" Hello world"], ("", True)),
])  # fmt: skip
def test_without_hidden_lead_the_raw_text_is_matched(stops, chunks, expect):
    """Completions and tasks: nothing is hidden, a stop string may match at the very start."""
    assert matched(StopMatcher(stops), chunks) == expect


def test_shown_text_still_begins_a_stop_string_without_hidden_lead():
    assert matched(StopMatcher(("abc",), "xab"), ["c", "d"]) == ("", True)
    assert matched(StopMatcher(("abc",), "xab", hidden_lead=True), ["c", "d"]) == ("cd", False)


class _Dec:
    """A decoder whose token i is PIECES[i]."""

    PIECES = {1: "\n\n", 2: "Hi", 3: " there", 4: "\n", 5: "x"}

    def push_one(self, token: int) -> str:
        return self.PIECES[token]

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("hidden,expect", [(True, "\n\nHi there"), (False, "")])
def test_open_stream_reads_hidden_lead(hidden, expect):
    """The engine's stream of a request with hidden_lead matches past the gap."""
    st = open_stream("r", None, _Dec(), SamplingParams(stop=("\n",), hidden_lead=hidden))
    assert isinstance(st, StopStream)
    out = []
    for t in (1, 2, 3, 4, 5):
        if st.match(t):
            break
        out.append(st.emit(t).text)
    assert "".join(out) == expect
