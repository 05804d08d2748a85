"""In-memory state cache: an LRU with a budget in BYTES (cachetools), plus two tiers outside
the budget's eviction: template states (never evicted) and pinned states (in use by a running
sequence, or waiting for their database write). A pinned state returns to the LRU when its last
pin is released."""

from __future__ import annotations

from typing import Any

from cachetools import LRUCache

from server.model.state import State


def _nbytes(state: State) -> int:
    return state.nbytes()


class StateCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(0, int(budget_bytes))
        self._lru: LRUCache = LRUCache(maxsize=max(1, self.budget), getsizeof=_nbytes)
        self._pinned: dict[str, list[Any]] = {}  # key -> [state, pin count, drop at unpin]
        self._templates: dict[str, State] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> State | None:
        st = self._templates.get(key)
        if st is None and key in self._pinned:
            st = self._pinned[key][0]
        if st is None:
            st = self._lru.get(key)
        if st is None:
            self.misses += 1
        else:
            self.hits += 1
        return st

    def __contains__(self, key: str) -> bool:
        return key in self._templates or key in self._pinned or key in self._lru

    def put(self, key: str, state: State, *, template: bool = False) -> None:
        if template:
            self.discard(key)
            self._templates[key] = state
        elif key in self._pinned:
            self._pinned[key][0], self._pinned[key][2] = state, False
        else:
            self._lru_put(key, state)

    def _lru_put(self, key: str, state: State) -> None:
        self._lru.pop(key, None)
        before = len(self._lru)
        try:
            self._lru[key] = state
        except ValueError:  # larger than the whole budget: not cached
            self._lru.pop(key, None)
            self.evictions += 1
            return
        self.evictions += max(0, before + 1 - len(self._lru))  # a new key grows it by one

    def pin(self, key: str, state: State | None = None) -> None:
        """Keep `key` in memory until unpin (the state must be given unless cached)."""
        if key in self._templates:
            return
        if key in self._pinned:
            self._pinned[key][1] += 1
            return
        st = self._lru.pop(key, None) if state is None else state
        self._lru.pop(key, None)
        if st is None:
            raise KeyError(key)
        self._pinned[key] = [st, 1, False]

    def unpin(self, key: str) -> None:
        entry = self._pinned.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._pinned[key]
            if not entry[2]:
                self._lru_put(key, entry[0])

    def discard(self, key: str) -> None:
        """Forget a state; one in use stays until its last unpin, then goes."""
        self._templates.pop(key, None)
        self._lru.pop(key, None)
        if key in self._pinned:
            self._pinned[key][2] = True

    def stats(self) -> dict[str, int]:
        return {
            "lru_bytes": int(self._lru.currsize), "lru_count": len(self._lru),
            "pinned_bytes": sum(e[0].nbytes() for e in self._pinned.values()),
            "pinned_count": len(self._pinned),
            "template_bytes": sum(s.nbytes() for s in self._templates.values()),
            "template_count": len(self._templates),
            "budget_bytes": self.budget, "hits": self.hits, "misses": self.misses,
            "evictions": self.evictions,
        }

    def pinned_keys(self) -> set[str]:
        return set(self._pinned)

    def keys(self) -> set[str]:
        return set(self._templates) | set(self._pinned) | set(self._lru.keys())
