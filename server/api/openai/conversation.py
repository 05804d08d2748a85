"""Conversation cache of the OpenAI routes: states at the end of earlier requests, keyed by the
exact token prefix they consumed, so that a client re-sending a whole chat history each turn
prefills only the new turn.

Keys. An entry is a state that has consumed exactly the tokens `t[:n]` of a token stream
starting at a base (the zero state, or a template's state) and nothing else (the engine's
contract: `state + pending_tokens == prompt + output`). Its key is the SHA-256 of the partition
and those tokens; a lookup hashes the request's tokens once, incrementally, at every length an
entry of its partition has, and takes the longest one kept (at most len - 1 tokens: the last
token is always fed, it gives the logits). Partitions: per API key (the key's hash) unless
shared, and per base state (a template's state id), so no state of one key or base serves
another.

What is kept, for each request:
  - the end of its prompt but the last token, when the prompt has SPLIT_MIN_TOKENS or more
    tokens not served from the cache: the route prefills them as a request of its own, then
    generates from that state (`prefill`: one engine round trip more; concurrent identical
    prompts share it). So a later turn never re-prefills more than the reply and its own text;
  - after it ends (`track`), the state at the end of what it fed (prompt + output minus its
    pending token), when that is a prefix of what the client is expected to send next
    (`expect`: for chat, the history plus the reply text as the client re-sends it,
    re-tokenized);
  - otherwise (the generated ids and the re-tokenized reply differ) a *repair*: the expected
    tokens are prefilled in the background from the longest entry they extend, and kept.
Repairs use idle engine time: one waits until nothing runs (at most REPAIR_IDLE_S, then it is
dropped), so it neither delays nor perturbs other requests' batches; at most REPAIR_CONCURRENCY
wait or run at once, so a burst of them cannot fill the engine when it goes idle (the others
queue; a queued or waiting one is dropped as soon as the next turn waits for it). A request that
extends the prompt of a request whose generation ended but whose states are not kept yet waits for them (at
most `wait_s`): the end state is then kept as it is (the waiting request's own tokens decide if
it fits: no re-tokenizing on its critical path), a repair in flight is awaited, and none starts
(the request prefills the reply itself, one engine round trip fewer than a repair).

A tracked request is polled for its end (server.api.openai.settling); a lookup that finds a
finished one kicks its settle at once. Values live in a StateCache (byte budget, LRU). Everything runs on the
event loop: no locks; concurrent requests extending one prefix share the entry (the engine copies
a starting state, never writes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from server.api.openai.settling import RepairSlots, Settling, engine_idle, until_generated
from server.engine.prefill import prefill_state
from server.engine.protocol import EngineAPI, Handle, StateLike
from server.engine.types import (
    LENGTH,
    STOP,
    EngineError,
    Result,
)
from server.tasks.cache import StateCache
from server.tasks.token_digest import prefix_digests

log = logging.getLogger("server.conversation")

Expect = Callable[[Result], Awaitable[list[int] | None]]
"""The tokens (from the base) the client is expected to send next, given a choice's Result."""
SPLIT_MIN_TOKENS = 64
"""Uncached prompt tokens from which a request's prompt end is prefilled (and kept) apart."""
WAIT_SETTLE_S = 30.0
REPAIR_CONCURRENCY = 4
"""Repairs in flight (or waiting for an idle engine) at once. A wave of requests ending together
would otherwise start as many repair prefills as it had requests the moment the engine went idle,
and the next wave would queue behind all of them (the H200's single-turn HTTP bench: every reply
of a synthetic model re-tokenizes differently, 256 repairs after each wave)."""


def _is_prefix(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) <= len(b) and list(b[: len(a)]) == list(a)


class ConversationCache:
    def __init__(
        self,
        budget_bytes: int,
        *,
        shared: bool = False,
        repairs: bool = True,
        wait_s: float = WAIT_SETTLE_S,
        min_tokens: int = 0,
    ) -> None:
        """repairs=False: never submit a repair (e.g. a queue bound so small that one could take
        a client's place). min_tokens: see worth_keeping."""
        self.cache: StateCache[StateLike] = StateCache(budget_bytes)
        self.shared = shared
        self.min_tokens = min_tokens
        self.repairs = repairs
        self.wait_s = wait_s
        self.counters: Counter[str] = Counter()
        self._lengths: dict[str, dict[int, set[str]]] = {}  # partition -> length -> keys
        self._n_keys = 0  # keys in _lengths (some may have been evicted from the cache)
        self._settling: dict[str, list[Settling]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._repair_slots = RepairSlots(REPAIR_CONCURRENCY)

    def partition(self, owner: str | None, base: str = "") -> str:
        """Entries of one API key (all keys when shared) from one base state ("" = zero)."""
        who = "*" if self.shared or owner is None else hashlib.sha256(owner.encode()).hexdigest()[:24]
        return f"{who}|{base}"

    # --- lookup --------------------------------------------------------------------------------
    async def lookup(self, part: str, tokens: Sequence[int], at_least: int = 1) -> tuple[StateLike | None, int]:
        """(state, n): the longest kept state of `part` that consumed exactly tokens[:n], n <= len - 1;
        (None, 0) when there is none, or none of `at_least` tokens (a shorter one would not be
        used: a chat's shared prefix state starts further on). Waits for the entries of a
        finished request this one extends. Counted as a hit only when one is returned."""
        await self._wait_settling(part, tokens)
        state, n = self.best(part, tokens, len(tokens) - 1)
        if n < at_least:
            state, n = None, 0
        self.counters["hits" if n else "misses"] += 1
        self.counters["tokens_saved"] += n
        return state, n

    def best(self, part: str, tokens: Sequence[int], limit: int) -> tuple[StateLike | None, int]:
        """The longest kept prefix of `tokens` of at most `limit` tokens (no waiting, no counting)."""
        index = self._lengths.get(part)
        lengths = sorted((n for n in index or () if 0 < n <= limit), reverse=True)
        if not lengths or index is None:
            return None, 0
        keys = self._keys(part, tokens, lengths)
        for n in lengths:
            if keys[n] in index[n]:
                state = self.cache.get(keys[n])  # (refreshes its LRU place)
                if state is not None:
                    return state, n
                index[n].discard(keys[n])  # evicted by the budget
        return None, 0

    def _keys(self, part: str, tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, str]:
        """The key of tokens[:n] for each n in `lengths`, in one incremental hash pass."""
        return {n: d.hex() for n, d in prefix_digests(tokens, lengths, part.encode() + b"\0").items()}

    async def _wait_settling(self, part: str, tokens: Sequence[int]) -> None:
        waits = []
        for s in self._settling.get(part, ()):
            if len(s.tokens) < len(tokens) and s.ended() and _is_prefix(s.tokens, tokens):
                s.awaited = True
                s.kick.set()
                waits.append(s.done.wait())
        if waits:
            self.counters["waits"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), self.wait_s)

    # --- keeping states ------------------------------------------------------------------------
    def worth_keeping(self, stream_tokens: int, reply_tokens: int, ongoing: bool) -> bool:
        """Whether a request's states are kept: it is part of a conversation in progress (it
        extends a kept state, or its chat holds an earlier reply), or its stream (from the base)
        plus the most it may generate reaches min_tokens. A one-off short exchange is cheaper to
        prefill again than its state is to copy to host memory and back."""
        return ongoing or stream_tokens + reply_tokens >= self.min_tokens

    def put(self, part: str, tokens: Sequence[int], state: StateLike) -> None:
        """Keep `state`, which consumed exactly `tokens` from the partition's base."""
        if not tokens:
            return
        key = self._keys(part, tokens, [len(tokens)])[len(tokens)]
        self.cache.put(key, state)
        self._index(part, len(tokens), key)

    def _index(self, part: str, length: int, key: str) -> None:
        keys = self._lengths.setdefault(part, {}).setdefault(length, set())
        if key not in keys:
            keys.add(key)
            self._n_keys += 1
        if self._n_keys > 2 * len(self.cache.keys()) + 64:
            self._prune()

    def _prune(self) -> None:
        """Forget index keys whose states the budget evicted."""
        alive = self.cache.keys()
        n = 0
        for part in list(self._lengths):
            index = self._lengths[part]
            for length in list(index):
                index[length] &= alive
                n += len(index[length])
                if not index[length]:
                    del index[length]
            if not index:
                del self._lengths[part]
        self._n_keys = n

    def track(
        self, engine: EngineAPI, part: str, tokens: Sequence[int], handles: Sequence[Handle], expect: Expect | None
    ) -> None:
        """After the request (`tokens`: its whole stream from the base; `handles`: one per choice)
        ends, keep its states (see the module docstring). Returns at once."""
        s = Settling(list(tokens), list(handles))
        self._settling.setdefault(part, []).append(s)
        task = asyncio.create_task(self._settle(engine, part, s, expect), name="conversation-settle")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, engine: EngineAPI, part: str, s: Settling, expect: Expect | None) -> None:
        try:
            await until_generated(s)
            repair = await self._keep(part, s, expect)
            # the handles go before a repair queues: their results hold the final states, which a
            # repair does not need, and a busy engine may keep it queued (QA: ~10 MB/s of states)
            s.handles = []
            if repair is not None and await self._repair_slots.take(s):  # a burst queues here
                try:
                    if await engine_idle(engine, s):
                        await self._repair(engine, part, repair, s)
                finally:
                    self._repair_slots.give()
        except Exception:
            log.exception("conversation cache: settling a request failed")
        finally:
            s.done.set()
            rest = [x for x in self._settling.get(part, ()) if x is not s]
            if rest:
                self._settling[part] = rest
            else:
                self._settling.pop(part, None)

    async def _keep(self, part: str, s: Settling, expect: Expect | None) -> list[int] | None:
        """Keep each finished choice's end state whose tokens are a prefix of what the client is
        expected to send; the tokens to repair the first choice with where they are not, or None."""
        repair = None
        for i, h in enumerate(s.handles):
            res = h.peek_result()
            if res is None or res.state is None or res.finish_reason not in (STOP, LENGTH):
                continue  # failed, aborted (the client did not see it all), or no state
            fed = _fed(s.tokens, res)
            target = None if s.awaited or expect is None else await expect(res)
            if target is None or _is_prefix(fed, target):
                self.put(part, fed, res.state)
                self.counters["kept"] += 1
                continue
            self.counters["mismatches"] += 1
            if i == 0 and self.repairs:
                repair = target
        return repair

    async def _repair(self, engine: EngineAPI, part: str, target: list[int], s: Settling) -> None:
        """Prefill `target` from its longest kept prefix and keep the state (unless a request
        waits for `s` by the time it would start)."""
        state, m = self.best(part, target, len(target))
        if m == len(target) or s.awaited:
            return
        try:
            await self.prefill(engine, part, target, state, m)
        except EngineError as exc:  # busy or stopping: the next turn prefills it instead
            log.info("conversation cache: repair skipped: %s", exc)
            return
        self.counters["repairs"] += 1
        self.counters["repair_tokens"] += len(target) - m

    async def prefill(
        self, engine: EngineAPI, part: str, tokens: list[int], state: StateLike | None, n: int
    ) -> StateLike:
        """The state after `tokens` (fed from `state`, which consumed tokens[:n]), kept. Concurrent
        calls for the same tokens share one prefill, aborted once every caller has left (was
        cancelled). Raises the engine's errors."""
        key = self._keys(part, tokens, [len(tokens)])[len(tokens)]

        async def load() -> StateLike:
            return await prefill_state(engine, tokens[n:], init_state=state, request_id=f"conv-{uuid.uuid4().hex[:16]}")

        kept = await self.cache.get_or_load(key, load, abandon=True)
        assert kept is not None  # load() returns a state or raises
        self._index(part, len(tokens), key)
        return kept

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- figures -------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        st = self.cache.stats()
        return {
            "bytes": st["lru_bytes"],
            "entries": st["lru_count"],
            "budget_bytes": st["budget_bytes"],
            "evictions": st["evictions"],
            **{k: int(v) for k, v in self.counters.items()},
        }

    def metric_lines(self) -> list[str]:
        """Prometheus text lines of the cache's counters and size (Metrics.add_source)."""
        return metric_lines(self.stats())


def metric_lines(st: dict[str, int]) -> list[str]:
    """The cache's Prometheus lines from its stats (all zeros, `{}`, when the cache is off: the
    series exist either way, so dashboards and alerts need no special case)."""
    out: list[str] = []
    for name, kind, doc in _METRICS:
        metric = f"rwkv_conversation_cache_{name}" + ("_total" if kind == "counter" else "")
        out += [f"# HELP {metric} {doc}", f"# TYPE {metric} {kind}", f"{metric} {st.get(name, 0)}"]
    return out


_METRICS = (
    ("hits", "counter", "OpenAI requests that started from a kept conversation state."),
    ("misses", "counter", "OpenAI requests that found no kept conversation state."),
    ("tokens_saved", "counter", "Prompt tokens not prefilled thanks to kept conversation states."),
    ("kept", "counter", "Request end states kept (their tokens are a prefix of what the client is expected to send)."),
    ("mismatches", "counter", "Replies whose re-tokenized text differs from the ids generated."),
    ("repairs", "counter", "Background prefills of the re-tokenized reply (the generated ids differed)."),
    ("repair_tokens", "counter", "Tokens prefilled by repairs."),
    ("waits", "counter", "Requests that waited for the states of the request they continue."),
    ("bytes", "gauge", "State bytes held by the conversation cache."),
    ("entries", "gauge", "States held by the conversation cache."),
)


def _fed(tokens: Sequence[int], res: Result) -> list[int]:
    """The tokens the result's state consumed: stream + output, minus the pending tail."""
    out = list(tokens) + list(res.token_ids)
    return out[: len(out) - len(res.pending_tokens)]
