"""Prefill-once states for shared chat prefixes (few-shot block + leading system turns).

The first request with a given prefix prefills it through the engine (`max_tokens=0`,
`return_state=True`); the batch-1 CPU state is kept here, keyed by the SHA-256 of the prefix text,
in an LRU bounded in bytes. Every later request with the same prefix submits only the rest of its
prompt with `init_state=` that state (the engine copies it; the cached object stays untouched).
Concurrent first requests for one prefix share a single prefill.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.engine.types import SamplingParams

log = logging.getLogger("server.prefix")


@dataclass
class PrefixEntry:
    state: Any  # batch-1 State on the CPU
    n_tokens: int
    nbytes: int
    pending: list[int]  # tokens not yet fed into `state` (empty for a prefill-only request)


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.pending: dict[str, asyncio.Future] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes, "entries": len(self.entries), "hits": self.hits, "misses": self.misses}

    async def get(self, engine: Any, tokens: list[int], text: str) -> PrefixEntry:
        """The state after `tokens` (= encode(text)), prefilled now or taken from the cache."""
        k = self.key(text)
        entry = self.entries.get(k)
        if entry is not None:
            self.entries.move_to_end(k)
            self.hits += 1
            return entry
        task = self.pending.get(k)
        if task is None:
            self.misses += 1
            task = asyncio.create_task(self._prefill(engine, tokens, k))
            self.pending[k] = task
            task.add_done_callback(lambda t, k=k: self._settle(k, t))
        else:
            self.hits += 1
        # shield: a requester that goes away does not cancel the prefill others wait for
        return await asyncio.shield(task)

    def _settle(self, k: str, task: asyncio.Task) -> None:
        self.pending.pop(k, None)
        if not task.cancelled() and task.exception() is None:
            self._put(k, task.result())

    async def _prefill(self, engine: Any, tokens: list[int], k: str) -> PrefixEntry:
        h = engine.submit(tokens, SamplingParams(max_tokens=0), request_id=f"prefix-{k[:12]}", return_state=True)
        try:
            res = await h.wait()
        except BaseException:
            h.abort()
            raise
        if res.state is None or res.finish_reason == "error":
            raise RuntimeError(f"prefix prefill failed: {res.error or res.finish_reason}")
        nbytes = res.state.nbytes() if hasattr(res.state, "nbytes") else 0
        log.info("prefix %s prefilled: %d tokens, %d bytes of state", k[:12], len(tokens), nbytes)
        pending = list(getattr(res, "pending_tokens", None) or [])
        return PrefixEntry(state=res.state, n_tokens=len(tokens), nbytes=nbytes, pending=pending)

    def _put(self, k: str, entry: PrefixEntry) -> None:
        if entry.nbytes > self.budget:
            return  # larger than the whole budget: use it once, keep nothing
        self.entries[k] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.budget and self.entries:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
