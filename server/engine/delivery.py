"""Finishing requests and delivering their events, results and states: the Engine's
DeliveryMixin (the deferred text work of a step, state copies, Result building, failing callers).

The critical path (CUDA, defer_delivery). Between a step's token ids reaching the host and the
next launch, only id bookkeeping runs: `Scheduler.apply(..., defer_text=True)` decides stop token
ids and max_tokens from the ids (when no sampled id is any row's stop id and no row reaches
max_tokens, one set test and nothing per row: the ids are recorded lazily), then a continuation
plan (nothing changed: same rows, all decoding) is launched from the previous step's ids on the
device. Detokenizing, events, results and their delivery run after that launch, while the device
works (`_flush_deferred`). Sequences with stop strings are decided on text before the launch
(their end depends on it); an abort brings the sequence's text up to date first.
"""

from __future__ import annotations

import time

from .handle import Deliveries, call_listeners, wake_loops
from .sequence import Sequence
from .types import ERROR, EngineDeadError, Event, Result


class DeliveryMixin:
    """Engine methods that end sequences and hand events/results to their handles. Uses the
    Engine's scheduler, runner, _lock, _live, _awaiting_state, _deferred, _inbox*, _stats."""
    def _flush_deferred(self) -> None:
        """The last step's deferred work: detokenize its recorded tokens (seq.emit), finish the
        sequences that ended, deliver its events."""
        post, self._deferred = self._deferred, None
        if post is None:
            return
        d, emits = post
        self.scheduler.materialize()  # the ids recorded lazily by the scheduler's fast path
        add, finished = d.add, self._finished
        for seq, token in emits:
            try:
                ev = seq.emit(token)
            except Exception as exc:  # one bad sequence fails alone
                ev = self._emit_failed(seq, exc)
                if ev is None:
                    continue
            if ev.finished:
                finished(seq, ev, d)
            else:
                add(seq.sink, ev)
        d.deliver()

    def _emit_failed(self, seq: Sequence, exc: Exception) -> Event | None:
        msg = f"{type(exc).__name__}: {exc}"
        if not seq.finished:  # still running: fail it (its slot is freed)
            return self.scheduler.fail(seq, msg)
        seq.error, seq.finish_reason = msg, ERROR  # ended by its ids, slot already freed
        return Event("", [], len(seq.output_ids), True, ERROR)

    # --- finishing requests -----------------------------------------------------------------
    def _fail_seq(self, seq: Sequence, msg: str, d: Deliveries) -> None:
        ev = self.scheduler.fail(seq, msg)
        if ev is not None:
            self._finished(seq, ev, d)

    def _finished(self, seq: Sequence, ev: Event, d: Deliveries) -> None:
        if seq.return_state and seq.finish_reason != ERROR:
            if seq.state_queued:  # the runner copies it out at the next step: wait for it
                self._awaiting_state[id(seq)] = ev
                return
            st = seq.init_state.to("cpu").clone() if seq.init_state is not None else self.runner.state_template()
            seq.init_state = None
            return self._complete(seq, ev, st, d)
        seq.init_state = None
        self._complete(seq, ev, None, d)

    def _deliver_states(self, d: Deliveries, wait: bool = False) -> Deliveries:
        for seq, st in self.runner.poll_copies(wait):
            ev = self._awaiting_state.pop(id(seq), None)
            if ev is not None:
                self._complete(seq, ev, st, d)
        return d

    def _complete(self, seq: Sequence, ev: Event, state, d: Deliveries) -> None:
        t_end = seq.t_finish or time.monotonic()
        t_first = seq.t_first or t_end
        res = Result(
            request_id=seq.request_id, text=seq.text, token_ids=list(seq.output_ids),
            prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output_ids),
            finish_reason=seq.finish_reason or ERROR, prefill_time=t_first - seq.t_submit,
            gen_time=t_end - t_first, state=state, error=seq.error,
            pending_tokens=seq.pending_tokens() if seq.finish_reason != ERROR else [],
        )  # fmt: skip
        with self._lock:
            self._live.pop(seq.request_id, None)
        self._stats.finished_total += 1
        d.add(seq.sink, ev, res)

    def _fail_all(self, exc: EngineDeadError) -> None:
        with self._lock:
            handles = list(self._live.values())
            self._live.clear()
            self._inbox.clear()
            self._inbox_adds = 0
        loops: dict = {}
        listened: dict = {}
        for h in handles:
            loop = h._fail(exc)
            fn = h._listener
            if fn is not None:
                listened[h] = fn
            elif loop is not None:
                loops.setdefault(loop, []).append(h)
        call_listeners(listened)
        wake_loops(loops)
