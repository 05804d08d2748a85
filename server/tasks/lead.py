"""Where a continue without a new prompt picks up its output's text (engine TextLead).

Each run has its own detokenizer and stop matcher. A run that ended inside a character (its
last tokens hold the first bytes of it) showed those bytes as one U+FFFD, as a finished text
must; and a run may have ended right after the first characters of a stop string. A continue
without a prompt extends the same output, so its run starts where the last one's text stood:
its detokenizer goes on after the output's last tokens (the character completes in its text,
and the output's trailing U+FFFD that stood for it is taken back), and its stop strings are
matched over the output's last characters too (a stop string begun there ends the run; what was
shown of it stays shown). Only after an end that cut the text short (max_tokens, a stop
request, an interruption): after a stop string the text ends where the string began, so the
characters before it and after it do not meet.

The same continue's grammar (a constrained output) reads the output's tokens first
(`grammar_prefix`): those whose text is the output's text as shown. A stop string's tokens are in
the history (the state read them) but not in the text, so the grammar reads none of them either,
or it would go on from an output the client never sees. Their text is read as the runs'
detokenizers read it: bytes that are not UTF-8 (free text before a tool call's trigger may hold
any token) show as U+FFFD, and are spelled by the tokens that hold them.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from server.engine.types import EOS_TOKEN, TextLead
from server.tasks.records import Task

TAIL_TOKENS = 3
"""Output tokens that can hold the bytes of an unfinished character (at most 3, at least one
byte each)."""
CUT_SHORT = ("length", "stopped", "interrupted")
"""The finish reasons after which the next run's text continues the output's."""
REPLACEMENT = "\ufffd"


TokenBytes = Callable[[Sequence[int]], bytes]


def continued(t: Task, stops: Sequence[str], token_bytes: TokenBytes) -> tuple[TextLead | None, int]:
    """The TextLead of a continue of `t` without a prompt (None: none needed), and how many
    characters to take back from the end of its output's text (0 or 1: the U+FFFD that stood for
    an unfinished character, which the new run's text completes)."""
    out = t.out
    if not len(out) or t.finish_reason not in CUT_SHORT:
        return None, 0
    tail = t.tokens[max(t.out_start, len(t.tokens) - TAIL_TOKENS) :].tolist()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    utf8.decode(token_bytes(tail))
    unfinished = bool(utf8.getstate()[0]) and out.text.endswith(REPLACEMENT)
    back = 1 if unfinished else 0
    longest = max((len(s) for s in stops), default=0)
    shown = out.text[: len(out.text) - back][-(longest - 1) :] if longest > 1 else ""
    if not unfinished and not shown:
        return None, 0
    return TextLead(tuple(tail) if unfinished else (), shown), back


def grammar_prefix(t: Task, token_bytes: TokenBytes | None) -> tuple[int, ...]:
    """The tokens of `t`'s output that a continue's grammar reads before its first token
    (SamplingParams.grammar_prefix): those whose text is the output's text as shown, less EOS
    (no text: the separator a stop token left). A stop string's tokens are left out, after the
    run it ended and between the runs of an output it cut (token_bytes None: all are read).
    ValueError (the request's fault: 422) when no run of the tokens spells the text: a stop
    string began inside a token that also holds the output's last characters."""
    out = [x for x in t.tokens[t.out_start :] if x != EOS_TOKEN]
    text = t.out.text
    if token_bytes is None or token_bytes(out).decode("utf-8", "replace") == text:
        return tuple(out)  # every token shows (the usual case: no stop string cut the output)
    taken = _spell([token_bytes((x,)) for x in out], text)
    if taken is None:
        raise ValueError(
            "the output so far cannot be continued under its grammar: no run of its tokens spells "
            "the output shown (a stop string began inside the token that holds the output's last "
            "characters); a new prompt starts a new output, and response_format "
            '{"type": "text"} continues this one without a grammar'
        )
    return tuple(out[i] for i in taken)


def _spell(parts: Sequence[bytes], text: str) -> list[int] | None:
    """The indices of `parts`, in order, whose bytes decode (UTF-8, each invalid sequence as one
    U+FFFD, as the runs' detokenizers show them) to `text`, the others left out (None: there are
    none). Decoded, not compared as bytes: a U+FFFD of the text is either its own three bytes or
    bytes that are not UTF-8 (free text before a tool call's trigger may hold any token). The
    first bytes of a character held where a part is left out show as one U+FFFD (the stop
    string's bytes that came next are not its rest: its run showed them so), and so do those
    held at the end (a run cut it: the output's last U+FFFD).

    Depth first, a part that fits taken before it is left out; a (part, position, held bytes)
    that led nowhere is not tried again, and none is tried whose parts left have fewer bytes than
    its text left needs: the parts may leave out only their bytes beyond the text's (a stop
    string's), so even a search that fails (a 422) tries about the parts times those bytes, not
    the parts squared (seconds on the event loop for an output of 2,000 tokens)."""
    utf8 = _Utf8(parts)
    need = _fewest_bytes(text)
    have = list(accumulate((len(b) for b in reversed(parts)), initial=0))[::-1]  # [i]: bytes of parts[i:]
    dead: set[tuple[int, int, bytes]] = set()
    # [part, characters of text spelled, bytes held, next branch: 0 take, 1 leave out, 2 none]
    # (the text ends after the last part: a stop string's tokens at the end are left out too)
    stack: list[list[Any]] = [[0, 0, b"", 0]]
    while stack:
        frame = stack[-1]
        i, p, held, branch = frame
        end = utf8.end(held)
        if i == len(parts) and p + len(end) == len(text) and text.startswith(end, p):
            return [f[0] for f in stack[:-1] if f[3] == 1]
        if i == len(parts) or branch == 2 or (i, p, held) in dead or need[p] > len(held) + have[i]:
            dead.add((i, p, held))
            stack.pop()
            continue
        frame[3] = branch + 1
        # take part i (its bytes go on after those held), or leave it out (the held bytes end
        # where its run's text ended)
        shown, rest = utf8.part(i, held) if branch == 0 else (end, b"")
        if text.startswith(shown, p):
            stack.append([i + 1, p + len(shown), rest, 0])
    return None


def _fewest_bytes(text: str) -> list[int]:
    """[p]: the fewest bytes whose text is text[p:] (a U+FFFD may stand for one byte)."""
    sizes = (1 if c == REPLACEMENT else len(c.encode()) for c in reversed(text))
    return list(accumulate(sizes, initial=0))[::-1]


class _Utf8:
    """The text of parts after given held bytes, as an incremental UTF-8 decoder with
    errors="replace" (the runs' detokenizers) reads them; a part after none held is read once."""

    def __init__(self, parts: Sequence[bytes]) -> None:
        self.parts = parts
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fresh: dict[int, tuple[str, bytes]] = {}

    def part(self, i: int, held: bytes) -> tuple[str, bytes]:
        """(the text parts[i] completes after `held`, the bytes then held)."""
        if held:
            return self._read(held, self.parts[i])
        if i not in self.fresh:
            self.fresh[i] = self._read(b"", self.parts[i])
        return self.fresh[i]

    def end(self, held: bytes) -> str:
        """The text of bytes held where a run ended: one U+FFFD (none held: none)."""
        return self._read(held, b"", True)[0] if held else ""

    def _read(self, held: bytes, data: bytes, final: bool = False) -> tuple[str, bytes]:
        self.decoder.setstate((held, 0))
        return self.decoder.decode(data, final), self.decoder.getstate()[0]
