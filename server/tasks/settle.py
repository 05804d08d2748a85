"""Settling a finished run (server.tasks.runs): the state the task keeps, its finish reason, and
(persistent) its final row.

State accounting (the engine's contract, server/engine/engine.py): a finished sequence's state
has consumed `input + token_ids - pending_tokens`; normally the last generated token is pending.
A run therefore leaves `state_pos = len(tokens) - 1` and the next run feeds the last token first
(which yields the logits to continue from). A stop token is neither emitted nor fed; we append
EOS to the history so the same rule holds (a run without a prompt, a continue or a fork, that
fed that EOS and stopped at once keeps the old state, EOS still pending: no second EOS). Without
a usable result state (error), or when the run fed nothing (stopped while it waited for a slot:
the engine returns a copy of the starting state, its whole input pending), the old state is kept
(no new key, no write) and the next run re-feeds `tokens[state_pos:]`. A run that settles after
its task was deleted (the delete waits for it at most STOPPING_WAIT_S) leaves no state, cached or
written (a TMP task's: Settler.settle; a persistent one's: Persistence._settled, as the delete may
still fail and leave the task as it was; there too a task lost to another instance).

A stopped run's engine finish reason "abort" shows as "stopped" (`_reason`; "interrupted" when a
shutdown ended it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Protocol

from server.engine.types import ABORT, EOS_TOKEN, ERROR, LENGTH, STOP, Result
from server.tasks.cache import StateCache
from server.tasks.persist import Outcome, SettleJob
from server.tasks.records import FINISHED, TEMPLATE, TMP, Run, Task, update_row
from server.tasks.token_digest import history_digest

if TYPE_CHECKING:
    from server.model.state import State

__all__ = ["SettlePersistence", "Settler", "say_shutdown"]

log = logging.getLogger("server.tasks")


class SettlePersistence(Protocol):
    """What a settle needs of the persistence (server.tasks.persist.Persistence)."""

    def release(self, key: str | None) -> None: ...

    async def queue_settled(self, job: SettleJob) -> asyncio.Future[None]: ...


class Settler:
    """Records the outcomes of finished runs: the run's starting state released, its new state
    cached (and, for a persistent task, queued to be written behind its final row)."""

    def __init__(self, persistence: SettlePersistence, cache: StateCache[State]) -> None:
        self.persistence, self.cache = persistence, cache

    async def settle(self, t: Task, run: Run, res: Result | None, error: str | None) -> None:
        """Record the run's outcome. A persistent task shows as finished only once its final
        row is committed (a client that saw `finished` can rely on it); its new state is
        written behind (server.tasks.persist)."""
        if res is not None and res.finish_reason == ERROR:
            error = res.error or "generation failed"
        reason = _reason(t, res, error)
        covered = None if error else _covered(t, run, res)
        new_key: str | None = None
        state: State | None = None
        # a new state only where the run fed something. One that fed nothing (stopped while it
        # waited for a slot: all its input pending) returns a copy of the state it started from,
        # which t's pointer already leads to (its own state, a fork's source's, else the base or
        # zero state its next run resolves again): not cached, not written again. Nor for a
        # deleted TMP task (a delete that stopped waiting for this settle has forgotten t's states)
        if covered and res is not None and res.state is not None and not (t.kind == TMP and t.deleted):
            state, new_key = res.state, f"{t.id}:{uuid.uuid4().hex[:12]}"
        self.persistence.release(run.key)
        # the state the new one replaces, to leave memory; None where the run made none (an
        # error, a run that stopped at once or fed nothing, a prefill-only run with nothing to
        # feed): t's state stays current and stays cached (the release above returned it to its LRU)
        old_key: str | None = None
        if new_key is not None and state is not None and covered:
            old_key = t.state_id
            t.state_id, t.state_pos = new_key, run.pos + covered
            self._cache_new_state(t, new_key, state)
        else:
            new_key = state = None
        # (prefill_time was set by the output's first token, if any: Pump._on_event); without a
        # result (an error, an interruption) the time it generated until then
        t.gen_time = run.gen_base + res.gen_time if res is not None else t.generating()
        t.run, t.completion_tokens, t.updated_at = None, len(t.out), time.time()
        if t.kind == TMP:
            if old_key and old_key != new_key and old_key.startswith(t.id + ":"):
                self.cache.discard(old_key)
            t.instance = None
            t.finish(reason, error)
            return
        row = update_row(t)
        row.update(status=FINISHED, finish_reason=reason, instance=None, digest=history_digest(t.tokens).hex())
        t.pending_writes += 1
        t.saved = await self.persistence.queue_settled(
            SettleJob(t, row, new_key, state, t.state_pos, old_key, Outcome(reason, error))
        )

    def _cache_new_state(self, t: Task, key: str, state: State) -> None:
        if t.kind == TEMPLATE:
            self.cache.put(key, state, template=True)
        elif t.kind == TMP:
            self.cache.put(key, state, tmp=True)
        else:
            self.cache.pin(key, state)  # until written behind (or dropped: Persistence unpins)


def say_shutdown(ended: list[Task]) -> None:
    """The shutdown's lines on the runs it ended, once their final rows were written (or not: a
    persistent task still running here has a final row that could not be committed, the database
    being unavailable; it is named, never counted as kept)."""
    lost = sorted(t.id for t in ended if t.kind != TMP and t.running)
    kept = sum(1 for t in ended if t.kind != TMP) - len(lost)
    log.info(
        "shutting down: %d running task(s) end as interrupted (%d stored: text and state kept, POST "
        "/v1/tasks/{id}/continue goes on after a restart; %d not stored; %d temporary: gone)",
        len(ended),
        kept,
        len(lost),
        sum(1 for t in ended if t.kind == TMP),
    )
    if lost:
        log.warning(
            "shutting down: the final rows of %d task(s) could not be committed (the task database is unavailable); "
            "their stored rows read running, with the text of their last progress row, until a server of this "
            "database marks them interrupted at its start: %s",
            len(lost),
            ", ".join(lost[:50]) + (f" and {len(lost) - 50} more" if len(lost) > 50 else ""),
        )


def _covered(t: Task, run: Run, res: Result | None) -> int | None:
    """Tokens of the run (input + output) the returned state has consumed, by the engine's
    contract: state + res.pending_tokens == input + res.token_ids (None: no state to keep)."""
    if res is None:
        return 0 if run.handle is None else None
    if res.state is None:
        return None
    if run.n_out != len(res.token_ids):
        log.warning(
            "task %s: %d tokens streamed but the result has %d; state dropped", t.id, run.n_out, len(res.token_ids)
        )
        return None
    covered = run.n_input + len(res.token_ids) - len(res.pending_tokens)
    if not res.pending_tokens and res.finish_reason == STOP and run.params.max_tokens > 0:
        if not res.token_ids and run.after_eos:
            # a run without a prompt of an output a stop token had ended (a continue of it,
            # or a fork: its EOS is the history's last token, not a prompt's) stopped at once:
            # the task stays as it was, its state before that EOS, which stays pending (the
            # new state read it, and a second EOS would have to follow it)
            return None
        # a stop token ended it (not emitted, not fed): EOS becomes the history's last,
        # pending token, so a continuation has something to feed (RWKV's separator)
        t.tokens.append(EOS_TOKEN)
    return covered


def _reason(t: Task, res: Result | None, error: str | None) -> str:
    """The finish reason a run's outcome shows as."""
    if error == "interrupted":
        reason = "interrupted"
    elif error is not None:
        reason = "error"
    elif res is None:
        reason = LENGTH  # prefill-only run with nothing to feed
    else:
        reason = "stopped" if res.finish_reason == ABORT else res.finish_reason
    if t.interrupted and reason in ("stopped", "error"):
        reason, t.interrupted = "interrupted", False
    return reason
