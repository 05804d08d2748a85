"""The output processor: text, stop strings, events, results and their delivery to handles.
Pure Python (no torch); runs on the engine thread (`new_text` may run on any thread).

It follows the scheduler's plain data: the plan (to know which request decodes in which row,
the way the runner knows the device's slots), each step's output (which rows produced a token)
and the `Finished` records. Work is staged and done in `flush()`: on CUDA the engine calls it
after launching the next step, so detokenizing and waking consumers overlap the device; on the
CPU right after the step. Only `match_stops` runs before the next plan (a stop string ends its
request, which frees its slot).

Delivery: each flush pushes the events (and results) of every request that got one, then wakes
each event loop once, or runs the handle's listener (handle.Deliveries).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .handle import Deliveries, RequestHandle
from .plan import SAMPLED, STATE_SLOT, STATE_START, Finished, MoveOp, StepOutput, StepPlan
from .text import RequestText, TextDecoder, open_text
from .types import ERROR, Event, Result, SamplingParams, TokenLogprob

log = logging.getLogger("server.engine")


class OutputProcessor:
    def __init__(self, *, new_decoder: Callable[[], TextDecoder], detached_state: Callable[[Any], Any],
                 on_done: Callable[[str], None]):  # fmt: skip
        """new_decoder: a fresh incremental detokenizer per request. detached_state(init_state):
        a batch-1 CPU state (a copy of init_state, zeros when None) for a request that never
        ran. on_done(request_id): called once its Result was handed to its handle."""
        self.new_decoder = new_decoder
        self._detached_state = detached_state
        self._on_done = on_done
        self._texts: dict[str, RequestText] = {}
        self._rows: list[RequestText] = []
        """Row i = the RequestText of the request in slot i as of the last plan (replaced, never
        changed in place: a staged step keeps the list it was made with)."""
        self._emits: list[tuple[list[RequestText], list[int], list[int] | None, list | None]] = []
        self._ends: list[Finished] = []
        self._awaiting: dict[str, tuple[RequestHandle, Event | None, Result]] = {}  # results waiting for their state
        self._early: dict[str, Any] = {}  # states that came before their request's record was flushed
        self._out = Deliveries()
        self._n_lp = 0  # open requests with logprobs (0: the per-token loop skips them)

    # --- requests in ----------------------------------------------------------------------
    def new_text(self, request_id: str, handle: RequestHandle, params: SamplingParams) -> RequestText:
        """The output side of a new request (any thread); `open` it on the engine thread."""
        return open_text(request_id, handle, self.new_decoder(), params)

    def open(self, text: RequestText) -> None:
        self._texts[text.request_id] = text
        if text.lp is not None:
            self._n_lp += 1

    @property
    def pending(self) -> bool:
        """Staged work or undelivered events (flush() has something to do)."""
        return bool(self._emits or self._ends or self._out.items)

    # --- a step ---------------------------------------------------------------------------
    def follow(self, plan: StepPlan) -> None:
        """Apply the plan's slot moves and admissions to the rows (nothing for a continuation)."""
        if plan.cont:
            return
        rows = list(self._rows)
        rows.extend([None] * (plan.n_active - len(rows)))  # type: ignore[list-item]
        for op in plan.ops:
            if isinstance(op, MoveOp):
                for dst, src in op.pairs:
                    rows[dst] = rows[src]
        for a in plan.admits:
            st = rows[a.slot] = self._texts[a.request_id]
            st.handle.admitted = True  # (read by the task layer: a run no longer waiting)
        del rows[plan.n_active :]
        self._rows = rows

    def match_stops(self, rows: list[int], tokens: list[int]) -> dict[int, str | None]:
        """Scheduler.apply's stop check: feed the text of each listed row's token (requests with
        stop strings); {row: None} where a stop string was reached, {row: message} where the
        text failed."""
        out: dict[int, str | None] = {}
        texts = self._rows
        for i in rows:
            try:
                if texts[i].match(tokens[i]):  # type: ignore[attr-defined]
                    out[i] = None
            except Exception as exc:
                out[i] = _message(exc)
        return out

    def stage(self, out: StepOutput, plan: StepPlan | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        """The step's tokens: their events are built at the next flush. logprobs: the values of
        plan.logprobs' entries (runner.logprobs), in order."""
        lps = list(zip(plan.logprobs, logprobs)) if logprobs and plan is not None else None
        self._emits.append((self._rows, out.tokens, out.emitted, lps))

    def finish(self, ends: list[Finished]) -> None:
        """Requests that ended: their last events and results are built at the next flush."""
        self._ends += ends

    def states_ready(self, states: list[tuple[str, Any]]) -> None:
        """Final states copied out of their slots: complete the results that wait for them."""
        for rid, state in states:
            entry = self._awaiting.pop(rid, None)
            if entry is None:  # its record is still staged (ended by an abort before this plan)
                self._early[rid] = state
                continue
            handle, ev, res = entry
            if res.finish_reason != ERROR:
                res.state = state
            self._deliver(handle, ev, res)

    def flush(self) -> list[tuple[str, str]]:
        """Build the staged events and results, deliver everything. Returns (request_id, error)
        of requests whose text failed while they may still run (the engine fails them)."""
        failed: list[tuple[str, str]] = []
        add = self._out.add
        emits, self._emits = self._emits, []
        for rows, tokens, emitted, lps in emits:
            if lps:
                _set_logprobs(rows, lps)
            pairs = zip(rows, tokens) if emitted is None else ((rows[i], tokens[i]) for i in emitted)
            for st, tok in pairs:
                try:
                    if self._n_lp and st.lp is not None:
                        add(st.handle, st.lp.annotate(st.emit(tok)))
                    else:
                        add(st.handle, st.emit(tok))
                except Exception as exc:  # one bad request fails alone
                    failed.append((st.request_id, _message(exc)))
        ends, self._ends = self._ends, []
        for end in ends:
            self._close(end)
        self._out.deliver()
        return failed

    # --- ending requests ------------------------------------------------------------------
    def _close(self, end: Finished) -> None:
        st = self._texts.pop(end.request_id)
        try:
            ev = st.close(end)
        except Exception as exc:
            end.reason, end.error, end.pending_tokens = ERROR, _message(exc), []
            ev = Event("", [], len(end.token_ids), True, ERROR)
        res = Result(
            request_id=end.request_id, text=st.text, token_ids=end.token_ids, prompt_tokens=end.prompt_tokens,
            completion_tokens=len(end.token_ids), finish_reason=end.reason, prefill_time=end.prefill_time,
            gen_time=end.gen_time, error=end.error, pending_tokens=end.pending_tokens,
        )  # fmt: skip
        if st.lp is not None:
            self._n_lp -= 1
            st.lp.annotate(ev)
            res.logprobs, res.prompt_logprobs = st.lp.tokens, st.lp.prompt
        if end.state == STATE_SLOT:  # the runner copies it out: the result waits for it, and so
            # does the finishing event unless the caller asked for it at once (copies can queue)
            last: Event | None = ev
            if st.handle.end_before_state:
                self._out.add(st.handle, ev)
                last = None  # delivered: the Result follows alone
            self._awaiting[end.request_id] = (st.handle, last, res)
            if end.request_id in self._early:
                self.states_ready([(end.request_id, self._early.pop(end.request_id))])
            return
        if end.state == STATE_START and end.reason != ERROR:
            res.state = self._detached_state(end.init_state)
        self._deliver(st.handle, ev, res)

    def _deliver(self, handle: RequestHandle, ev: Event | None, res: Result) -> None:
        self._out.add(handle, ev, res)
        self._on_done(res.request_id)


def _set_logprobs(rows: list[RequestText], lps: list) -> None:
    """Hand a step's logprob values to their rows' RequestTexts: a generated token's for its
    event, a prompt token's to the prompt list."""
    for (row, _k, target), value in lps:
        log = rows[row].lp
        if log is None:
            continue
        if target == SAMPLED:
            log.next = value
        elif log.prompt is not None:
            log.prompt.append(value)


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
