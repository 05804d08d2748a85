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
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from server.engine.types import TextLead
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
