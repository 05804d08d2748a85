"""The logprobs a task's output keeps beside its tokens (Output.logprobs, for a run with the
task's `logprobs` parameter: server.tasks.params), packed, and the bound on what the outputs of
ended runs hold of them.

Packed: per token its id and logprob, then its alternatives' ids and logprobs, in flat arrays
(ids int32, logprobs float32: the values are float32 already, log_softmax of float32 logits, so
nothing is rounded), with where each token's entries end: 8 (k + 1) + 8 bytes a token with k
alternatives, where TokenLogprob objects with their tuples took about 2.5 KB at k = 20.

Bounded: the logprobs of outputs whose runs ended are held up to LOGPROBS_BYTES in all; past
that, those of the outputs that ended longest ago are let go (a response then shows none, as one
read back from the database). A running output's are never let go while it runs (its max_tokens
bounds them)."""

from __future__ import annotations

import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from server.engine.types import TokenLogprob

if TYPE_CHECKING:
    from server.tasks.output import Output

__all__ = ["LOGPROBS_BYTES", "LogprobBudget", "TokenLogprobs"]

LOGPROBS_BYTES = 256 << 20
"""What the ended outputs' logprobs may hold in all: ~1.5 M tokens at top_logprobs 20, ~16 M at 0."""


class TokenLogprobs:
    """One output's token logprobs, one entry per token, packed (above)."""

    __slots__ = ("_ends", "_hidden", "_ids", "_values")

    def __init__(self, values: Iterable[TokenLogprob] = ()) -> None:
        self._ids = array("i")  # per token: its id, then its alternatives'
        self._values = array("f")  # their logprobs, alike
        self._ends = array("q")  # where each token's entries end in _ids / _values
        self._hidden: set[int] = set()  # tokens whose text was never shown (hide)
        self.extend(values)

    def __len__(self) -> int:
        return len(self._ends)

    def extend(self, values: Iterable[TokenLogprob]) -> None:
        ids, vals, ends = self._ids, self._values, self._ends
        for v in values:
            ids.append(v.token)
            vals.append(v.logprob)
            for token, lp in v.top:
                ids.append(token)
                vals.append(lp)
            ends.append(len(ids))

    def hide(self, tokens: Iterable[int]) -> None:
        """Leave these tokens out of every slice: their text was never shown (a stop string's,
        EOS), and a continue's text now comes after them (Output.hide_unshown)."""
        self._hidden.update(tokens)

    def slice(self, start: int, stop: int) -> list[TokenLogprob]:
        """The entries of tokens start..stop-1 (less the hidden ones), as TokenLogprobs."""
        ids, vals, ends, hidden = self._ids, self._values, self._ends, self._hidden
        out, a = [], ends[start - 1] if start > 0 else 0
        for i in range(start, min(stop, len(ends))):
            b = ends[i]
            if i not in hidden:
                out.append(TokenLogprob(ids[a], vals[a], tuple(zip(ids[a + 1 : b], vals[a + 1 : b], strict=True))))
            a = b
        return out

    @property
    def nbytes(self) -> int:
        return sum(len(x) * x.itemsize for x in (self._ids, self._values, self._ends))


class LogprobBudget:
    """Holds the ended outputs' logprobs to `limit` bytes in all (the module's docstring). Used on
    the event loop (the pump); an output freed elsewhere (a garbage collection may run on any
    thread) is only noted there, and its bytes are given back at the next use."""

    def __init__(self, limit: int = LOGPROBS_BYTES) -> None:
        self.limit = limit
        self._bytes = 0  # what the held outputs' logprobs take
        self._held: OrderedDict[int, tuple[weakref.ref[Output], int]] = OrderedDict()  # id(out): oldest first
        self._freed: deque[tuple[int, weakref.ref[Output]]] = deque()  # (deque.append: thread-safe)

    @property
    def bytes(self) -> int:
        self._drain()
        return self._bytes

    def resumed(self, out: Output) -> None:
        """A run of out begins (a continue): its logprobs are its run's until it ends again."""
        self._drain()
        self._forget(id(out))

    def ended(self, out: Output) -> None:
        """out's run ended: its logprobs are held, as the newest; one output over the limit by
        itself keeps none (the others stay)."""
        self._drain()
        key = id(out)
        self._forget(key)
        if out.logprobs is None:
            return
        size = out.logprobs.nbytes
        if size > self.limit:
            out.logprobs = None
            return
        self._held[key] = (weakref.ref(out, partial(self._note_freed, key)), size)
        self._bytes += size
        while self._bytes > self.limit and self._held:
            _, (ref, n) = self._held.popitem(last=False)
            self._bytes -= n
            old = ref()
            if old is not None:
                old.logprobs = None

    def _forget(self, key: int, ref: weakref.ref[Output] | None = None) -> None:
        """Stop counting the output held under key (only if held through `ref`, when given)."""
        held = self._held.get(key)
        if held is not None and (ref is None or held[0] is ref):
            del self._held[key]
            self._bytes -= held[1]

    def _note_freed(self, key: int, ref: weakref.ref[Output]) -> None:
        """An output let go of (its task left memory), on whichever thread freed it."""
        self._freed.append((key, ref))

    def _drain(self) -> None:
        while self._freed:
            self._forget(*self._freed.popleft())
