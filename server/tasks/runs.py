"""Runs: one engine submission of a task, from claim to the end of its events; its events are
pumped into the task's output by server.tasks.pump, and the finished run is settled by
server.tasks.settle (the state the task keeps, its final row).

What a run feeds (the engine's contract, server/engine/engine.py): a finished sequence's state
has consumed `input + token_ids - pending_tokens`, normally all but the last token of the
history (settle.py), so a run feeds `tokens[state_pos:]`, the pending token first (which yields
the logits to continue from). A prefill-only run (max_tokens=0) holds the prompt's last token
back for the same reason. A run that feeds more of the history than the pending token rebuilds
a state that is missing (counters `rebuilds`, `rebuild_tokens`).

A persistent run is acknowledged only once its row is committed (a new task's row inserted, an
existing task claimed in the database, server.tasks.persist); its pump runs meanwhile, and its
settle waits for that commit. If the commit fails, the sequence is aborted and the task is left
exactly as it was (the output the pump took meanwhile removed).

A run's start and abort are kept in this module, its pump in pump.py, its settle in settle.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from server.engine.protocol import EngineAPI
from server.engine.types import EOS_TOKEN, SamplingParams
from server.tasks.cache import StateCache
from server.tasks.config import LatencyFactory
from server.tasks.lead import continued, grammar_prefix
from server.tasks.params import sampling_params
from server.tasks.pump import Pump, PumpPersistence
from server.tasks.records import PREFILL, READY, TMP, Output, Run, Task, display_id
from server.tasks.settle import SettlePersistence, Settler
from server.tasks.table import Snapshot, TaskTable

if TYPE_CHECKING:
    from server.model.state import State

__all__ = ["Run", "RunPersistence", "Runs"]

log = logging.getLogger("server.tasks")


class RunPersistence(SettlePersistence, PumpPersistence, Protocol):
    """What runs need of the persistence (server.tasks.persist.Persistence): these, and what
    their settles and pumps need (SettlePersistence: release, queue_settled; PumpPersistence:
    offer_progress)."""

    async def resolve_state(self, t: Task, holder: str | None = None) -> tuple[State | None, int, str | None]: ...

    async def save_started(self, t: Task, new: bool) -> asyncio.Future[Any]: ...


class Runs:
    def __init__(
        self,
        engine: EngineAPI,
        table: TaskTable,
        persistence: RunPersistence,
        cache: StateCache[State],
        counters: Counter[str],
        *,
        default_max_tokens: int,
        max_tokens_limit: int = 0,
        latency: LatencyFactory | None = None,
        instance: str | None = None,
        token_bytes: Callable[[Sequence[int]], bytes] | None = None,
    ) -> None:
        self.engine, self.table, self.persistence = engine, table, persistence
        self.settler = Settler(persistence, cache)  # (the cache: where a run's new state goes)
        self.pump = Pump(persistence, self.settler, self.abort)  # (a cancelled pump aborts its run)
        self.token_bytes = token_bytes
        """The tokenizer's bytes of ids, for where a continue picks up its output's text (lead.py;
        None: every run's text starts afresh)."""
        self.counters = counters
        self.instance = instance
        """This server's instance id, recorded on the rows of the runs it starts."""
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        """Most tokens a run generates (0: none): caps a max_tokens a task inherited."""
        self.latency = latency
        """Optional factory of a latency recorder per run (the HTTP layer's Recorder)."""
        self._pumps: set[asyncio.Task[None]] = set()
        self._seq = 0

    # --- start ---------------------------------------------------------------------------------
    async def start(
        self,
        t: Task,
        prompt_ids: list[int] | None,
        *,
        new: bool,
        max_tokens: int | None = None,
        update: dict[str, Any] | None = None,
    ) -> Task:
        """Claim, apply `update` (task fields), submit, (persistent: commit the row), and pump
        events in the background. On failure the task is as it was."""
        t = self.table.claim(t)
        before = Snapshot.of(t, update or {})
        for k, v in (update or {}).items():
            setattr(t, k, v)
        t.stop_requested = t.interrupted = False  # (the last run's): a stop from here on is this run's
        try:
            run = await self._launch(t, prompt_ids, max_tokens, display_id(t.parent_id) if new else None)
        except BaseException:
            self._unstart(t, before, new)
            raise
        run.undo = partial(self._discard, t, weakref.ref(run), before, new)  # weak: see _discard
        pump = asyncio.create_task(self.pump.follow(t, run), name=f"pump-{t.id}")
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        if t.kind != TMP:
            try:
                run.started = await self.persistence.save_started(t, new)
            except BaseException:
                run.undo()
                raise
            try:
                await asyncio.shield(run.started)  # commit before acknowledging
            except asyncio.CancelledError:
                raise  # the caller left; the run goes on (or its pump undoes it if the commit fails)
            except BaseException:
                run.undo()
                raise
        return t

    def _discard(self, t: Task, ref: weakref.ref[Run], before: Snapshot, new: bool) -> None:
        """Undo a start whose row could not be committed: abort the sequence, restore the task.
        The run is held weakly (start and the pump, which may call this, hold it meanwhile):
        `run.undo` refers to this call, and a cycle through the run kept its handle and final
        state (MBs) in memory, outside the caches' budgets, until the cyclic GC ran."""
        run = ref()
        if run is None or run.discarded:
            return
        run.discarded = True
        if run.handle is not None:
            run.handle.abort()
        self.persistence.release(run.key)
        self._unstart(t, before, new)

    def _unstart(self, t: Task, before: Snapshot, new: bool) -> None:
        """Put t back as it was before the start (_show changed it first). A reader of the
        output the start showed sees that output end: the output that goes on (restored), or a
        new prompt's, which never ran ("stopped")."""
        shown = t.out
        before.restore(t)
        if shown is not t.out:
            shown.finished, shown.finish_reason = True, "stopped"
        shown.notify()
        self.table.unclaim(t, new)

    async def _launch(self, t: Task, prompt_ids: list[int] | None, max_tokens: int | None, holder: str | None) -> Run:
        """Submit t's run (its starting state resolved, its input cut from its history) and make
        it the task's (_show, _begin). On failure the resolved state is released (start restores t)."""
        sp, back = self._run_params(t, prompt_ids, max_tokens)
        n_hist = len(t.tokens)  # the history before this run's prompt
        self._show(t, prompt_ids, back)  # (the prompt joins t.tokens)
        state, pos, key = await self.persistence.resolve_state(t, holder)
        try:
            inp = t.tokens[pos:].tolist()
            rebuilt = n_hist - 1 - pos  # history beyond the pending token: no state had it
            held = 0  # a new prompt's token held back (it still counts against max_prompt_tokens)
            if sp.max_tokens == 0:
                inp = inp[:-1]  # hold the last token back: a fork can then generate at once
                held = 1 if prompt_ids else 0
            elif not inp:  # cannot happen by the invariant; recompute rather than fail
                self.persistence.release(key)
                state, pos, key, inp = None, 0, None, t.tokens.tolist()
            recorder = self.latency() if self.latency is not None else None
            t_submit, handle = time.monotonic(), None
            if inp:
                self._seq += 1
                queued = self._engine_full()  # before submitting: it counts itself as waiting
                # the task's own history (re-fed where its state was rebuilt) is not the request's
                # prompt: only the new prompt counts against max_prompt_tokens
                history = min(len(inp), max(0, n_hist - pos)) - held
                handle = self.engine.submit(
                    inp, sp, init_state=state, return_state=True, request_id=f"{t.id}.{self._seq}", history=history
                )
                t.status = READY if queued else PREFILL
            # (nothing to feed: a prefill-only run whose state is current; it stays PREFILL, as
            # TaskTable.claim left it, until it settles: it waits for no slot)
            after_eos = prompt_ids is None and n_hist > 0 and t.tokens[-1] == EOS_TOKEN
            run = Run(
                pos=pos,
                n_input=len(inp),
                params=sp,
                key=key,
                handle=handle,
                t_submit=t_submit,
                recorder=recorder,
                after_eos=after_eos,
            )
        except BaseException:
            self.persistence.release(key)
            raise
        stop, interrupted = t.stop_requested, t.interrupted  # asked while the state was read
        self._begin(t, run, rebuilt)
        if stop:  # abort found no handle then: the run ends now, as it would have had it run
            t.interrupted = interrupted
            self.abort(t)
        return run

    def _run_params(self, t: Task, prompt_ids: list[int] | None, max_tokens: int | None) -> tuple[SamplingParams, int]:
        """(the run's sampling parameters, the characters of the output's text it takes back):
        t's stored parameters with this call's max_tokens (else the server's cap), the hidden
        lead where asked, and a continue's lead (lead.continued) and grammar prefix."""
        sp = sampling_params(t.params, self.default_max_tokens)
        if max_tokens is not None:
            sp = replace(sp, max_tokens=max_tokens)
        elif self.max_tokens_limit and sp.max_tokens > self.max_tokens_limit:
            sp = replace(sp, max_tokens=self.max_tokens_limit)  # inherited from before a lower limit
        if t.params.get("hidden_lead") and (prompt_ids is not None or not t.out.text.strip()):
            sp = replace(sp, hidden_lead=True)  # (a new prompt starts a new output)
        back = 0
        if prompt_ids is None and self.token_bytes is not None:
            lead, back = continued(t, sp.stop, self.token_bytes)
            if lead is not None:
                sp = replace(sp, lead=lead)
        if prompt_ids is None and sp.grammar is not None and sp.max_tokens > 0:
            # the run extends the same output: its grammar goes on from the output's tokens so far
            # (all its runs', also those restored from the database) whose text is shown
            sp = replace(sp, grammar_prefix=grammar_prefix(t, self.token_bytes))
        return sp, back

    def _show(self, t: Task, prompt_ids: list[int] | None, back: int) -> None:
        """Make t show the run it starts before its state is read (a read may take a while, and t is running
        meanwhile: it must not show its last output as this run's): a new prompt starts a new, empty output (its
        tokens join the history); a continue's output takes `back` characters back and goes on."""
        if prompt_ids is not None:
            t.tokens.extend(prompt_ids)
            t.out_start, t.prompt_len = len(t.tokens), len(prompt_ids)
            t.out, t.gen_time = Output(finished=False), 0.0
        else:
            if t.finish_reason == "stop":
                t.out.hide_unshown()  # (before the take-back: what it takes back shows again)
            self.pump.logprobs.resumed(t.out)  # (its logprobs are this run's until it ends)
            t.out.finished, t.out.finish_reason, t.out.error = False, None, None
            t.out.take_back(back)
        t.run_from = len(t.out)  # (0 for a new output)
        if not len(t.out):  # its first token is still to come (a new prompt, or none came yet)
            t.prefill_time = 0.0
        t.finish_reason, t.prompt_tokens, t.completion_tokens = None, 0, len(t.out)  # (nothing fed yet)

    def _begin(self, t: Task, run: Run, rebuilt: int) -> None:
        """After the submit: count the run, and make it t's."""
        self.counters["runs"] += 1
        self.counters["prefill_tokens"] += run.n_input
        if rebuilt > 0:
            self.counters["rebuilds"] += 1
            self.counters["rebuild_tokens"] += rebuilt
        run.gen_base = t.gen_time  # (0 for a new output)
        t.stop_requested, t.interrupted, t.run = False, False, run
        t.instance = self.instance
        t.prompt_tokens, t.completion_tokens = run.n_input, len(t.out)
        t.updated_at = time.time()

    def _engine_full(self) -> bool:
        """True when the new run has to wait for a slot (status READY), else PREFILL: the
        sequences ahead of it (running, and waiting ones that will take the free slots first)
        fill every slot."""
        try:
            st = self.engine.stats()
            return st.slots > 0 and st.running + st.waiting >= st.slots
        except Exception:
            return False

    # --- stop ----------------------------------------------------------------------------------
    def abort(self, t: Task) -> None:
        """Abort t's engine run (it settles with finish_reason "stopped", or "interrupted"). A
        run still reading its state (claimed, not yet submitted: no handle) is marked, and
        _launch aborts it once submitted: a stop or delete in that window is not lost."""
        if not t.running:
            return
        t.stop_requested = True
        run = t.run
        if run is not None and run.handle is not None:
            try:
                run.handle.abort()
            except Exception:
                log.exception("abort of %s failed", t.id)

    async def close(self, timeout: float = 10.0) -> None:
        """End every run as "interrupted" (state kept) and wait for the pumps to settle."""
        for t in list(self.table.running()):
            t.interrupted = True
            self.abort(t)
        pumps = list(self._pumps)
        if pumps:
            _, late = await asyncio.wait(pumps, timeout=timeout)
            for p in late:
                p.cancel()
            await asyncio.gather(*late, return_exceptions=True)
