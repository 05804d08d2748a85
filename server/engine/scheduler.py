"""The scheduler: decides each engine step, applies its sampled ids. Pure Python, no torch.

It speaks plain data (plan.py): `plan()` returns a StepPlan, `apply(plan, tokens)` a StepOutput,
and every request that ends becomes a `Finished` record (`take_finished()`). It never sees
text: a request with stop strings is decided on its text by the `match_stops` callable given to
`apply` (the output processor's), before the next plan.

Slots. The runner's state pool has `max_batch` slots; running sequences always occupy the
contiguous prefix [0, n_active). When sequences leave, the last active slots are moved into the
holes (`MoveOp`, executed by the runner before the step's forward), so a decode step is always
one call over the pool view [0, bucket), bucket = bucket_for(n_active). Rows [n_active, bucket)
are free slots: they decode a dummy token and their garbage never matters, because a slot is
reset (zeros or a starting state) on admission.

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

The fast path (what keeps big batches cheap). When nothing changed since the last plan (every
row decoding, no admission, no release, no waiting request that fits), `plan()` returns a
continuation plan: O(1), no per-row lists. When, in addition, no sampled id is any row's stop id
and no row can reach max_tokens, `apply()` is O(1) too: the ids are recorded into the sequences
later (`materialize()`, which the engine calls while the device runs the next step, and which
every method that reads the sequences calls first).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from .plan import (
    SAMPLED,
    STATE_SLOT,
    STATE_START,
    Admission,
    CopyOutOp,
    Finished,
    MoveOp,
    StepOutput,
    StepPlan,
    bucket_for,
)
from .sequence import FINISHED, RUNNING, WAITING, EngineSeq
from .types import ABORT, ERROR, LENGTH, NONFINITE_MESSAGE, NONFINITE_TOKEN, STOP, QueueFullError

__all__ = ["MatchStops", "Scheduler"]

MatchStops = Callable[[list[int], list[int]], dict[int, "str | None"]]
"""match_stops(rows, tokens): feed each listed row's token into its text; return {row: None} for
rows whose text reached a stop string, {row: message} for rows whose text failed."""


class Scheduler:
    def __init__(self, max_batch: int, step_token_budget: int, prefill_chunk: int, max_queue: int = 0,
                 continuation: bool = True):  # fmt: skip
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.max_batch = max_batch
        self.budget = max(step_token_budget, max_batch)
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.continuation = continuation
        """Return continuation plans when nothing changed (off: every plan is a full one)."""
        self.waiting: deque[EngineSeq] = deque()
        self.slots: list[EngineSeq] = []  # active prefix; slots[i].slot == i
        self._by_id: dict[str, EngineSeq] = {}  # waiting and running
        self._ops: list[MoveOp | CopyOutOp] = []
        self._finished: list[Finished] = []
        self._n_sampling = 0  # running sequences with temperature > 0
        self._gen = 0  # bumped whenever the active slot set changes (admission, release)
        self._last: StepPlan | None = None
        self._rows: list[EngineSeq] = []  # the last plan's rows (row i = slot i when planned)
        # the O(1) apply (see apply): facts about the current row set, valid while _fast_gen == _gen
        self._fast_gen = -1
        self._stop_union: frozenset[int] = frozenset()  # every row's stop token ids
        self._min_left = 0  # min over rows of max_tokens - tokens generated before the next apply
        self._text_rows: list[int] = []  # rows with stop strings
        self._lazy: tuple[list[EngineSeq], list[int]] | None = None

    # --- queries --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        """A step is needed: requests to run or to admit, or slot ops (copy-outs) pending."""
        return bool(self.slots or self.waiting or self._ops)

    def has_finished(self) -> bool:
        """Finished records wait to be taken (take_finished)."""
        return bool(self._finished)

    def take_finished(self) -> list[Finished]:
        """The requests that ended since the last call, in order."""
        out, self._finished = self._finished, []
        return out

    # --- inputs ---------------------------------------------------------------------------
    def add(self, seq: EngineSeq) -> None:
        if self.max_queue and len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_queue={self.max_queue})")
        seq.status = WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request (its slot is freed at once); False if unknown."""
        return self._end_by_id([request_id], ABORT, None)

    def fail(self, request_ids: Iterable[str], message: str) -> bool:
        """Fail these requests (the others are untouched); their slots are freed at once."""
        return self._end_by_id(request_ids, ERROR, message)

    def _end_by_id(self, request_ids: Iterable[str], reason: str, error: str | None) -> bool:
        self.materialize()
        ended, done = False, []
        for rid in request_ids:
            seq = self._by_id.get(rid)
            if seq is None:
                continue
            if seq.status == WAITING:
                self.waiting.remove(seq)
            else:
                done.append(seq)
            self._end(seq, reason, error=error)
            ended = True
        self._release(done)
        return ended

    # --- the step -------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The next step's plan (call apply() with its sampled tokens afterwards): a
        continuation plan when the last plan's rows were all decoding and, since then, no row
        ended and no waiting request could be admitted."""
        last = self._last
        if (self.continuation and last is not None and self._fast_gen == self._gen and not self._ops
                and not (self.waiting and len(self.slots) < self.max_batch)):  # fmt: skip
            plan = StepPlan(request_ids=last.request_ids, takes=last.takes, commit=last.commit, bucket=last.bucket,
                            greedy=last.greedy, cont=True, logprobs=last.logprobs)  # fmt: skip
            self._last = plan
            return plan
        self.materialize()
        plan = StepPlan(ops=self._ops)
        rows: list[EngineSeq] = []
        self._ops = []
        budget = self.budget - len(self.slots)
        for seq in self.slots:
            take = 0
            if seq.prefilling:
                take = self._chunk(seq, budget + 1)
                budget -= take - 1
            self._add_row(plan, rows, seq, take)
        while self.waiting and len(self.slots) < self.max_batch and budget >= 1:
            seq = self.waiting.popleft()
            if not seq.prompt:  # prefill-only request with nothing to feed: done at once
                self._end(seq, LENGTH)
                continue
            self._admit(plan, seq)
            take = self._chunk(seq, budget)
            budget -= take
            self._add_row(plan, rows, seq, take)
        plan.bucket = bucket_for(len(rows), self.max_batch)
        plan.greedy = self._n_sampling == 0
        if plan.admits:
            self._gen += 1
        self._last, self._rows = plan, rows
        self._fast_gen = -1
        if rows and not any(plan.takes):  # every row decodes: the fast path's facts
            self._fast_gen = self._gen
            self._stop_union = frozenset().union(*(s.stop_ids for s in rows), (NONFINITE_TOKEN,))
            self._min_left = min(s.params.max_tokens - p for s, p in zip(rows, plan.positions))
            self._text_rows = [i for i, s in enumerate(rows) if s.has_stops]
        return plan

    def _admit(self, plan: StepPlan, seq: EngineSeq) -> None:
        seq.status, seq.slot = RUNNING, len(self.slots)
        self.slots.append(seq)
        plan.admits.append(Admission(seq.slot, seq.request_id, seq.params, seq.seed, seq.init_state))
        seq.init_state = None  # the runner's now
        self._n_sampling += seq.params.temperature > 0

    def _chunk(self, seq: EngineSeq, allowed: int) -> int:
        if seq.params.prompt_logprobs is not None:  # each prompt position's logits: one per step
            return 1
        return max(1, min(len(seq.prompt) - seq.n_fed, self.prefill_chunk, allowed))

    @staticmethod
    def _add_row(plan: StepPlan, rows: list[EngineSeq], seq: EngineSeq, take: int) -> None:
        row = len(rows)
        rows.append(seq)
        plan.request_ids.append(seq.request_id)
        plan.takes.append(take)
        plan.positions.append(len(seq.output_ids))
        commit = True
        if take:
            lo, hi = seq.n_fed, seq.n_fed + take
            if take > 1:
                plan.prefill.append((seq.slot, seq.prompt[lo : hi - 1]))
            plan.decode_tokens.append(seq.prompt[hi - 1])
            commit = hi == len(seq.prompt) and seq.params.max_tokens > 0
            if hi < len(seq.prompt) and seq.params.prompt_logprobs is not None:
                plan.logprobs.append((row, seq.params.prompt_logprobs, seq.prompt[hi]))
        else:
            plan.decode_tokens.append(seq.output_ids[-1])
        plan.commit.append(commit)
        if commit and seq.params.logprobs is not None:
            plan.logprobs.append((row, seq.params.logprobs, SAMPLED))

    def apply(self, plan: StepPlan, tokens: list[int], match_stops: MatchStops | None = None) -> StepOutput:
        """Record the step's sampled ids (row i = slot i), decide stop ids and max_tokens, ask
        match_stops about the rows with stop strings, free the slots of requests that ended."""
        if plan is not self._last:
            raise ValueError("apply() takes the tokens of the last plan")
        self.materialize()  # (the engine did it while the device ran: nothing left to record)
        rows = self._rows
        if self._fast_gen == self._gen:  # every row decodes and none ended since the plan
            left = self._min_left
            self._min_left = left - 1
            if left > 1 and self._stop_union.isdisjoint(tokens):  # no id or length can end a row
                self._lazy = (rows, tokens)
                text_rows = self._text_rows
                hits = match_stops(text_rows, tokens) if text_rows and match_stops else None
                if not hits:
                    return StepOutput(tokens, None, len(rows))
                self.materialize()
                self._release(self._settle(rows, tokens, text_rows, hits))
                return StepOutput(tokens, [i for i, s in enumerate(rows) if s.status == RUNNING], len(rows))
        return self._apply_rows(plan, rows, tokens, match_stops)

    def _apply_rows(self, plan: StepPlan, rows: list[EngineSeq], tokens: list[int],
                    match_stops: MatchStops | None) -> StepOutput:  # fmt: skip
        emitted: list[int] = []
        text_rows: list[int] = []
        done: list[EngineSeq] = []
        n_dec = 0
        now = time.monotonic()
        for i, seq in enumerate(rows):
            if seq.status != RUNNING:  # failed or aborted while the step ran
                continue
            if plan.takes[i]:
                seq.n_fed += plan.takes[i]
                if not plan.commit[i]:
                    if not seq.prefilling and seq.params.max_tokens == 0:  # prefill-only: done
                        seq.t_first = now
                        self._end(seq, LENGTH)
                        done.append(seq)
                    continue
            else:
                seq.n_out_fed += 1  # its pending token was fed by this step
            n_dec += 1
            tok = tokens[i]
            if seq.t_first is None:
                seq.t_first = now
            if tok == NONFINITE_TOKEN:  # the model overflowed on this row: it fails alone
                self._end(seq, ERROR, error=NONFINITE_MESSAGE)
                done.append(seq)
                continue
            if tok in seq.stop_ids:  # not output, not fed
                self._end(seq, STOP)
                done.append(seq)
                continue
            seq.output_ids.append(tok)
            if seq.has_stops:
                text_rows.append(i)
            elif len(seq.output_ids) >= seq.params.max_tokens:
                self._end(seq, LENGTH, tok)
                done.append(seq)
            else:
                emitted.append(i)
        if text_rows:
            done += self._settle(rows, tokens, text_rows, match_stops(text_rows, tokens) if match_stops else {})
            emitted += [i for i in text_rows if rows[i].status == RUNNING]
        self._release(done)
        return StepOutput(tokens, emitted, n_dec)

    def _settle(self, rows: list[EngineSeq], tokens: list[int], text_rows: list[int],
                hits: dict[int, str | None]) -> list[EngineSeq]:  # fmt: skip
        """End the rows with stop strings whose text hit one (or failed: an error message) or
        that reached max_tokens (their ids are recorded); return those sequences."""
        ended = []
        for i in text_rows:
            seq = rows[i]
            if i in hits:
                msg = hits[i]
                self._end(seq, STOP, tokens[i]) if msg is None else self._end(seq, ERROR, error=msg)
            elif len(seq.output_ids) >= seq.params.max_tokens:
                self._end(seq, LENGTH, tokens[i])
            else:
                continue
            ended.append(seq)
        return ended

    def materialize(self) -> None:
        """Record the ids of the last O(1) apply into their sequences (output_ids, fed counts)."""
        lazy, self._lazy = self._lazy, None
        if lazy is not None:
            for seq, token in zip(*lazy):
                seq.n_out_fed += 1
                seq.output_ids.append(token)

    # --- ending sequences -----------------------------------------------------------------
    def _end(self, seq: EngineSeq, reason: str, token: int | None = None, error: str | None = None) -> None:
        """Finish a sequence (its slot, if any, is freed by the caller's _release)."""
        now = time.monotonic()
        seq.status, seq.finish_reason = FINISHED, reason
        self._by_id.pop(seq.request_id, None)
        state = ""
        if seq.return_state and reason != ERROR:
            state = STATE_SLOT if seq.slot >= 0 else STATE_START
        t_first = seq.t_first or now
        self._finished.append(Finished(
            seq.request_id, reason, token, list(seq.output_ids), seq.pending_tokens() if reason != ERROR else [],
            len(seq.prompt), t_first - seq.t_submit, now - t_first, state,
            seq.init_state if state == STATE_START else None, error,
        ))  # fmt: skip
        seq.init_state = None

    def _release(self, done: Iterable[EngineSeq]) -> None:
        """Free the slots of finished sequences; keep the active slots a contiguous prefix."""
        freed = sorted(s.slot for s in done if 0 <= s.slot < len(self.slots) and self.slots[s.slot] is s)
        if not freed:
            return
        for slot in freed:
            seq = self.slots[slot]
            self._n_sampling -= seq.params.temperature > 0
            if seq.return_state and seq.finish_reason != ERROR:
                self._ops.append(CopyOutOp(slot, seq.request_id))
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
