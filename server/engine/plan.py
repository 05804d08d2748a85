"""One engine step as plain data, and the runner's contract. No torch, no live objects.

The scheduler writes a `StepPlan` (what the device does this step) and, after the step, a
`StepOutput` (which rows produced output) and `Finished` records (requests that ended). The
runner reads the plan and returns token ids; the output processor reads the plan (to follow the
slots), the output and the records. See scheduler.py for what a plan means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .types import SamplingParams, TokenLogprob

SAMPLED = -1
"""StepPlan.logprobs target: the token the row samples this step."""

MaskFill = Callable[[Any], list[int]]
"""fill(bitmask) -> rows: writes the token masks of this step's constrained rows into rows
0, 1, ... of bitmask (an int32 (>= n, ceil(V/32)) CPU tensor; bit j of word w = token 32w + j)
and returns the plan rows they belong to, in that order (grammar.Constraints.fill). The runner
calls it after launching the step's forward, so the host fills masks while the device runs."""


@dataclass(slots=True)
class MoveOp:
    """Copy slot src -> dst for each pair (state, penalties, sampling params); pairs are disjoint."""

    pairs: list[tuple[int, int]]  # (dst, src)


@dataclass(slots=True)
class CopyOutOp:
    """Copy this finished request's state out of its slot (before later ops reuse the slot)."""

    slot: int
    request_id: str


@dataclass(slots=True)
class Admission:
    """A request taking a slot: reset the slot to its starting state (zeros when None), its
    penalties, its sampling parameters and its random stream's seed."""

    slot: int
    request_id: str
    params: SamplingParams
    seed: int
    init_state: Any = None  # a batch-1 State, or None for zeros


@dataclass(slots=True)
class StepPlan:
    request_ids: list[str] = field(default_factory=list)
    """Row i = slot i: the request decoding in that slot (rows = the active slots)."""
    ops: list[MoveOp | CopyOutOp] = field(default_factory=list)
    """Executed in order, before anything else of the step."""
    admits: list[Admission] = field(default_factory=list)
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    """(slot, tokens) for model.forward, run before the decode."""
    takes: list[int] = field(default_factory=list)
    """Prompt tokens each row consumes this step (0 = the row feeds its pending output token)."""
    commit: list[bool] = field(default_factory=list)
    """Rows whose sample is a real token (the others are prefilling: their sample is ignored)."""
    decode_tokens: list[int] = field(default_factory=list)
    """The token each row feeds to the decode (empty in a continuation plan)."""
    positions: list[int] = field(default_factory=list)
    """Index of the generated token each row samples (the random stream's counter; empty in a
    continuation plan)."""
    logprobs: list[tuple[int, int, int]] = field(default_factory=list)
    """(row, k, target) of the rows whose logprob this step reports, with k alternatives: target
    SAMPLED for the generated token, else the prompt token the row's logits predict (prompt
    logprobs of a row fed one prompt token per step). A continuation plan keeps the list."""
    bucket: int = 0
    """The decode's batch: n_active rounded up by bucket_for (one CUDA graph per bucket)."""
    greedy: bool = False
    """Every row samples greedily (T == 0): the eager runner may take an argmax."""
    cont: bool = False
    """A continuation of the previous plan: the same rows in the same slots, every row decoding
    the token it sampled in the previous step at the next position, the same commit mask.
    decode_tokens and positions are left empty: the runner feeds the previous step's sampled
    ids and positions + 1 on the device (with CUDA graphs, the graph fed itself: a bare replay)."""

    @property
    def n_active(self) -> int:
        return len(self.request_ids)

    @property
    def n_prefill_tokens(self) -> int:
        return sum(self.takes) if not self.cont else 0

    @property
    def n_tokens(self) -> int:
        """Tokens this step feeds through the model (without bucket padding)."""
        return sum(len(t) for _, t in self.prefill) + len(self.request_ids)


@dataclass(slots=True)
class StepOutput:
    """What a step's sampled tokens meant (Scheduler.apply)."""

    tokens: list[int]
    """The sampled ids as the runner returned them (row i = slot i of the plan)."""
    emitted: list[int] | None
    """Rows whose token is new output of a request that goes on (None: every row). Tokens that
    end their request travel in its Finished record instead; stop token ids are not output."""
    decode_tokens: int = 0
    """Generated tokens committed this step (stop token ids included)."""


STATE_SLOT, STATE_START = "slot", "start"
"""Where a finished request's state comes from (Finished.state): copied out of its slot by a
CopyOutOp (the runner hands it back by request id), or its starting state (it never ran)."""


@dataclass(slots=True)
class Finished:
    """A request that ended, as the scheduler saw it (ids, not text)."""

    request_id: str
    reason: str
    """types.STOP / LENGTH / ABORT / ERROR."""
    token: int | None
    """The token sampled in the step that ended it, output with the final event (max_tokens
    reached, or a stop string matched in its text); None when the end added no output."""
    token_ids: list[int]
    pending_tokens: list[int]
    """prompt + token_ids not yet fed into the state ([] after an error)."""
    prompt_tokens: int
    prefill_time: float
    gen_time: float
    state: str = ""
    """STATE_SLOT, STATE_START or "" (no state asked for, or an error)."""
    init_state: Any = None
    """The starting state when state == STATE_START (None: zeros)."""
    error: str | None = None


class StepRunner(Protocol):
    """What the engine needs from the device side (server.engine.runner.Runner; a fake in the
    scheduler tests). One step: prepare -> prefill -> launch -> finish."""

    model_time: float
    sample_time: float

    def prepare(self, plan: StepPlan) -> list[tuple[str, str]]:
        """Run the plan's ops and admissions; (request_id, message) of admissions that failed."""
        ...

    def prefill(self, plan: StepPlan) -> None: ...

    def launch(self, plan: StepPlan, masks: MaskFill | None = None) -> Any:
        """Enqueue the decode + sampling of the plan's rows (a job for finish; None when there
        are no rows). masks: this step's constrained rows (see MaskFill); None: no row is."""
        ...

    def logprobs(self, job: Any) -> list[TokenLogprob]:
        """After finish(job): the plan's logprobs entries' values, in the plan's order."""
        ...

    def finish(self, job: Any) -> list[int]:
        """Wait for a launched step; its sampled ids (row i = slot i)."""
        ...

    def poll_copies(self, wait: bool = False) -> list[tuple[str, Any]]:
        """(request_id, state) of the copy-outs that completed (all of them when wait)."""
        ...

    @property
    def copies_pending(self) -> bool: ...

    def close(self) -> None:
        """Release what the runner holds beyond memory (its copy thread); after the last step."""
        ...

    def bind_thread(self) -> None:
        """Called first on the engine thread (the runner's GPU becomes its current device)."""
        ...

    def detached_state(self, init_state: Any) -> Any:
        """A batch-1 state on the CPU: a copy of init_state, or zeros when None."""
        ...

    def check_state(self, state: Any) -> None:
        """Raise ValueError when a starting state does not fit the model."""
        ...


def bucket_for(n: int, max_batch: int) -> int:
    """The decode batch for n rows: the smallest power of two >= n, capped at max_batch (0 for
    n == 0). The only bucketing rule: the runner's CUDA graphs are captured for bucket_sizes."""
    if n <= 0:
        return 0
    b = 1
    while b < n:
        b *= 2
    return min(b, max_batch)


def bucket_sizes(max_batch: int) -> list[int]:
    """Every value bucket_for(n, max_batch) takes for n in [1, max_batch], ascending."""
    return sorted({bucket_for(n, max_batch) for n in range(1, max_batch + 1)})
