"""The engine as the task layer and the API see it: typed seams, no torch import.

`server.engine.Engine` and its `RequestHandle` satisfy these protocols; the task manager, the
HTTP routes and the tests depend on the protocols, so any engine (a fake in a test, one engine
per GPU behind a router) can stand in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import (
    Protocol,
    runtime_checkable,
)

from .types import EngineStats, Event, GrammarSpec, Result, SamplingParams


@runtime_checkable
class StateLike(Protocol):
    """A batch-1 model state (`server.model.state.State`) as the layers above the model see it."""

    def nbytes(self) -> int: ...


class Handle(Protocol):
    """One submitted sequence, seen from its caller."""

    request_id: str
    admitted: bool
    """The engine gave it a slot (its prompt is fed, or it decodes); False while it waits."""

    @property
    def done(self) -> bool: ...

    @property
    def ended(self) -> bool:
        """The finishing event was delivered; the Result may come after it (with its state)."""
        ...

    def take_ready(self) -> list[Event] | None:
        """The events pending now; [] once ended and drained; None when nothing is there yet."""
        ...

    async def next_batch(self) -> list[Event]: ...

    def batches(self) -> AsyncIterator[list[Event]]: ...

    def __iter__(self) -> Iterator[Event]: ...

    async def wait(self) -> Result: ...

    def result(self, timeout: float | None = None) -> Result: ...

    def peek_result(self) -> Result | None:
        """The Result once it was delivered (with the finishing event, or after it when it waits
        for its final state), else None. No waiting."""
        ...

    def abort(self) -> bool: ...

    def set_listener(self, fn: Callable[[], None] | None) -> None:
        """fn() runs on the engine thread after each delivery to this handle, instead of the
        event-loop wake-up (it must not block; it takes the events with take_ready)."""
        ...


class EngineAPI(Protocol):
    """What the task manager and the routes need from an engine."""

    max_batch: int

    @property
    def is_alive(self) -> bool: ...

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        init_state: StateLike | None = None,
        request_id: str | None = None,
        return_state: bool = False,
        end_before_state: bool = False,
        history: int = 0,
    ) -> Handle:
        """history: how many leading prompt tokens re-feed a task's own history (its state was
        rebuilt): fed like any other, but not counted against `max_prompt_tokens`, which bounds
        what a request brings. Negative: that many tokens of the request's prompt were held back
        from `prompt` (a prefill-only run keeps its last one) and still count."""
        ...

    def abort(self, request_id: str) -> bool: ...

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile spec into the engine's cache (ValueError: why it cannot be); blocking: run it
        in a worker thread from an event loop, then submit() finds it compiled."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...
