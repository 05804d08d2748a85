"""In-memory state cache, the one of the server (task states, templates, chat prefixes): an LRU
with a budget in BYTES (cachetools), a second byte-bounded LRU for the states of finished TMP_
tasks (`tmp=True`: they are dropped long before their tasks' text), plus two tiers outside the
budgets' eviction: templates (never evicted) and pinned values (in use by a running sequence, or
waiting for their database write). A pinned value returns to its LRU when its last pin goes.
`on_evict(key)` is called when an LRU drops a value to make room (its owner can say so).

Values are anything with `nbytes()` (`StateLike`: a `State`, or an entry that wraps one).
`get_or_load` shares one load per key among concurrent callers (single flight): a burst of
requests for a state that is not in memory reads, decodes or prefills it once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Generic

from cachetools import LRUCache
from typing_extensions import (
    TypeVar,  # a default for the value type (PEP 696; typing has it from 3.13)
)

from server.engine.protocol import StateLike

V = TypeVar("V", bound=StateLike, default=StateLike)
"""The type of the cached values: `StateCache(budget)` holds any StateLike, `StateCache[State]`
only States."""


def _nbytes(value: StateLike) -> int:
    return value.nbytes()


class _LRU(LRUCache[str, V]):
    """An LRU in bytes that reports what it evicts to make room."""

    def __init__(self, budget: int, on_evict: Callable[[str], None] | None) -> None:
        super().__init__(maxsize=max(1, budget), getsizeof=_nbytes)
        self.on_evict = on_evict

    def popitem(self) -> tuple[str, V]:
        key, value = super().popitem()
        if self.on_evict is not None:
            self.on_evict(key)
        return key, value


@dataclass(slots=True)
class _Pin(Generic[V]):
    value: V
    count: int
    drop: bool = False  # discarded while pinned: forgotten at the last unpin
    tmp: bool = False  # returns to the tmp LRU at the last unpin


class StateCache(Generic[V]):
    def __init__(
        self, budget_bytes: int, *, tmp_bytes: int | None = None, on_evict: Callable[[str], None] | None = None
    ) -> None:
        """`tmp_bytes`: the tmp LRU's budget (None: budget_bytes)."""
        self.budget = max(0, int(budget_bytes))
        self.tmp_budget = self.budget if tmp_bytes is None else max(0, int(tmp_bytes))
        self._lru: _LRU[V] = _LRU(self.budget, on_evict)
        self._tmp: _LRU[V] = _LRU(self.tmp_budget, on_evict)
        self._pinned: dict[str, _Pin[V]] = {}
        self._templates: dict[str, V] = {}
        self._loading: dict[str, asyncio.Future[V | None]] = {}
        self._waiting: dict[asyncio.Future[V | None], int] = {}  # a load's callers still waiting (abandon)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.tier_hits = {"templates": 0, "pinned": 0, "lru": 0, "tmp": 0, "loading": 0}
        """hits by the tier that held the value ("loading": a load joined in flight)."""

    def get(self, key: str) -> V | None:
        v = self._peek(key, count=True)
        if v is None:
            self.misses += 1
        else:
            self.hits += 1
        return v

    def _peek(self, key: str, count: bool = False) -> V | None:
        """The value from the first tier that holds it (count: a hit of that tier)."""
        v, tier = self._templates.get(key), "templates"
        if v is None and key in self._pinned:
            v, tier = self._pinned[key].value, "pinned"
        if v is None:
            v, tier = self._lru.get(key), "lru"
        if v is None:
            v, tier = self._tmp.get(key), "tmp"
        if v is not None and count:
            self.tier_hits[tier] += 1
        return v

    def __contains__(self, key: str) -> bool:
        return key in self._templates or key in self._pinned or key in self._lru or key in self._tmp

    def put(self, key: str, value: V, *, template: bool = False, tmp: bool = False) -> None:
        """Cache a value: in the LRU, the tmp LRU (`tmp`), or as a template (never evicted)."""
        if template:
            self.discard(key)
            self._templates[key] = value
        elif key in self._pinned:
            pin = self._pinned[key]
            pin.value, pin.drop, pin.tmp = value, False, tmp
        else:
            self._lru_put(key, value, tmp)

    def _lru_put(self, key: str, value: V, tmp: bool = False) -> None:
        self._lru.pop(key, None)
        self._tmp.pop(key, None)
        lru = self._tmp if tmp else self._lru
        before = len(lru)
        try:
            lru[key] = value
        except ValueError:  # larger than the whole budget: not cached
            lru.pop(key, None)
            self.evictions += 1
            if lru.on_evict is not None:
                lru.on_evict(key)
            return
        self.evictions += max(0, before + 1 - len(lru))  # a new key grows it by one

    def pin(self, key: str, value: V | None = None) -> None:
        """Keep `key` in memory until unpin (the value must be given unless cached)."""
        if key in self._templates:
            return
        if key in self._pinned:
            self._pinned[key].count += 1
            return
        tmp = key in self._tmp
        cached = self._lru.pop(key, None)
        if cached is None:
            cached = self._tmp.pop(key, None)
        v = cached if value is None else value
        if v is None:
            raise KeyError(key)
        self._pinned[key] = _Pin(v, 1, tmp=tmp)

    def unpin(self, key: str) -> None:
        pin = self._pinned.get(key)
        if pin is None:
            return
        pin.count -= 1
        if pin.count <= 0:
            del self._pinned[key]
            if not pin.drop:
                self._lru_put(key, pin.value, pin.tmp)

    def discard(self, key: str) -> None:
        """Forget a value; one in use stays until its last unpin, then goes."""
        self._templates.pop(key, None)
        self._lru.pop(key, None)
        self._tmp.pop(key, None)
        if key in self._pinned:
            self._pinned[key].drop = True

    async def get_or_load(
        self, key: str, load: Callable[[], Awaitable[V | None]], *, abandon: bool = False
    ) -> V | None:
        """The value of `key` from memory, else from `load()` (None: there is none). Concurrent
        callers for one key share a single load, whose exception each of them gets; a caller
        that is cancelled does not cancel the load the others wait for. With `abandon`, the
        load is cancelled once every caller waiting for it was (a prefill whose clients all
        left: its engine request is aborted). The loaded value goes to the LRU tier, unless
        load() put it in the cache itself (e.g. as a template) or a value arrived meanwhile
        (that one is returned). Counts a miss when this call starts a load, a hit otherwise
        (in memory, or joining a load in flight)."""
        v = self._peek(key, count=True)
        if v is not None:
            self.hits += 1
            return v
        fut = self._loading.get(key)
        if fut is None:
            self.misses += 1
            fut = asyncio.ensure_future(self._load(key, load))
            self._loading[key] = fut
            fut.add_done_callback(partial(self._loaded, key))
        else:
            self.hits += 1
            self.tier_hits["loading"] += 1
        self._waiting[fut] = self._waiting.get(fut, 0) + 1
        try:
            return await asyncio.shield(fut)
        finally:
            self._waiting[fut] -= 1
            if not self._waiting[fut]:
                del self._waiting[fut]
                if abandon and not fut.done():
                    if self._loading.get(key) is fut:  # a caller from now on starts a load of its own
                        del self._loading[key]
                    fut.cancel()

    async def _load(self, key: str, load: Callable[[], Awaitable[V | None]]) -> V | None:
        v = await load()
        if v is None:
            return None
        cur = self._peek(key)
        if cur is not None:
            return cur
        self.put(key, v)
        return v

    def _loaded(self, key: str, fut: asyncio.Future[V | None]) -> None:
        if self._loading.get(key) is fut:
            del self._loading[key]
        if not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning when every caller left

    def stats(self) -> dict[str, int]:
        return {
            "lru_bytes": int(self._lru.currsize),
            "lru_count": len(self._lru),
            "pinned_bytes": sum(p.value.nbytes() for p in self._pinned.values()),
            "pinned_count": len(self._pinned),
            "template_bytes": sum(v.nbytes() for v in self._templates.values()),
            "template_count": len(self._templates),
            "tmp_bytes": int(self._tmp.currsize),
            "tmp_count": len(self._tmp),
            "tmp_budget_bytes": self.tmp_budget,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            **{f"{tier}_hits": n for tier, n in self.tier_hits.items()},
            "evictions": self.evictions,
        }

    def pinned_keys(self) -> set[str]:
        return set(self._pinned)

    def keys(self) -> set[str]:
        return set(self._templates) | set(self._pinned) | set(self._lru.keys()) | set(self._tmp.keys())
