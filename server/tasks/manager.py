"""TaskManager: the task operations of docs/task-api.md over the engine, the state cache and the store.

A facade composed of collaborators, each given what it needs at construction:

    TaskTable      the tasks in memory (live, recently read)
    StateCache     task, TMP and template states in memory (byte budgets, pins)
    Writer         the background database writer (group commits)
    Persistence    state loading and rebuilds, writer jobs, states written behind, the database
                   budget  (store, writer, cache, table)
    Runs           engine submissions: claim, start, abort; the pump by its Pump (pump.py),
                   the settle by its Settler (settle.py)  (engine, table, persistence, cache)
    Inventory      list, stats, the TMP_ janitor  (table, store, cache)
    Lease          this server's instance row and heartbeat among replicas  (store)
    Takeover       the lease's reactions: stale copies of a dead instance's tasks forgotten, the
                   runs taken from this one stopped (takeover.py)  (table, store, runs' abort)
    Access         which tasks a caller may see, and under which id  (table, store, persistence, lease)
    TemplateMaker  as_template: the name checks, the claim, the fill (templates.py)
                   (access, table, cache, persistence, engine)
    Inputs         a caller's prompt as token ids and its parameters, checked (inputs.py)
                   (tokenizer, vocabulary size)
    Conversations  the conversations' rows: items, runs, head (conversations.py)  (store)

Over 300 lines (docs/architecture.md says why): one short method per operation of the API,
kept in one facade.
Everything runs on the event loop (no locks needed); database work is async (aiosqlite threads)
and state (de)serialization runs in worker threads. Stream events: streaming.py (read by the
routes directly).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import Counter
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from server.engine.protocol import EngineAPI
from server.tasks.access import Access
from server.tasks.cache import StateCache
from server.tasks.config import (
    STORE_DTYPES,
    LatencyFactory,
    ModelShapeLike,
    TaskConfig,
    TaskSettings,
    TokenizerLike,
    server_name,
)
from server.tasks.conversations import Conversations
from server.tasks.errors import TaskElsewhere, TaskInvalid, TaskNotFound, TaskStale
from server.tasks.inputs import Inputs, Prompt
from server.tasks.inventory import Inventory
from server.tasks.lease import Lease
from server.tasks.lineage import base_of
from server.tasks.params import GivenParams, TaskParams, fim_prompt, inherited
from server.tasks.persist import Persistence
from server.tasks.records import TASK, TMP, Output, Task, new_id
from server.tasks.runs import Runs
from server.tasks.settle import say_shutdown
from server.tasks.statewrites import StateWrites
from server.tasks.store import Store
from server.tasks.table import TaskTable
from server.tasks.takeover import Takeover
from server.tasks.templates import TemplateMaker, check_name
from server.tasks.writer import Writer

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")
TASK_EVENTS = (
    "runs", "forks", "prefill_tokens", "rebuilds", "rebuild_tokens", "state_misses", "state_corrupt",
    "db_state_loads", "state_writes", "state_write_bytes", "state_writes_dropped", "db_evictions",
    "progress_writes", "progress_rows",
)  # fmt: skip
"""The events the task layer counts (TaskManager.counters, rwkv_task_events_total): each starts at
0, so an alert on `state_corrupt` has its series before the first corruption."""


STOPPING_WAIT_S = 5.0
"""How long a stop, a delete, or a call on a task whose run is being stopped waits for that run to settle."""

STATE_WRITE_WAIT_S = 5.0
"""How long state_written waits for a task's pending state (the lane writes one at a time)."""


GONE_CLOSE_S = 1.0
"""At shutdown, once the task database was found away (Writer.gone): how long removing the lease
row and closing the connections are given (each would wait out its own bound on a stalled server)."""


TagRows = list[tuple[str, str]]
"""(tag, task id) pairs (TaskManager.tagged; named here: the class's `list` method shadows the builtin)."""
DigestRows = list[tuple[str, int, bytes]]
"""(task id, tokens, digest) triples (TaskManager.digests; named here for the same reason)."""


class TaskManager:
    def __init__(
        self,
        engine: EngineAPI,
        tokenizer: TokenizerLike,
        settings: TaskSettings,
        model_shape: ModelShapeLike,
        *,
        store: Store | None = None,
        latency: LatencyFactory | None = None,
    ) -> None:
        """`settings`: server.config.Settings or a TaskConfig (the fields the task layer reads).
        `latency`: optional factory of a latency recorder per run (the HTTP layer's Recorder)."""
        self.engine, self.tokenizer = engine, tokenizer
        cfg = self.config = TaskConfig.of(settings)
        self.signature = model_shape.signature()
        self.vocab_size = int(model_shape.vocab_size)
        self.store = store or Store(cfg.db, busy_timeout=cfg.db_busy_timeout)
        # a given name is watched at start (a live server may use it); a default one is held by the port
        self.lease = Lease(self.store, server_name(cfg.instance_name), cfg.public_url, cfg.lease_timeout,
                           watch=bool(settings.instance_name))  # fmt: skip
        self.instance = self.lease.instance
        self.table = TaskTable()
        self.live = self.table.live  # TMP tasks, running tasks, tasks with writes pending
        self.cache: StateCache[State] = StateCache(
            cfg.state_cache_bytes, tmp_bytes=cfg.tmp_state_bytes, on_evict=self._state_evicted
        )
        self.writer = Writer(cfg.writer_queue)
        self.counters: Counter[str] = Counter(dict.fromkeys(TASK_EVENTS, 0))  # /metrics shows each from 0
        self.persistence = self._persistence()
        self.runs = self._runs(latency)
        self.takeover = Takeover(self.table, self.store, self.instance, self.runs.abort)
        self.inventory = self._inventory()
        self.access = Access(self.table, self.store, self.persistence, self.lease)
        self.templates = TemplateMaker(self.access, self.table, self.cache, self.persistence, engine)
        self.inputs = Inputs(tokenizer, self.vocab_size)
        self.conversations = Conversations(self.store)
        self.interrupted: list[str] = []

    # the layers __init__ wires, each from the fields set before it
    def _persistence(self) -> Persistence:
        """The persistence layer over its state writes (store, writer, cache, table)."""
        cfg = self.config
        states = StateWrites(
            self.store,
            self.writer,
            self.cache,
            self.table,
            self.counters,
            signature=self.signature,
            db_budget_bytes=cfg.db_budget_bytes,
            write_behind_bytes=cfg.write_behind_bytes,
            store_dtype=STORE_DTYPES[cfg.state_store_dtype],
        )
        return Persistence(states, instance=self.instance, url_of=self.lease.url_of, decode=self.tokenizer.decode)

    def _runs(self, latency: LatencyFactory | None) -> Runs:
        """The engine submissions (engine, table, persistence, cache)."""
        cfg = self.config
        return Runs(
            self.engine,
            self.table,
            self.persistence,
            self.cache,
            self.counters,
            default_max_tokens=cfg.default_max_tokens,
            max_tokens_limit=cfg.max_tokens_limit,
            latency=latency,
            instance=self.instance,
            token_bytes=self.tokenizer.decode_bytes,
        )

    def _inventory(self) -> Inventory:
        """List, stats and the TMP_ janitor (table, store, cache; the persistence's figures)."""
        persistence = self.persistence
        return Inventory(
            self.table,
            self.store,
            self.cache,
            self.counters,
            tmp_task_ttl=self.config.tmp_task_ttl,
            db_state_bytes=lambda: persistence.db_state_bytes,
            db_state_entries=lambda: persistence.db_state_entries,
            writer_backlog=self.writer.queue.qsize,
            lane=persistence.lane.stats,
        )

    @property
    def db_state_bytes(self) -> int:
        """Stored non-template state bytes."""
        return self.persistence.db_state_bytes

    # --- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.open()
        self.interrupted = await self.lease.start()
        if self.interrupted:
            log.warning("%d task(s) were running when their server stopped; marked interrupted", len(self.interrupted))
        await self.persistence.start()
        self.writer.start()
        self.inventory.start()
        self.lease.run(self.takeover.reaped, self.takeover.lost)

    async def close(self) -> None:
        """End the runs, write their final rows, then their states, leave the lease, close the
        database. A database found away meanwhile (Writer.closing: the first write that waits
        out its bound) ends the writes at once, and the rest gets GONE_CLOSE_S: the shutdown
        takes about one bound, however many tasks it ends; say_shutdown names what was lost."""
        self.inventory.close()
        running = list(self.table.running())
        self.writer.closing()
        await self.runs.close()  # runs end as "interrupted", their state kept
        await self.writer.flush()  # their rows first, then their states (within a deadline)
        if running:
            say_shutdown(running)  # which final rows were committed
        await self.persistence.close()
        await self.writer.close()
        gone = self.writer.gone is not None  # (lease.close: a delete; store.close: B to close)
        await _bounded(self.lease.close(), GONE_CLOSE_S if gone else None, "removing this instance's lease row")
        await _bounded(self.store.close(), GONE_CLOSE_S if gone else None, "closing its connections")

    async def flush(self) -> None:
        """Until every queued row and every finished task's state are in the database (or the
        state was dropped by the write-behind budget)."""
        await self.persistence.flush()

    def _state_evicted(self, key: str) -> None:
        """A cache LRU dropped `key` (`<task id>:<hex>`): if it was its task's newest state and
        not stored, the task now says its next run rebuilds from its last stored state. Also
        while the task shows running: a settling run's new state may be dropped as it is put
        (larger than its LRU's budget, e.g. --tmp-state-bytes 1) before the task shows finished;
        a run in flight holds its starting state pinned (never dropped by an LRU)."""
        t = self.table.find(key.rsplit(":", 1)[0])
        if t is not None and t.state_id == key and key != t.stored_id:
            t.state_id, t.state_pos = t.stored_id, t.stored_pos

    # --- lookup and access -----------------------------------------------------------------------
    @staticmethod
    def owner_id(owner: str | None) -> str | None:
        """Tasks store a hash of the API key, never the key."""
        return None if owner is None else hashlib.sha256(owner.encode()).hexdigest()[:32]

    async def get(
        self, task_id: str, owner: str | None = None, *, write: bool = False, force: bool = False, stream: bool = False
    ) -> Task:
        """The task, if `owner` may see it (write: may change it). 404 for a task `owner` may
        not see (another key's task, or private template), 403 for a write to a template
        (without `force`, or another key's public one), 409 (TaskElsewhere) for a write or a
        `stream` of a task that runs on another instance."""
        return await self.access.get(task_id, self.owner_id(owner), write=write, force=force, stream=stream)

    # --- operations ------------------------------------------------------------------------------
    async def create(
        self,
        prompt: Prompt,
        params: GivenParams | None = None,
        *,
        persistent: bool = False,
        owner: str | None = None,
        tag: str | None = None,
    ) -> Task:
        """A new task from the zero state. `tag`: what it is to the route making it (Task.tag)."""
        ids = await self.inputs.encode(prompt)
        if not ids:
            raise TaskInvalid("prompt must not be empty", param="prompt")
        kind = TASK if persistent else TMP
        t = Task(
            id=new_id(kind),
            kind=kind,
            owner=self.owner_id(owner),
            params=self.inputs.params(params),
            prompt=prompt if isinstance(prompt, str) else "",
            tag=tag,
        )
        return await self.runs.start(t, ids, new=True)

    async def fim(
        self,
        prefix: str,
        suffix: str = "",
        params: GivenParams | None = None,
        *,
        persistent: bool = False,
        owner: str | None = None,
    ) -> Task:
        return await self.create(fim_prompt(prefix, suffix), params, persistent=persistent, owner=owner)

    async def state_written(self, t: Task, timeout: float = STATE_WRITE_WAIT_S) -> bool:
        """Until t's latest state is written behind its row (False: still pending after
        `timeout`): a fork without a prompt then names that state, not an older one, as its
        stored state (forks share it), so the fork outlives a restart or the state cache."""
        return await self.persistence.lane.written(t.id, timeout)

    async def settled(self, t: Task) -> Task:
        """t once a run whose stop was asked for has settled (fork and continue wait for it the
        same way): its history is then the one they start from. TaskNotFound once deleted."""
        return await _settled_if_stopping(t)

    async def fork(
        self,
        task_id: str,
        params: GivenParams | None = None,
        prompt: Prompt | None = None,
        *,
        tmp: bool = False,
        owner: str | None = None,
        tag: str | None = None,
        inherit: bool = True,
    ) -> Task:
        """A new task from a copy of the source's state and parameters, then the overrides
        (max_tokens included), then the prompt. The source is untouched. `tag`: the new task's
        (Task.tag; never the source's). `inherit=False`: the new task's parameters are `params`
        alone (a field left out is the default, not the source's: a response's seed)."""
        ids = await self.inputs.encode(prompt) if prompt else None
        over = self.inputs.params(params)
        src = await _settled_if_stopping(await self.get(task_id, owner))
        self.access.finished(src, "fork")
        merged: TaskParams = {**inherited(src.params), **over} if inherit else over
        if merged.get("max_tokens") == 0 and "max_tokens" not in over:
            merged.pop("max_tokens")  # a prefill-only source forks into generating tasks
        kind = TMP if tmp else TASK
        t = Task(
            id=new_id(kind),
            kind=kind,
            owner=self.owner_id(owner),
            parent_id=src.id,
            params=merged,
            prompt=prompt if isinstance(prompt, str) else "",
            tokens=array("i", src.tokens),
            out_start=len(src.tokens),
            state_id=src.state_id,
            state_pos=src.state_pos,
            out=Output(),
            base_id=base_of(src),
            tag=tag,
        )
        if kind == TASK:  # its row names a stored state only
            t.stored_id, t.stored_pos = src.stored_id, src.stored_pos
        self.counters["forks"] += 1
        return await self.runs.start(t, ids, new=True)

    async def continue_(
        self,
        task_id: str,
        params: GivenParams | None = None,
        prompt: Prompt | None = None,
        *,
        owner: str | None = None,
        force: bool = False,
    ) -> Task:
        """The same task goes on: with a prompt, prefill it then generate (new output);
        without, keep generating (the output grows)."""
        ids = await self.inputs.encode(prompt) if prompt else None
        over = self.inputs.params(params)
        for attempt in range(2):
            t = await _settled_if_stopping(await self.get(task_id, owner, write=True, force=force))
            merged: TaskParams = {**t.params, **over}
            update: dict[str, Any] = {"params": merged}
            if ids is not None:
                update["prompt"] = prompt if isinstance(prompt, str) else ""
            try:
                return await self.runs.start(t, ids, new=False, update=update)
            except TaskStale:  # another replica ran it since it was read here: read it again
                self.table.forget(t.id)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def stop(
        self, task_id: str, owner: str | None = None, *, force: bool = False, wait: float = STOPPING_WAIT_S
    ) -> Task:
        """Stop a running task by identity (engine abort); it ends with finish_reason "stopped"."""
        t = await self.get(task_id, owner, write=True, force=force)
        if t.running:
            self.runs.abort(t)
            await _wait_done(t, wait)
        return t

    def abort(self, t: Task) -> None:
        """Abort t's run now (synchronous; e.g. its streaming client went away)."""
        if t.running:
            self.runs.abort(t)

    def interrupt(self, t: Task) -> None:
        """End t's run now as the shutdown ends every run: "interrupted" (state kept; a route
        whose request the shutdown ends first, before close() reaches the run)."""
        if t.running:
            t.interrupted = True
            self.runs.abort(t)

    async def delete(self, task_id: str, owner: str | None = None, *, force: bool = False) -> Task:
        t = await self.get(task_id, owner, write=True, force=force)
        if t.running:
            t.deleting = True
            self.runs.abort(t)
            try:
                await _wait_done(t, STOPPING_WAIT_S)
            finally:
                t.deleting = False
        if t.deleted:  # another delete came first while this one waited: it answers as after that one
            raise TaskNotFound(f"task {t.display_id!r} not found", param="task_id")
        t.deleted = True
        if t.kind == TMP:
            self.table.forget(t.id)
        else:
            self.table.begin_delete(t.id)
            try:
                await self.persistence.delete(t)
            except TaskElsewhere:  # this copy was stale: a replica runs the task; read it again
                t.deleted = False
                self.table.end_delete(t.id, committed=False)
                self.table.forget(t.id)
                raise
            except BaseException:  # not deleted (e.g. the database is away): the task is as it was,
                t.deleted = False  # and its queued writes (a settle row) go on
                self.table.end_delete(t.id, committed=False)
                self.table.restore(t)
                raise
            self.table.end_delete(t.id)
        if t.state_id and t.state_id.startswith(t.id + ":"):
            self.cache.discard(t.state_id)
        t.out.notify()
        return t

    async def as_template(
        self, task_id: str, owner: str | None = None, name: str | None = None, *, public: bool = False
    ) -> Task:
        """A read-only, persisted template `_TMPL_<hex>` (or `_<name>`) with the task's state,
        answered once its state is stored. Private to `owner`'s key unless `public` (every key
        may read and fork it); a template made without keys (owner None) is public. Names are
        per key: the private `_<name>` of two keys are two templates (TemplateMaker.make)."""
        check_name(name)  # bad input first, whatever the task's state
        src = await _settled_if_stopping(await self.get(task_id, owner))
        return await self.templates.make(src, self.owner_id(owner), name, public)

    async def wait(self, task_id: str, owner: str | None = None, timeout: float | None = None) -> Task:
        t = await self.get(task_id, owner)
        await _wait_done(t, timeout)
        return t

    # --- inventory -------------------------------------------------------------------------------
    async def list(
        self,
        owner: str | None = None,
        *,
        limit: int = 100,
        offset: int = 0,
        kind: str | None = None,
        prompt_contains: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tasks `owner` may see (None: all), newest first; `prompt_contains`: those
        whose last prompt contains it, ASCII case ignored (docs/task-api.md)."""
        return await self.inventory.list(
            self.owner_id(owner),
            all_owners=owner is None,
            limit=limit,
            offset=offset,
            kind=kind,
            prompt_contains=prompt_contains,
        )

    async def tagged(self, owner: str | None, tag: str, *, prefix: bool = False) -> TagRows:
        """(tag, task id) of `owner`'s stored tasks tagged `tag` (prefix: starting with it),
        oldest first: one database read, the same on every replica."""
        return await self.store.tagged(self.owner_id(owner), tag, prefix=prefix)

    async def digests(self, owner: str | None, tag: str, limit: int) -> DigestRows:
        """(task id, tokens, SHA-256 of its token history) of `owner`'s `limit` newest stored
        tasks tagged `tag` that are not running, newest first: one database read."""
        return await self.store.digests(self.owner_id(owner), tag, limit)

    def sweep(self, cutoff: float) -> int:
        """Drop TMP tasks that finished before `cutoff` (epoch seconds)."""
        return self.inventory.sweep(cutoff)

    def stats(self) -> dict[str, Any]:
        """Cache tiers and counters (Inventory.stats), and this instance's replicas."""
        out = self.inventory.stats()
        out.update(instance=self.instance, peers=sorted(self.lease.peers))
        return out


async def _settled_if_stopping(t: Task) -> Task:
    """t, once its run has settled if that run's stop was asked for (`stop`, or its streaming
    client left): continue, fork and as_template then go on instead of answering 409. A run
    that still runs is left alone (the caller refuses it). A stop that a delete asked for ends
    in TaskNotFound, as the call would have answered after the delete."""
    if t.running and t.stop_requested:
        await _wait_done(t, STOPPING_WAIT_S)
    if t.deleted or t.deleting:
        raise TaskNotFound(f"task {t.display_id!r} not found", param="task_id")
    return t


async def _bounded(aw: Awaitable[None], timeout: float | None, what: str) -> None:
    """Await `aw` for up to `timeout` seconds (None: no bound); beyond it, cancelled and said."""
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        log.warning("shutting down: the task database is unavailable; %s was given up after %g s", what, timeout)


async def _wait_done(t: Task, timeout: float | None) -> None:
    """Until t's current run has settled (or `timeout` seconds passed)."""
    if t.running and t.done is not None:
        try:
            await asyncio.wait_for(asyncio.shield(t.done.wait()), timeout)
        except asyncio.TimeoutError:
            pass
