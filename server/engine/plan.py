"""The step plan and its results: the ops (MoveOp, CopyOutOp), StepPlan, StepOutput and
bucket_for, shared by the scheduler (which builds/applies them) and the runner. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .sequence import Sequence
from .types import Event


@dataclass
class MoveOp:
    """Copy slot src -> dst for each pair (state, penalties, sampling params); pairs are disjoint."""

    pairs: list[tuple[int, int]]  # (dst, src)


@dataclass
class CopyOutOp:
    """Copy this finished sequence's state out of its slot (before later ops reuse the slot)."""

    slot: int
    seq: Sequence


@dataclass
class StepPlan:
    ops: list[MoveOp | CopyOutOp] = field(default_factory=list)
    """Executed in order, before anything else of the step."""
    admits: list[tuple[int, Sequence]] = field(default_factory=list)
    """(slot, seq): reset the slot (zeros or seq.init_state), penalties and sampling params."""
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    """(slot, tokens) for model.forward, run before the decode."""
    rows: list[Sequence] = field(default_factory=list)
    """Row i = slot i, for i < n_active."""
    takes: list[int] = field(default_factory=list)
    """Prompt tokens each row consumes this step (0 = the row feeds its pending output token)."""
    decode_tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    """Index of the generated token each row samples (the random stream's counter)."""
    commit: list[bool] = field(default_factory=list)
    bucket: int = 0
    early: list[tuple[Sequence, Event]] = field(default_factory=list)
    """Sequences that ended at admission (prefill-only with an empty prompt: nothing to run)."""
    cont: bool = False
    """A continuation of the previous plan (plan(allow_cont=True)): the same rows in the same
    slots, every row decoding the token it sampled in the previous step at the next position.
    decode_tokens and positions are left EMPTY: the runner takes them from the previous step on
    the device (tokens) and adds 1 (positions); `fill_inputs()` computes them from the rows."""

    sync: "Callable[[], None] | None" = field(default=None, repr=False)
    """Brings the rows' bookkeeping up to date (Scheduler.materialize), for fill_inputs."""

    def fill_inputs(self) -> None:
        """decode_tokens/positions of a continuation plan, from its rows (host fallback)."""
        if self.cont and not self.decode_tokens and self.rows:
            if self.sync is not None:
                self.sync()
            self.decode_tokens = [s.output_ids[-1] for s in self.rows]
            self.positions = [len(s.output_ids) for s in self.rows]

    @property
    def n_active(self) -> int:
        return len(self.rows)

    @property
    def n_prefill_tokens(self) -> int:
        return sum(self.takes)

    @property
    def n_tokens(self) -> int:
        """Tokens this step feeds through the model (without bucket padding)."""
        return sum(len(t) for _, t in self.prefill) + len(self.rows)


@dataclass
class StepOutput:
    events: list[tuple[Sequence, Event]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    deferred: "list[tuple[Sequence, int]] | Iterable[tuple[Sequence, int]]" = field(default_factory=list)
    """apply(defer_text=True): (seq, token) rows whose event is `seq.emit(token)`, to be called
    later, in order, after `Scheduler.materialize()` (their stop/finish is already decided)."""
    decode_tokens: int = 0
    """Generated tokens committed this step."""


def bucket_for(n: int, max_batch: int) -> int:
    """Smallest power of two >= n, capped at max_batch (0 for n == 0)."""
    if n <= 0:
        return 0
    b = 1
    while b < n:
        b *= 2
    return min(b, max_batch)
