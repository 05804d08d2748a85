"""Where an OpenAI request starts, and what its client is expected to send next.

A request's token stream starts at a base: the zero state, or (`"state": NAME`) the state of the
template `_NAME` (a tuned state file, an imported state, or any template), whose pending tokens
come first. From there the conversation cache (server.api.openai.conversation) gives the longest
kept state the stream extends; a chat prompt without one falls back to the shared prefill-once
state of its few-shot / leading system prefix (server.api.openai.prefix_cache).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from server.api.errors import ApiError, engine_error
from server.api.generation.jobs import ClientGone, Job, unless_gone
from server.api.openai.chat_format import TURN_SEP, normalize
from server.api.openai.conversation import SPLIT_MIN_TOKENS, Expect
from server.api.openai.tools import MARKER
from server.api.services import Services
from server.engine.protocol import StateLike
from server.engine.types import Result
from server.tasks.errors import TaskError, TaskNotFound
from server.tasks.imports import check_name

ENCODE_INLINE_CHARS = 16_384
CHAT_TURN_END = "Assistant:"
"""A chat prompt that ends here expects the reply as the next assistant turn."""


@dataclass
class Base:
    """The starting point of a token stream."""

    key: str = ""
    """Partition of the conversation cache: "" for the zero state, else the template's state id."""
    state: StateLike | None = None
    tokens: list[int] = field(default_factory=list)
    """Tokens the base state has not consumed (fed before the prompt)."""


@dataclass
class Start:
    """What to submit for one prompt: `submit` from `state`; `cached` prompt tokens came from a kept state."""

    stream: list[int]
    submit: list[int]
    state: StateLike | None
    cached: int
    part: str | None
    """The conversation cache partition (None: the cache is off)."""
    keep: bool = False
    """Keep the states of this prompt's sequences (their Results carry them: return_state)."""

    def track(self, sv: Services, jobs: Sequence[Job], expect: Expect | None) -> None:
        """Keep the states of these jobs (one prompt's choices) once they end."""
        if self.keep and self.part is not None and sv.conversations is not None:
            sv.conversations.track(sv.engine, self.part, self.stream, [j.handle for j in jobs], expect)


async def resolve_base(sv: Services, name: str | None, owner: str | None) -> Base:
    """The base of `"state": name` (None: the zero state). 4xx in the OpenAI shape for a name that
    is not a template this key may use."""
    if name is None:
        return Base()
    tm = sv.tasks
    if tm is None:
        raise ApiError(
            503, "states are not available: the task manager is not running", param="state", code="tasks_unavailable"
        )
    try:
        tid = check_name(name)
        t = await tm.get(tid, owner)
    except TaskNotFound:
        raise ApiError(
            404,
            f"state {name!r} not found: load it with --state {name}=PATH or upload it (POST /v1/states/{name})",
            param="state",
            code="state_not_found",
        ) from None
    except TaskError as exc:
        raise ApiError(400, exc.message, param="state", code="invalid_state") from None
    if t.running:
        raise ApiError(
            409,
            f"template {tid!r} is still being prepared; retry when it is ready",
            param="state",
            code="state_not_ready",
        )
    state, pos, key = await tm.persistence.resolve_state(t)
    tm.persistence.release(key)  # a template's state stays in memory (the template tier)
    if state is None:  # no state kept: its whole history, from the zero state
        return Base(tokens=list(t.tokens))
    return Base(key=t.state_id or tid, state=state, tokens=list(t.tokens[pos:]))


async def begin(
    sv: Services,
    owner: str | None,
    base: Base,
    tokens: Sequence[int],
    prefix: tuple[str, list[int]] | None = None,
    *,
    reply_tokens: int = 0,
    ongoing: bool = False,
    request: Request | None = None,
) -> Start:
    """The start of one prompt's sequences. `prefix`: (text, tokens) of a chat prompt's shared
    prefix, the first tokens of `tokens` (used when the conversation cache has nothing longer).
    reply_tokens: the most tokens a sequence may generate; ongoing: the prompt holds an earlier
    reply (a chat with an assistant turn), so the client is likely to send the next turn. With
    the cache on, the states of an exchange worth keeping are kept, and its long uncached rest
    is prefilled (and kept) first, but its last token: `request`'s client is watched meanwhile
    (one that leaves aborts the prefill no other request shares: ClientGone)."""
    stream = base.tokens + list(tokens)
    state, n, part, keep = base.state, 0, None, False
    shared = prefix is not None and bool(prefix[0]) and not base.key and not base.tokens  # a chat's prefix
    conv = sv.conversations
    if conv is not None:
        part = conv.partition(owner, base.key)
        kept, m = await conv.lookup(part, stream, at_least=len(prefix[1]) if shared and prefix else 1)
        if kept is not None:
            state, n = kept, m
        keep = conv.worth_keeping(len(stream), reply_tokens, ongoing=ongoing or kept is not None)
    cached = n
    if shared and prefix is not None and n < len(prefix[1]):
        text, ptokens = prefix
        hit = sv.prefix_cache.key(text, prefix_part(sv, owner)) in sv.prefix_cache.cache
        state, n = await prefix_state(sv, text, ptokens, owner), len(ptokens)
        cached = n if hit else 0
    if keep and conv is not None and part is not None and len(stream) - 1 - n >= SPLIT_MIN_TOKENS:
        fill = conv.prefill(sv.engine, part, stream[:-1], state, n)
        try:
            state, n = await (fill if request is None else unless_gone(request, fill)), len(stream) - 1
        except (ApiError, ClientGone):
            raise
        except Exception as exc:
            raise engine_error(exc) from exc
    return Start(stream, stream[n:], state, max(0, cached - len(base.tokens)), part, keep)


def prefix_part(sv: Services, owner: str | None) -> str | None:
    """The prefix cache's partition of a request: its API key's, or one for all when the
    conversation states are shared (--conversation-cache-shared)."""
    return None if sv.settings.conversation_cache_shared else owner


async def prefix_state(sv: Services, text: str, tokens: list[int], owner: str | None) -> StateLike:
    """The state after the shared prefix, from the prefix cache (prefilled now on a miss)."""
    try:
        return await sv.prefix_cache.get(sv.engine, tokens, text, prefix_part(sv, owner))
    except ApiError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc


def chat_expect(
    sv: Services, start: Start, rest: str, n_rest: int, resent: Callable[[str], str] = str.lstrip
) -> Expect | None:
    """The next chat request's tokens: this prompt with the reply as its client re-sends it (the
    message content, normalized, as build_prompt writes an assistant turn), re-tokenized the way
    the route tokenizes a prompt (the prefix apart, the rest as one text). `rest`: the prompt's
    text after the prefix, up to its final "Assistant:" (n_rest: the tokens the route fed after
    the prefix); `resent`: the generated text -> the assistant turn's text the client sends back
    (with tools: its content and calls, tools.resent_text)."""
    if not rest.endswith(CHAT_TURN_END):
        return None
    head = start.stream[: len(start.stream) - n_rest]

    async def expect(res: Result) -> list[int]:
        return head + await encode_chat(sv, f"{rest} {normalize(resent(res.text))}{TURN_SEP}")

    return expect


def completion_expect(sv: Services, start: Start, text: str | None, n_prompt: int) -> Expect:
    """The next completion request's tokens: the prompt + the completion. A text prompt is
    re-tokenized with it, its last token left out (it may merge with what the client appends);
    token ids are expected back as they are."""
    if text is None:

        async def ids(res: Result) -> list[int]:
            return start.stream + list(res.token_ids)

        return ids
    head = start.stream[: len(start.stream) - n_prompt]  # the base's pending tokens

    async def retokenized(res: Result) -> list[int]:
        return head + (await _encode(sv, text + res.text))[:-1]

    return retokenized


async def encode_chat(sv: Services, text: str) -> list[int]:
    """A chat prompt's text after its prefix, tokenized with a token boundary after each tool-call
    marker. The grammar starts a call the model writes on a token boundary after the marker, so a
    call in the history then tokenizes as the model produced it (`>` then `[`, not the one token
    `>[`), and the conversation cache can keep the state at the end of a reply with calls."""
    parts = text.split(MARKER)
    out: list[int] = []
    for i, part in enumerate(parts):
        piece = part if i == len(parts) - 1 else part + MARKER
        if piece:
            out += await _encode(sv, piece)
    return out


async def _encode(sv: Services, text: str) -> list[int]:
    if len(text) < ENCODE_INLINE_CHARS:
        return list(sv.tokenizer.encode(text))
    return list(await asyncio.to_thread(sv.tokenizer.encode, text))
