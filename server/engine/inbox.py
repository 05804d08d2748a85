"""The engine's intake: what callers hand to the loop thread, and the checks a request passes first.

`Inbox` is the one place where caller threads (an event loop, the tests, `generate`) and the
engine's loop thread meet: new requests and aborts go in under one lock, the loop takes them all
at the start of a step (`take`), and the handles of the requests that have not ended yet are
kept here (`live`), so that a loop that dies fails every one of them instead of leaving a caller
waiting (`close`). Nothing here waits for the loop.

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
    def __init__(self, max_queue: int):
        """max_queue: how many requests may wait (here and in the scheduler's queue); 0 = no bound."""
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._items: deque[Admission | str] = deque()  # new requests; aborts (request ids)
        self._adds = 0  # new requests in _items
        self._live: dict[str, RequestHandle] = {}
        self._closed = False  # every live handle was failed: nothing may be put

    @property
    def pending(self) -> int:
        """New requests the loop has not taken yet (they count as waiting)."""
        return self._adds

    def has_items(self) -> bool:
        """Something (a request or an abort) waits for the loop to take it."""
        return bool(self._items)

    def put(self, item: Admission, handle: RequestHandle, waiting: int) -> None:
        """Queue a new request (the loop's `waiting` requests and this inbox's count against
        max_queue); EngineDeadError once closed, ValueError for a request id in use,
        QueueFullError when the queue is full. Nothing is queued when it raises."""
        rid = item[0].request_id
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is not running")
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already in use")
            queued = self._adds + waiting
            if self.max_queue and queued >= self.max_queue:
                raise QueueFullError(f"{queued} requests are waiting (max_queue={self.max_queue})")
            self._live[rid] = handle
            self._items.append(item)
            self._adds += 1

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
            self._adds = 0
        return handles


def prompt_ids(tokenizer: Tokenizer, prompt: str | Sequence[int], params: SamplingParams, *, vocab_size: int,
               max_prompt_tokens: int, history: int = 0) -> list[int]:  # fmt: skip
    """The prompt as token ids, after the checks submit makes before queueing: ValueError for bad
    sampling parameters, ids outside the vocabulary or an empty prompt that should generate;
    PromptTooLongError past max_prompt_tokens (`history` leading ids, a task's re-fed history,
    do not count)."""
    if params.max_tokens < 0 or params.temperature < 0 or not 0 <= params.top_p <= 1 or params.top_k < 0:
        raise ValueError("invalid sampling parameters (max_tokens, temperature, top_k >= 0; 0 <= top_p <= 1)")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"invalid '{name}': {k!r} is outside [0, {MAX_LOGPROBS}]")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    n = len(ids) - max(0, history)  # the request's own prompt: re-fed history does not count
    if n > max_prompt_tokens:
        raise PromptTooLongError(n, max_prompt_tokens)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if not ids and params.max_tokens > 0:
        raise ValueError("empty prompt: nothing to generate from (feed at least one token)")
    return ids
