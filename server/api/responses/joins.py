"""How a response's items join its conversation (server.api.responses.conversation: where a
response in a conversation starts; the rows: server.tasks.conversations).

A response's input and output items join the conversation once it ended completed or incomplete
(max_output_tokens): a cancelled or failed one adds nothing, so a client that sends it again
finds the conversation as it was. Each response made in a conversation has a run row
(`begin_run`); the join finishes it, in one transaction.

Two ways, one outcome:
- `join_when_done`, in the background of the request that made the response: once the run has
  ended, the items and the history length are read from the task at once (no await between the
  end and the read: a continue through /v1/tasks cannot slip in), then written.
- `settle`, by every reader of the conversation (each conversation route, each response in it,
  and the delete of one of its responses), for the runs no join of this process holds: those a
  restart cut off, or another replica's. It reads the stored task. A task run again since (its
  version moved: a continue) no longer shows the response's output: such a run is left to the
  live replica that made it (its background join read the output as the run ended), and
  dropped, nothing joining, once that replica is gone (or was this process). A run whose
  background join is under way here is waited for, so what a reader answers includes it; so is
  a run whose stop was asked for here (its client left, a cancel: it settles at the next engine
  step), so that a client that leaves and sends its next turn at once finds the conversation
  free (conversation_locked: server.api.responses.conversation). A join whose write failed is
  done by the next reader, from the stored task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from server.api.errors import ApiError, task_error
from server.api.responses import render
from server.tasks.conversation_data import (
    Conversation,
    ConversationFull,
    ConversationLocked,
    ConversationNotFound,
    ItemIdTaken,
    ItemNotFound,
    Run,
)
from server.tasks.conversations import MAX_ITEMS
from server.tasks.errors import TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

log = logging.getLogger("server.api.responses")
T = TypeVar("T")

ELSEWHERE_WAIT_S = 2.0
"""How long a new response waits for a response another server runs on its conversation to end
(that server may be stopping it: its client left) before it is refused as conversation_locked."""
ELSEWHERE_POLL_S = 0.05
"""How often that run is read again meanwhile."""

JOINS = ("completed", "incomplete")
"""The statuses of a response whose items join its conversation."""


def not_found(cid: str, param: str | None) -> ApiError:
    return ApiError(404, f"conversation {cid!r} not found (unknown, deleted, or another API key's)", param=param,
                    code="conversation_not_found")  # fmt: skip


def locked(cid: str, task_id: str) -> ApiError:
    """OpenAI's answer to a response on a conversation while another one runs there."""
    return ApiError(400, f"another response is running on conversation {cid!r} ({render.response_id_of(task_id)}, "
                    "queued or in progress): "
                    "retry once it has ended", param="conversation",
                    code="conversation_locked")  # fmt: skip


async def db(aw: Awaitable[T], cid: str, param: str | None = "conversation_id", after: bool = False) -> T:
    """Await a conversation query: its refusals as ApiErrors (a missing item: 404, or with `after`
    the 400 of a list's cursor), a database outage as the task layer's (503)."""
    try:
        return await aw
    except ConversationNotFound:
        raise not_found(cid, param) from None
    except ItemNotFound as exc:
        if after:
            raise ApiError(400, f"after {exc.args[0]!r} is not the id of an item of this list", param="after",
                           code="invalid_request") from None  # fmt: skip
        raise ApiError(404, f"item {exc.args[0]!r} not found in conversation {cid!r}", param="item_id",
                       code="item_not_found") from None  # fmt: skip
    except ItemIdTaken as exc:
        raise ApiError(400, f"{exc}: give each item a new id, or none", param=f"items[{exc.index}].id",
                       code="invalid_request") from None  # fmt: skip
    except ConversationLocked as exc:
        raise locked(cid, exc.task_id) from None
    except ConversationFull:
        raise ApiError(400, f"conversation {cid!r} would hold more than {MAX_ITEMS} items", param="items",
                       code="invalid_request") from None  # fmt: skip
    except TaskError as exc:
        raise task_error(exc) from None


def joined(t: Task) -> tuple[list[dict[str, Any]] | None, int]:
    """What an ended response adds to its conversation (its input, then its output; None when it
    adds nothing) and its history's length then."""
    if render.status(t) not in JOINS:
        return None, len(t.tokens)
    return [*(render.meta(t).get("input") or []), *render.output(t)], len(t.tokens)


@dataclass
class _Join:
    t: Task
    job: asyncio.Task[None]
    ended: bool = False
    """The run ended and its items were read: the job is writing them."""
    finished: bool = False
    """The job finished the run (or found the conversation gone): nothing is left to do."""


_joins: dict[str, _Join] = {}  # task id -> its background join (also keeps the job referenced)


def join_when_done(tm: TaskManager, cid: str, t: Task, run: Run) -> None:
    """Join t's items to the conversation once its run ended, in the background (its answer is
    not held for it)."""

    async def join() -> None:  # (starts at the loop's next turn: j is set by then)
        try:
            if t.done is not None:
                await t.done.wait()
            items, tokens = joined(t)  # (at once: read as the run left it)
            j.ended = True
            await tm.conversations.finish_run(cid, run, items, tokens)
            j.finished = True
        except ConversationNotFound:
            j.finished = True  # deleted meanwhile: nothing to join
        except Exception as exc:  # the database away: the run row stays, the next reader joins it
            log.warning("response %s: its items did not join conversation %s now (%s)", t.id, cid, exc)
        finally:
            _joins.pop(t.id, None)

    j = _joins[t.id] = _Join(t, asyncio.create_task(join()))


async def _read(tm: TaskManager, task_id: str, owner: str | None) -> Task | None:
    """The run's task as stored now (None: deleted, nothing joins)."""
    try:
        return await tm.get(task_id, owner)
    except TaskNotFound:
        return None
    except TaskError as exc:
        raise task_error(exc) from None


async def _stopped(tm: TaskManager, t: Task) -> Task | None:
    """t once its run, whose stop was asked for, has settled (None: deleted meanwhile)."""
    try:
        return await tm.settled(t)
    except TaskNotFound:
        return None


async def settle(tm: TaskManager, cid: str, owner: str | None, param: str | None = "conversation_id") -> Conversation:
    """The conversation once the responses made in it that have ended joined it (404: not found)."""
    return (await settle_runs(tm, cid, owner, param))[0]


async def settle_runs(
    tm: TaskManager, cid: str, owner: str | None, param: str | None = "conversation_id", *, wait: float = 0.0
) -> tuple[Conversation, list[Run]]:
    """settle's conversation, and the runs it left: those still running (here or elsewhere), or
    left to the live server that made them. `wait`: seconds a run another server runs is given
    to end first (read again meanwhile), as one being stopped here is: that server may be
    stopping it (its client left), which this one cannot see."""
    deadline = time.monotonic() + wait
    store, oid = tm.conversations, tm.owner_id(owner)
    c, runs = await db(store.with_runs(cid, oid), cid, param)  # (the owner's: another's runs are not touched)
    left: list[Run] = []
    for run in runs:
        j = _joins.get(run.task_id)
        if j is not None and not await _joined_here(tm, j):
            left.append(run)  # running here
        # no job here (a restart, another server's run), or one whose write failed: the stored task
        elif (j is None or not j.finished) and not await _join_stored(tm, cid, run, owner, param, deadline):
            left.append(run)
    # (runs were read before the conversation, in one transaction: a join that committed before
    # the first read is in `c`; one that commits after left its run to this loop)
    return (await db(store.get(cid, oid), cid, param) if runs else c), left


async def _joined_here(tm: TaskManager, j: _Join) -> bool:
    """False while the run this process joins runs on; else once its join job is done (the run
    ended, or was being stopped: its client left, a cancel, settled at the next engine step)."""
    if not j.ended and j.t.stop_requested:
        await _stopped(tm, j.t)
    if not j.ended and j.t.running:  # (a stop not settled within its wait: as a running one)
        return False
    await asyncio.shield(j.job)  # ended: its job may not even have woken yet
    return True


async def _join_stored(
    tm: TaskManager, cid: str, run: Run, owner: str | None, param: str | None, deadline: float
) -> bool:
    """Finish `run` from its stored task: True once done (joined, or dropped: its task deleted,
    or run again since by a server that is gone); False while it runs, or its live maker joins it."""
    t = await _read(tm, run.task_id, owner)
    if t is not None and t.stop_requested:  # (its client left, or a cancel: a moment)
        t = await _stopped(tm, t)
    while t is not None and t.running and t.instance != tm.instance and time.monotonic() < deadline:
        await asyncio.sleep(ELSEWHERE_POLL_S)
        t = await _read(tm, run.task_id, owner)
    moved = t is not None and t.version != run.task_version
    if (t is not None and t.running and not moved) or (moved and run.instance in tm.lease.peers):
        return False  # running; or continued since, and its maker, alive, joins it as it ended
    items, tokens = joined(t) if t is not None and not moved else (None, 0)
    store = tm.conversations
    try:
        await db(store.finish_run(cid, run, items, tokens), cid, param)
    except ApiError:
        raise
    except Exception:  # (a bug: the run is dropped rather than failing every read of the conversation)
        log.exception("response %s: its items could not join conversation %s; dropped", run.task_id, cid)
        await db(store.finish_run(cid, run, None), cid, param)
    return True
