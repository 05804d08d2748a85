"""Prefill-once states for shared chat prefixes (few-shot block + leading system turns).

The first request with a given prefix prefills it through the engine (`max_tokens=0`,
`return_state=True`); the batch-1 CPU state is kept in the task layer's byte-budgeted
`StateCache` (server.tasks.cache), keyed by the SHA-256 of the prefix text and the API key's
partition (each key its own, as the conversation cache: whether a key's system prompt was seen
before shows in `cached_tokens` and the time to first token, so one key must not learn it of
another's; one partition for all with --conversation-cache-shared). Every later request
with the same prefix submits only the rest of its prompt with `init_state=` that state (the
engine copies it; the cached object stays untouched). Concurrent first requests for one prefix
share a single prefill.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from server.engine.prefill import prefill_state
from server.engine.protocol import EngineAPI, StateLike
from server.tasks.cache import StateCache

log = logging.getLogger("server.prefix")


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.cache = StateCache(budget_bytes)

    @staticmethod
    def key(text: str, part: str | None = None) -> str:
        """The cache key of a prefix in a partition (None: the shared one)."""
        return hashlib.sha256(f"{part or ''}\0{text}".encode()).hexdigest()

    def stats(self) -> dict[str, int]:
        st = self.cache.stats()
        return {"bytes": st["lru_bytes"], "entries": st["lru_count"], "hits": st["hits"], "misses": st["misses"]}

    async def get(self, engine: EngineAPI, tokens: Sequence[int], text: str, part: str | None = None) -> StateLike:
        """The state after `tokens` (= encode(text)) in partition `part`, taken from the cache
        or prefilled now."""
        k = self.key(text, part)
        state = await self.cache.get_or_load(k, lambda: self._prefill(engine, tokens, k))
        assert state is not None  # a prefill returns a state or raises
        return state

    async def _prefill(self, engine: EngineAPI, tokens: Sequence[int], k: str) -> StateLike:
        state = await prefill_state(engine, tokens, request_id=f"prefix-{k[:12]}", what="prefix prefill")
        log.info("prefix %s prefilled: %d tokens, %d bytes of state", k[:12], len(tokens), state.nbytes())
        return state
