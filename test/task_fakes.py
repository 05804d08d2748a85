"""A scripted engine for task-layer tests (implements server.engine.protocol.EngineAPI).

Each submission generates `max_tokens` tokens (ids 100, 101, ...; text "<id>"), one event per
batch. Its result state is a tiny State whose first value counts the tokens consumed from the
empty state (the init state's count + what this run fed), so a test can check the task layer's
state accounting: a task's `state_pos` must equal that count of its settled state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from server.engine.types import ABORT, LENGTH, STOP, EngineStats, Event, Result, SamplingParams
from server.model.state import State

VOCAB = 1000


def counted_state(n: float) -> State:
    """A batch-1 state that says it has consumed n tokens."""
    st = State(att_shift=torch.zeros(1, 1, 4), ffn_shift=torch.zeros(1, 1, 4), wkv=torch.zeros(1, 1, 1, 4, 4))
    st.att_shift[0, 0, 0] = n
    return st


def consumed(st: Any) -> int:
    return int(st.att_shift[0, 0, 0])


class FakeShape:
    vocab_size = VOCAB

    def signature(self) -> str:
        return "fake-L1-C4-H1-N4"


class FakeTokenizer:
    """Encodes to UTF-8 bytes; decodes as FakeEngine's events show ids ("<id>" each)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode()


@dataclass
class Submission:
    prompt: list[int]
    params: SamplingParams
    init_state: Any
    request_id: str


class FakeHandle:
    def __init__(self, engine: FakeEngine, sub: Submission) -> None:
        self.engine, self.sub, self.request_id = engine, sub, sub.request_id
        self.admitted = True  # (the fake engine runs every submission at once)
        self.tokens: list[int] = []
        self.aborted = False
        self._result: Result | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def ended(self) -> bool:
        return self.done

    async def batches(self):
        n = self.sub.params.max_tokens
        for i in range(n):
            while self.engine.gate is not None and not self.engine.gate.is_set() and not self.aborted:
                await asyncio.sleep(0.005)
            if self.aborted:
                break
            await asyncio.sleep(0)
            tok = 100 + i
            self.tokens.append(tok)
            last = i == n - 1 and self.engine.finish != STOP
            yield [Event(f"<{tok}>", [tok], i + 1, finished=last, finish_reason=LENGTH if last else None)]
        if self.aborted or self.engine.finish == STOP:
            yield [Event("", [], len(self.tokens), True, ABORT if self.aborted else STOP)]
        self._finish()

    def _finish(self) -> None:
        reason = ABORT if self.aborted else (LENGTH if self.engine.finish != STOP else STOP)
        if self.engine.error:
            reason = "error"
        pending = self.tokens[-1:] if reason in (LENGTH, ABORT) else []
        fed = len(self.sub.prompt) + len(self.tokens) - len(pending)
        base = consumed(self.sub.init_state) if self.sub.init_state is not None else 0
        self._result = Result(self.request_id, "".join(f"<{t}>" for t in self.tokens), list(self.tokens),
                              len(self.sub.prompt), len(self.tokens), reason, prefill_time=0.001, gen_time=0.002,
                              state=None if self.engine.error else counted_state(base + fed),
                              error=self.engine.error, pending_tokens=pending)

    async def wait(self) -> Result:
        if self._result is None:  # nobody read its tokens (a prefill-only run): run it here
            async for _ in self.batches():
                pass
        assert self._result is not None
        return self._result

    def peek_result(self) -> Result | None:
        return self._result

    def abort(self) -> bool:
        self.aborted = True
        return True


@dataclass
class FakeEngine:
    max_batch: int = 8
    gate: asyncio.Event | None = None  # set: tokens flow; unset: every run waits (abortable)
    finish: str = LENGTH  # LENGTH: runs end at max_tokens; STOP: a stop token ends them there
    error: str | None = None  # every run fails with this error
    load: tuple[int, int] = (0, 0)  # (running, waiting) that stats() reports
    submissions: list[Submission] = field(default_factory=list)
    handles: list[FakeHandle] = field(default_factory=list)

    @property
    def is_alive(self) -> bool:
        return True

    def submit(self, prompt, params=None, *, init_state=None, request_id=None, return_state=False,
               end_before_state=False, history=0) -> FakeHandle:
        assert return_state and params is not None
        sub = Submission(list(prompt), params, init_state, request_id or f"r{len(self.submissions)}")
        self.submissions.append(sub)
        self.handles.append(FakeHandle(self, sub))
        return self.handles[-1]

    def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(slots=self.max_batch, running=self.load[0], waiting=self.load[1])

    def shutdown(self, timeout: float = 30.0) -> None:
        pass
