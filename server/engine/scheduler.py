"""The scheduler: decides each engine step, applies its results. Pure Python, no torch.

Slots. The runner's state pool has `max_batch` slots; running sequences always occupy the
contiguous prefix [0, n_active). When sequences leave, the last active slots are moved into the
holes (`MoveOp`, executed by the runner before the step's forward), so a decode step is always
one call over the pool view [0, bucket), bucket = n_active rounded up to a power of two (capped
at max_batch). Rows [n_active, bucket) are free slots: they decode a dummy token and their
garbage never matters, because a slot is reset (zeros or a starting state) on admission.

One step. Every active row decodes exactly one token in a single `model.decode` call:
- a decoding sequence feeds its last sampled token;
- a prefilling sequence feeds the LAST token of this step's prompt chunk; the rest of the chunk
  (if any) goes through `model.forward(chunks, pool, slots)` BEFORE the decode. So all logits come
  from the decode, and forward + sampling of a step is one fixed-shape decode call per bucket
  (what a CUDA graph wants); the chunk logits of the forward are not used.
Only rows marked `commit` yield a real token (decoding rows, and prefilling rows whose prompt
ends in this step unless max_tokens == 0); the other rows' samples are ignored.

Token budget. A step processes at most `budget = max(step_token_budget, max_batch)` tokens:
one per active row first (decode), then prompt chunks (each at most `prefill_chunk` tokens per
sequence, oldest prefilling sequence first), then new admissions (FIFO, each needs at least one
token of budget and a free slot). A burst of short prompts is admitted and prefilled together.

The plan/result types (StepPlan, StepOutput, MoveOp, CopyOutOp, bucket_for) live in plan.py
and are re-exported here.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .plan import CopyOutOp, MoveOp, StepOutput, StepPlan, bucket_for
from .sequence import RUNNING, WAITING, Sequence
from .types import ABORT, ERROR, LENGTH, Event, QueueFullError

__all__ = ["Scheduler", "StepPlan", "StepOutput", "MoveOp", "CopyOutOp", "bucket_for"]


class Scheduler:
    def __init__(self, max_batch: int, step_token_budget: int, prefill_chunk: int, max_queue: int = 0):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.max_batch = max_batch
        self.budget = max(step_token_budget, max_batch)
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence] = []  # active prefix; slots[i].slot == i
        self._ops: list[MoveOp | CopyOutOp] = []
        self._gen = 0  # bumped whenever the active slot set changes (admission, release)
        self._last: StepPlan | None = None
        self._last_gen = -1
        self._last_decode_only = False
        # the id-only fast path of apply() (see apply): facts about the current row set
        self._fast_gen = -1  # the _gen they hold for (-1: not eligible)
        self._stop_union: frozenset[int] = frozenset()  # every row's stop token ids
        self._min_left = 0  # min over rows of max_tokens - tokens generated before the next apply
        self._lazy: tuple[list[Sequence], list[int]] | None = None
        self._text_rows: list[int] = []  # rows with stop strings (decided on text, not lazily)

    # --- queries --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.slots or self.waiting or self._ops)

    # --- inputs ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.max_queue and len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_queue={self.max_queue})")
        seq.status = WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> tuple[Sequence, Event] | None:
        """End a waiting or running sequence by request identity (its slot is freed at once)."""
        self.materialize()
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq, seq.finish(ABORT)
        for seq in self.slots:
            if seq.request_id == request_id:
                ev = seq.finish(ABORT)
                self._release([seq])
                return seq, ev
        return None

    def fail(self, seq: Sequence, message: str) -> Event | None:
        """Fail one sequence (the others are untouched); its slot is freed at once."""
        self.materialize()
        if seq.finished:
            return None
        if seq.status == WAITING:
            self.waiting.remove(seq)
            return seq.finish(ERROR, message)
        ev = seq.finish(ERROR, message)
        self._release([seq])
        return ev

    # --- the step -------------------------------------------------------------------------
    def plan(self, allow_cont: bool = False) -> StepPlan:
        """The next step's plan (call apply() with its sampled tokens afterwards).
        allow_cont: return a continuation plan (StepPlan.cont, no per-row work) when nothing
        changed since the previous plan: every row was decoding (no prompt tokens), no slot was
        admitted or released since, no ops are pending and no waiting request could be admitted."""
        last = self._last
        if (allow_cont and last is not None and self._last_decode_only and self._gen == self._last_gen
                and not self._ops and not (self.waiting and len(self.slots) < self.max_batch)
                and len(last.rows) == len(self.slots)):  # fmt: skip
            plan = StepPlan(rows=last.rows, takes=last.takes, commit=last.commit, bucket=last.bucket, cont=True,
                            sync=self.materialize)  # fmt: skip
            self._last = plan
            return plan
        self.materialize()
        plan = StepPlan(ops=self._ops)
        self._ops = []
        budget = self.budget - len(self.slots)
        for seq in self.slots:
            take = 0
            if seq.prefilling:
                take = self._chunk(seq, budget + 1)
                budget -= take - 1
            self._add_row(plan, seq, take)
        while self.waiting and len(self.slots) < self.max_batch and budget >= 1:
            seq = self.waiting.popleft()
            if not seq.prompt:  # prefill-only request with nothing to feed: done at once
                plan.early.append((seq, seq.finish(LENGTH)))
                continue
            seq.status, seq.slot = RUNNING, len(self.slots)
            self.slots.append(seq)
            plan.admits.append((seq.slot, seq))
            take = self._chunk(seq, budget)
            budget -= take
            self._add_row(plan, seq, take)
        plan.bucket = bucket_for(len(plan.rows), self.max_batch)
        if plan.admits:
            self._gen += 1
        self._last, self._last_gen = plan, self._gen
        self._last_decode_only = bool(plan.rows) and not any(plan.takes)
        self._fast_gen = -1
        if self._last_decode_only:
            self._fast_gen = self._gen
            self._stop_union = frozenset().union(*(s.stop_ids for s in plan.rows))
            self._min_left = min(s.params.max_tokens - p for s, p in zip(plan.rows, plan.positions))
            self._text_rows = [i for i, s in enumerate(plan.rows) if s._has_stops]
        return plan

    def _chunk(self, seq: Sequence, allowed: int) -> int:
        return max(1, min(len(seq.prompt) - seq.n_fed, self.prefill_chunk, allowed))

    def _add_row(self, plan: StepPlan, seq: Sequence, take: int) -> None:
        plan.rows.append(seq)
        plan.takes.append(take)
        plan.positions.append(len(seq.output_ids))
        if take:
            lo, hi = seq.n_fed, seq.n_fed + take
            if take > 1:
                plan.prefill.append((seq.slot, seq.prompt[lo : hi - 1]))
            plan.decode_tokens.append(seq.prompt[hi - 1])
            plan.commit.append(hi == len(seq.prompt) and seq.params.max_tokens > 0)
        else:
            plan.decode_tokens.append(seq.output_ids[-1])
            plan.commit.append(True)

    def apply(self, plan: StepPlan, sampled: list[int], defer_text: bool = False) -> StepOutput:
        """Record the step's sampled tokens (row i = slot i), check stops, free finished slots.
        defer_text: decoding rows of sequences without stop strings only record their token
        (ids decide their end: stop token id, max_tokens); their events come from
        `seq.emit(token)` for each of out.deferred, called later (after the next launch)."""
        self.materialize()
        out = StepOutput()
        done: list[Sequence] = []
        if defer_text and plan is self._last and self._fast_gen == self._gen:
            # every row decodes and no row ended since the plan: if no sampled id can be a stop
            # id and no row reaches max_tokens, only rows with stop strings can end: record the
            # others lazily (materialize), handle those on their text now
            left = self._min_left
            self._min_left = left - 1
            if left > 1 and self._stop_union.isdisjoint(sampled):
                rows = plan.rows
                self._lazy = (rows, sampled)
                out.decode_tokens = len(rows)
                if not self._text_rows:
                    out.deferred = zip(rows, sampled)
                    return out
                for i in self._text_rows:
                    seq = rows[i]
                    if seq.status != RUNNING:
                        continue
                    seq.n_out_fed += 1
                    ev = _fail_alone(seq, seq.add_token, sampled[i])
                    if ev is not None:
                        out.events.append((seq, ev))
                        if ev.finished:
                            done.append(seq)
                out.deferred = ((q, t) for q, t in zip(rows, sampled) if not q._has_stops)
                self._release(done)
                out.finished.extend(done)
                return out
        if defer_text:
            deferred = out.deferred
            n_rec = 0
            for seq, take, token in zip(plan.rows, plan.takes, sampled):
                if take or seq._has_stops or seq.status != RUNNING:
                    continue
                seq.n_out_fed += 1  # consume(0): its pending token was fed by this step
                n_rec += 1
                try:
                    if seq.record(token):
                        done.append(seq)
                except Exception as exc:  # one bad sequence fails alone (inline: the hot loop)
                    out.events.append((seq, _error_finish(seq, exc)))
                    done.append(seq)
                    continue
                deferred.append((seq, token))
            out.decode_tokens += n_rec
            if n_rec == len(plan.rows):  # every row done here (the common case)
                self._release(done)
                out.finished.extend(done)
                return out
        for i, seq in enumerate(plan.rows):
            if seq.finished:  # failed or aborted while the step ran
                continue
            if defer_text and not plan.takes[i] and not seq._has_stops:
                continue  # recorded above
            ev = _fail_alone(seq, self._apply_row, seq, plan.takes[i], plan.commit[i], sampled[i], out)
            if ev is not None:
                out.events.append((seq, ev))
                if ev.finished:
                    done.append(seq)
        self._release(done)
        out.finished.extend(done)
        return out

    def _apply_row(self, seq: Sequence, take: int, commit: bool, token: int, out: StepOutput) -> Event | None:
        seq.consume(take)
        if take and not seq.prefilling and seq.params.max_tokens == 0:
            return seq.finish(LENGTH)
        if not commit:
            return None
        out.decode_tokens += 1
        return seq.add_token(token)

    def materialize(self) -> None:
        """Record the tokens of the last fast-path apply into their sequences (output_ids, fed
        counts). Called by every method that reads or ends sequences, and by the engine before
        it emits their events."""
        lazy, self._lazy = self._lazy, None
        if lazy is not None:
            for seq, token in zip(*lazy):
                if not seq._has_stops:  # those were recorded at once (add_token)
                    seq.n_out_fed += 1
                    seq.output_ids.append(token)

    # --- ending sequences ---------------------------------------------------------
    def _release(self, done: Iterable[Sequence]) -> None:
        """Free the slots of finished sequences; keep the active slots a contiguous prefix."""
        freed = sorted(s.slot for s in done if 0 <= s.slot < len(self.slots) and self.slots[s.slot] is s)
        if not freed:
            return
        for slot in freed:
            seq = self.slots[slot]
            if seq.return_state and seq.finish_reason != ERROR:
                seq.state_queued = True
                self._ops.append(CopyOutOp(slot, seq))
        n_new = len(self.slots) - len(freed)
        freed_set = set(freed)
        holes = [s for s in freed if s < n_new]
        sources = [s for s in range(n_new, len(self.slots)) if s not in freed_set]
        pairs = list(zip(holes, reversed(sources)))  # the last active slot fills the first hole
        for dst, src in pairs:
            self.slots[dst] = self.slots[src]
            self.slots[dst].slot = dst
        for seq in done:
            seq.slot = -1
        del self.slots[n_new:]
        self._gen += 1
        if pairs:
            self._ops.append(MoveOp(pairs))


def _error_finish(seq: Sequence, exc: Exception) -> Event:
    return seq.finish(ERROR, f"{type(exc).__name__}: {exc}")


def _fail_alone(seq: Sequence, fn, *args) -> Event | None:
    """fn(*args), or seq's ERROR finish event when it raises: one bad sequence fails alone."""
    try:
        return fn(*args)
    except Exception as exc:
        return _error_finish(seq, exc)
