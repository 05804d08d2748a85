"""A task's output since its last prompt: its text, where each token's text ends, each token's
logprob when its runs compute them, and the readers waiting for more (stream readers,
server.api.streaming.direct's listeners)."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from server.tasks.token_logprobs import TokenLogprobs

if TYPE_CHECKING:
    from server.engine.types import TokenLogprob


class Output:
    """The text a task produced since its last prompt, shared with stream readers.

    offsets[i] = characters of `text` available once output token i has been produced (text of
    one engine event is credited to the event's last token)."""

    def __init__(self, text: str = "", offsets: Iterable[int] = (), finished: bool = True) -> None:
        self.text = text
        self.offsets = array("q", offsets)
        self.finished = finished
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: TokenLogprobs | None = None
        """One per output token, when every run of this output computed them (the task's
        `logprobs` parameter); else None. Kept in memory only (an output read back from the
        database has none), and let go past a bound (token_logprobs.LogprobBudget)."""
        self._waiters: set[asyncio.Future[None]] = set()
        self._listeners: list[Callable[[], None]] = []  # called by notify (server.api.streaming.direct)

    def __len__(self) -> int:
        return len(self.offsets)

    def append(self, text: str, n_tokens: int, logprobs: Sequence[TokenLogprob] | None = None) -> None:
        """Add an engine event's text and tokens (with their logprobs, when its run computes them)."""
        if n_tokens > 0 and (logprobs is not None or self.logprobs is not None):  # (most outputs: neither)
            self._add_logprobs(logprobs)
        if n_tokens <= 0:
            if text:  # text with no new token (a final flush): credit it to the last token
                self.text += text
                if self.offsets:
                    self.offsets[-1] = len(self.text)
            return
        before = len(self.text)
        self.text += text
        self.offsets.extend([before] * (n_tokens - 1))
        self.offsets.append(len(self.text))

    def _add_logprobs(self, values: Sequence[TokenLogprob] | None) -> None:
        """Keep one logprob per token, or none at all: tokens that come without them (a run that
        computes none) end the list, and a list starts with the output's first token only."""
        if values is None:
            self.logprobs = None
        elif self.logprobs is not None:
            self.logprobs.extend(values)
        elif not self.offsets:
            self.logprobs = TokenLogprobs(values)

    def hide_unshown(self) -> None:
        """Before a continue of an output its stop ended: the tokens at its end that show no text
        (the stop string's, EOS) would stand inside the text the continue adds, so their
        logprobs are hidden (a message's logprobs are those of the tokens of its text)."""
        if self.logprobs is None:
            return
        offs, end = self.offsets, len(self.text)
        i = len(offs)
        while i > 0 and offs[i - 1] == end and (offs[i - 2] if i > 1 else 0) == end:
            i -= 1
        self.logprobs.hide(range(i, len(offs)))

    def take_back(self, n: int) -> None:
        """Drop the last n characters of text (a continue completes what they stood for)."""
        self.text = self.text[: len(self.text) - n]
        end, offsets = len(self.text), self.offsets
        i = len(offsets) - 1
        while i >= 0 and offsets[i] > end:
            offsets[i] = end
            i -= 1

    def char_at(self, pos: int) -> int:
        """Characters of text that come before output token `pos`."""
        if pos <= 0 or not self.offsets:
            return 0
        return self.offsets[min(pos, len(self.offsets)) - 1]

    def notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()
        if self._listeners:
            for fn in list(self._listeners):  # a listener may leave while called
                fn()

    def listen(self, fn: Callable[[], None]) -> None:
        """fn() runs at every notify, on the event loop (it must not block or raise)."""
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    async def wait_change(self, timeout: float | None) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            if timeout is None:
                await fut
            else:
                await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)
