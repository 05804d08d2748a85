"""Logprobs of a response's message text: `include: ["message.output_text.logprobs"]`, with
`top_logprobs` alternatives per token (0 without it), as OpenAI's `output_text` part and its
`response.output_text.delta` / `.done` events carry them. Without that `include` a response has
none (`logprobs: []`), `top_logprobs` or not, as OpenAI's.

The response's task computes them (its `logprobs` parameter, server.tasks.params: the engine's
SamplingParams.logprobs, taken from the model's logits before penalties, temperature and any
grammar) and its output keeps them beside its tokens (Output.logprobs), in memory only: read back
after a restart, or once the server let the task go from memory, a response has none.

A message's logprobs are those of the output tokens whose text lies in the message's text: a
token whose text is all in the hidden lead (the whitespace after "Assistant:") or after the text
(the stop string's tokens, the call marker and calls) is left out; a token whose bytes end inside
a character (its text comes with a later token) counts where its text would be."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.api.openai.agent_render import Extras, TokenBytes, chat_logprobs

if TYPE_CHECKING:
    from server.engine.types import TokenLogprob
    from server.tasks.output import Output
    from server.tasks.records import Task

LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for them."""


def requested(include: Sequence[str] | None, top_logprobs: int | None) -> int | None:
    """The task's `logprobs` parameter for a request: top_logprobs (0 when not given) when its
    include asks for logprobs, else None (none computed)."""
    return (top_logprobs or 0) if LOGPROBS in (include or ()) else None


def tokens_in(out: Output, a: int, b: int) -> range:
    """The output tokens whose text lies (at least partly) in out.text[a:b]. Token i's text is
    [offsets[i-1], offsets[i]) (offsets[-1] read as 0): it is in when it starts before b and ends
    after a, or starts at a (a token with no text of its own there)."""
    offs = out.offsets
    lo = min(bisect_right(offs, a), bisect_left(offs, a) + 1 if a > 0 else 0)
    hi = min(len(offs), bisect_left(offs, b) + 1) if b > 0 else 0
    return range(lo, max(lo, hi))


def logprobs_of(out: Output, tokens: range) -> list[TokenLogprob]:
    """The logprobs of these output tokens ([] when the output holds none for them)."""
    lps = out.logprobs
    return [] if lps is None or len(lps) < tokens.stop else lps.slice(tokens.start, tokens.stop)


def entries(tokenizer: TokenBytes, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's logprob objects: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
    (chat's `logprobs.content` entries are of the same shape)."""
    return chat_logprobs(Extras(tokenizer), lps) if lps else []


def text_start(output_text: str, keep: bool) -> int:
    """Where a message's text starts in its output's text: at 0 when it continues a message (`keep`:
    its leading whitespace is text, render.continues), else after the hidden lead."""
    return 0 if keep else len(output_text) - len(output_text.lstrip())


def of_message(t: Task, text: str, keep: bool, tokenizer: TokenBytes | None) -> list[dict[str, Any]]:
    """The logprobs of t's message text `text` (a part of its output's text from text_start on:
    the text, or the text before the calls) when its request asked for them, else []."""
    if tokenizer is None or t.params.get("logprobs") is None or not text:
        return []
    a = text_start(t.out.text, keep)
    return entries(tokenizer, logprobs_of(t.out, tokens_in(t.out, a, a + len(text))))
