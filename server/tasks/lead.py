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
or it would go on from an output the client never sees.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

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
    parts = [token_bytes((x,)) for x in out]
    target = text.encode()
    if text.endswith(REPLACEMENT):  # the first bytes of a character the output's end cut
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        utf8.decode(b"".join(parts[-TAIL_TOKENS:]))
        if utf8.getstate()[0]:
            target = text[: -len(REPLACEMENT)].encode() + utf8.getstate()[0]
    taken = _spell(parts, target)
    if taken is None:
        raise ValueError(
            "the output so far cannot be continued under its grammar: no run of its tokens spells "
            "the output shown (a stop string began inside the token that holds the output's last "
            "characters); a new prompt starts a new output, and response_format "
            '{"type": "text"} continues this one without a grammar'
        )
    return tuple(out[i] for i in taken)


def _spell(parts: Sequence[bytes], target: bytes) -> list[int] | None:
    """The indices of `parts`, in order, whose concatenation is `target`, the others left out
    (None: there are none). Depth first, a part that fits taken before it is left out; a
    (part, position) that led nowhere is not tried again, so this is linear when the left-out
    parts are only where the parts stop fitting (a stop string's tokens)."""
    dead: set[tuple[int, int]] = set()
    stack = [[0, 0, 0]]  # [part, bytes of target spelled, next branch: 0 take, 1 leave out, 2 none]
    while stack:
        frame = stack[-1]
        i, p, branch = frame
        if p == len(target):
            return [f[0] for f in stack[:-1] if f[2] == 1]  # (those after i left out)
        if i == len(parts) or (i, p) in dead or branch == 2:
            dead.add((i, p))
            stack.pop()
            continue
        frame[2] = branch + 1
        if branch == 0 and target.startswith(parts[i], p):
            stack.append([i + 1, p + len(parts[i]), 0])
        elif branch == 1:
            stack.append([i + 1, p, 0])
    return None
