"""The engine's intake: what callers hand to the loop thread, and the checks a request passes first.

`Inbox` is the one place where caller threads (an event loop, the tests, `generate`) and the
engine's loop thread meet: new requests and aborts go in under one lock, the loop takes them all
at the start of a step (`take`), and the handles of the requests that have not ended yet are
kept here (`live`), so that a loop that dies fails every one of them instead of leaving a caller
waiting (`close`). Nothing here waits for the loop.

The queue bound. max_queue bounds the requests that wait for a SLOT, not those the loop has not
taken yet: a request that a free slot will take does not wait. So `put` counts every request the
engine holds (those the loop holds, running or in the scheduler's queue, as the loop last
`publish`ed them, plus those put since) and refuses a new one only when more than `slots` +
max_queue would then be held: a burst on an idle engine gets the free slots first, then
max_queue more, then QueueFullError. Callers read only what is under this lock (never the
scheduler's lists, which the loop changes between two reads); the loop publishes after taking
(before it, the requests it took still count here) and whenever slots may have been freed, so the
count is never below the truth and at most a step behind a release (a place freed mid-step shows
at the step's next publish).

`prompt_ids` is submit's check of a request before anything is queued: its sampling parameters,
its prompt as token ids within the vocabulary, and the prompt length limit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from server.tokenizer import Tokenizer

from .constraints import Constraint
from .handle import RequestHandle
from .sequence import EngineSeq
from .text import RequestText
from .types import MAX_LOGPROBS, EngineDeadError, PromptTooLongError, QueueFullError, SamplingParams

Admission = tuple[EngineSeq, RequestText, Constraint | None]
"""A new request as the loop opens it: the sequence, its text, its grammar constraint."""


class Inbox:
    def __init__(self, max_queue: int, slots: int):
        """max_queue: how many requests may wait for one of the `slots` (0 = no bound)."""
        self.max_queue = max_queue
        self.slots = slots
        self._lock = threading.Lock()
        self._items: deque[Admission | str] = deque()  # new requests; aborts (request ids)
        self._adds = 0  # new requests in _items
        self._taken = 0  # new requests taken by the loop and not in its published count yet
        self._held = 0  # requests the loop holds (running + in the scheduler's queue): its last publish
        self._live: dict[str, RequestHandle] = {}
        self._closed = False  # every live handle was failed: nothing may be put

    def load(self) -> tuple[int, int]:
        """(running, waiting): the requests the engine holds, those that hold or will take a free
        slot first (requests not taken by the loop yet included), then those that wait for one."""
        with self._lock:
            held = self._held + self._taken + self._adds
        running = min(held, self.slots)
        return running, held - running

    def has_items(self) -> bool:
        """Something (a request or an abort) waits for the loop to take it."""
        return bool(self._items)

    def put(self, item: Admission, handle: RequestHandle) -> None:
        """Queue a new request; EngineDeadError once closed, ValueError for a request id in use,
        QueueFullError when it would be one more than max_queue waiting for a slot. Nothing is
        queued when it raises."""
        rid = item[0].request_id
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is not running")
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already in use")
            waiting = self._held + self._taken + self._adds - self.slots  # before this one
            if self.max_queue and waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting (max_queue={self.max_queue})")
            self._live[rid] = handle
            self._items.append(item)
            self._adds += 1

    def publish(self, held: int) -> None:
        """The loop thread: it holds `held` requests now (running + in the scheduler's queue),
        every request it took included."""
        with self._lock:
            self._held, self._taken = held, 0

    def abort(self, request_id: str) -> bool:
        """Queue an abort; False if the request is unknown or already ended."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._items.append(request_id)
        return True

    def take(self) -> list[Admission | str]:
        """Everything queued since the last take, in order (the loop thread)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._taken += self._adds  # still counted until the loop publishes them as its own
            self._adds = 0
        return items

    def done(self, request_id: str) -> None:
        """A request ended: its handle is no longer the inbox's to fail."""
        with self._lock:
            self._live.pop(request_id, None)

    def close(self) -> list[RequestHandle]:
        """Refuse every later put, drop what is queued, and return the handles of the requests
        that had not ended (the caller fails them)."""
        with self._lock:
            self._closed = True
            handles = list(self._live.values())
            self._live.clear()
            self._items.clear()
            self._adds = self._taken = self._held = 0
        return handles


def prompt_ids(tokenizer: Tokenizer, prompt: str | Sequence[int], params: SamplingParams, *, vocab_size: int,
               max_prompt_tokens: int, history: int = 0) -> list[int]:  # fmt: skip
    """The prompt as token ids, after the checks submit makes before queueing: ValueError for bad
    sampling parameters, ids outside the vocabulary or an empty prompt that should generate;
    PromptTooLongError past max_prompt_tokens (`history` leading ids, a task's re-fed history,
    do not count; a negative one counts that many ids held back from `prompt`: EngineAPI.submit)."""
    if params.max_tokens < 0 or params.temperature < 0 or not 0 <= params.top_p <= 1 or params.top_k < 0:
        raise ValueError("invalid sampling parameters (max_tokens, temperature, top_k >= 0; 0 <= top_p <= 1)")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"invalid '{name}': {k!r} is outside [0, {MAX_LOGPROBS}]")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    n = len(ids) - min(history, len(ids))  # the request's own prompt: re-fed history does not count
    if n > max_prompt_tokens:
        raise PromptTooLongError(n, max_prompt_tokens)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if not ids and params.max_tokens > 0:
        raise ValueError("empty prompt: nothing to generate from (feed at least one token)")
    return ids
