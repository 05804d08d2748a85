"""TaskManager: the task operations of docs/task-api.md over the engine, the state cache and the store.

Everything runs on the event loop (no locks needed); database work is async (aiosqlite threads)
and state (de)serialization runs in worker threads. Runs and persistence live in the mixins
(runs.py, persist.py); stream events in streaming.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from array import array
from collections import Counter
from typing import Any, AsyncIterator

from cachetools import LRUCache

from server.tasks import streaming
from server.tasks.cache import StateCache
from server.tasks.errors import TaskConflict, TaskForbidden, TaskInvalid, TaskNotFound
from server.tasks.params import clean_params, fim_prompt
from server.tasks.inventory import InventoryMixin
from server.tasks.persist import PersistMixin
from server.tasks.records import TASK, TEMPLATE, TMP, Output, Task, from_row, kind_of, new_id
from server.tasks.runs import RunMixin
from server.tasks.store import Store

log = logging.getLogger("server.tasks")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class TaskManager(RunMixin, PersistMixin, InventoryMixin):
    def __init__(self, engine: Any, tokenizer: Any, settings: Any, model_shape: Any, *,
                 store: Store | None = None, latency: Any = None) -> None:
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.signature = model_shape.signature()
        self.vocab_size = int(model_shape.vocab_size)
        self.store = store or Store(settings.db)
        self.cache = StateCache(settings.state_cache_bytes)
        from server.tasks.writer import Writer

        self.writer = Writer(settings.writer_queue)
        self.live: dict[str, Task] = {}  # TMP tasks, running tasks, tasks with writes pending
        self.recent: LRUCache = LRUCache(maxsize=1024)  # finished stored tasks read lately
        self.counters: Counter = Counter()
        self.latency: Any = latency
        """Optional factory of a latency recorder per run (the HTTP layer's Recorder, bound to
        its Metrics): on_batch(run, events) per batch of tokens, finish() at the end."""
        self.interrupted: list[str] = []
        self.db_state_bytes = 0
        self._pumps: set[asyncio.Task] = set()
        self._progress_queued = False  # a progress job is in the writer queue
        self._progress_at = 0.0  # monotonic time of the last progress job offered
        self._janitor: asyncio.Task | None = None
        self._seq = 0

    # --- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.open()
        self.interrupted = await self.store.mark_interrupted()
        if self.interrupted:
            log.warning("%d task(s) were running when the server stopped; marked interrupted",
                        len(self.interrupted))
        self.db_state_bytes = await self.store.states_bytes(templates=False)
        self.writer.start()
        self._janitor = asyncio.create_task(self._sweep_loop(), name="task-janitor")

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        for t in list(self.live.values()):  # runs end as "interrupted", their state kept
            if t.running:
                t.interrupted = True
                self._abort(t)
        pumps = list(self._pumps)
        if pumps:
            _, late = await asyncio.wait(pumps, timeout=10)
            for p in late:
                p.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.writer.close()
        await self.store.close()

    # --- lookup and access -----------------------------------------------------------------------
    @staticmethod
    def owner_id(owner: str | None) -> str | None:
        """Tasks store a hash of the API key, never the key."""
        return None if owner is None else hashlib.sha256(owner.encode()).hexdigest()[:32]

    async def _lookup(self, task_id: str) -> Task | None:
        t = self.live.get(task_id) or self.recent.get(task_id)
        if t is not None or kind_of(task_id) == TMP:
            return t
        row = await self.store.get_task(task_id)
        t = self.live.get(task_id) or self.recent.get(task_id)  # loaded meanwhile?
        if t is None and row is not None:
            t = from_row(row)
            self.recent[task_id] = t
        return t

    async def get(self, task_id: str, owner: str | None = None, *, write: bool = False,
                  force: bool = False) -> Task:
        """The task, if `owner` may see it (write: may change it). 404/403 otherwise."""
        t = await self._lookup(task_id)
        oid = self.owner_id(owner)
        if t is None or t.deleted:
            raise TaskNotFound(f"task {task_id!r} not found", param="task_id")
        if oid is not None and t.owner != oid:
            if t.kind != TEMPLATE:
                raise TaskNotFound(f"task {task_id!r} not found", param="task_id")
            if write:
                raise TaskForbidden(f"template {task_id!r} belongs to another API key")
        if write and t.kind == TEMPLATE and not force:
            raise TaskForbidden(f"{task_id!r} is a template (read-only); pass force=true to change it")
        return t

    # --- operations ------------------------------------------------------------------------------
    async def create(self, prompt: str | list[int], params: dict[str, Any] | None = None, *,
                     persistent: bool = False, owner: str | None = None) -> Task:
        ids = await self._encode(prompt)
        if not ids:
            raise TaskInvalid("prompt must not be empty", param="prompt")
        kind = TASK if persistent else TMP
        t = Task(id=new_id(kind), kind=kind, owner=self.owner_id(owner),
                 params=clean_params(params or {}), prompt=prompt if isinstance(prompt, str) else "")
        return await self._start(t, ids, new=True)

    async def fim(self, prefix: str, suffix: str = "", params: dict[str, Any] | None = None, *,
                  persistent: bool = False, owner: str | None = None) -> Task:
        return await self.create(fim_prompt(prefix, suffix), params, persistent=persistent, owner=owner)

    async def fork(self, task_id: str, params: dict[str, Any] | None = None,
                   prompt: str | list[int] | None = None, *, tmp: bool = False,
                   owner: str | None = None) -> Task:
        """A new task from a copy of the source's state and parameters, then the overrides
        (max_tokens included), then the prompt. The source is untouched."""
        ids = await self._encode(prompt) if prompt else None
        src = await self.get(task_id, owner)
        if src.running:
            raise TaskConflict(f"task {task_id} is running; fork it once it has finished")
        over = clean_params(params or {})
        merged = {**src.params, **over}
        if merged.get("max_tokens") == 0 and "max_tokens" not in over:
            merged.pop("max_tokens")  # a prefill-only source forks into generating tasks
        kind = TMP if tmp else TASK
        t = Task(id=new_id(kind), kind=kind, owner=self.owner_id(owner), parent_id=src.id,
                 params=merged, prompt=prompt if isinstance(prompt, str) else "",
                 tokens=array("i", src.tokens), out_start=len(src.tokens),
                 state_id=src.state_id, state_pos=src.state_pos, out=Output())
        self.counters["forks"] += 1
        return await self._start(t, ids, new=True)

    async def continue_(self, task_id: str, params: dict[str, Any] | None = None,
                        prompt: str | list[int] | None = None, *, owner: str | None = None,
                        force: bool = False) -> Task:
        """The same task goes on: with a prompt, prefill it then generate (new output);
        without, keep generating (the output grows)."""
        ids = await self._encode(prompt) if prompt else None
        t = await self.get(task_id, owner, write=True, force=force)
        update: dict[str, Any] = {"params": {**t.params, **clean_params(params or {})}}
        if ids is not None:
            update["prompt"] = prompt if isinstance(prompt, str) else ""
        return await self._start(t, ids, new=False, update=update)

    async def stop(self, task_id: str, owner: str | None = None, *, force: bool = False,
                   wait: float = 5.0) -> Task:
        """Stop a running task by identity (engine abort); it ends with finish_reason "stopped"."""
        t = await self.get(task_id, owner, write=True, force=force)
        if t.running:
            self._abort(t)
            await self._wait_done(t, wait)
        return t

    def abort(self, t: Task) -> None:
        """Abort t's run now (synchronous; e.g. its streaming client went away)."""
        if t.running:
            self._abort(t)

    async def delete(self, task_id: str, owner: str | None = None, *, force: bool = False) -> Task:
        t = await self.get(task_id, owner, write=True, force=force)
        if t.running:
            self._abort(t)
            await self._wait_done(t, 5.0)
        t.deleted = True
        self.live.pop(t.id, None)
        self.recent.pop(t.id, None)
        if t.kind != TMP:
            await self.writer.call(self._delete_job, t)
        if t.state_id and t.state_id.startswith(t.id + ":"):
            self.cache.discard(t.state_id)
        t.out.notify()
        return t

    async def as_template(self, task_id: str, owner: str | None = None,
                          name: str | None = None) -> Task:
        """A read-only, persisted template `_TMPL_<hex>` (or `_<name>`) with the task's state."""
        src = await self.get(task_id, owner)
        if src.running:
            raise TaskConflict(f"task {task_id} is running; make a template once it has finished")
        if name is not None and not _NAME.match(name):
            raise TaskInvalid("template name: 1-64 of letters, digits, '_', '-', '.'", param="name")
        tid = new_id(TEMPLATE, name)
        if tid in self.live or await self._lookup(tid) is not None or tid in self.live:
            raise TaskConflict(f"template {tid!r} already exists", param="name")
        params = {k: v for k, v in src.params.items() if not (k == "max_tokens" and v == 0)}
        tpl = Task(id=tid, kind=TEMPLATE, owner=self.owner_id(owner), parent_id=src.id,
                   params=params, prompt=src.prompt, prompt_len=src.prompt_len,
                   tokens=array("i", src.tokens), out_start=src.out_start,
                   out=Output(src.out.text, src.out.offsets), finish_reason=src.finish_reason,
                   prompt_tokens=src.prompt_tokens, completion_tokens=src.completion_tokens,
                   prefill_time=src.prefill_time, gen_time=src.gen_time)
        tpl.out.finish_reason = src.finish_reason
        self.live[tid] = tpl  # reserves the id (no await since the check above)
        try:
            await self._fill_template(tpl, src)
        except BaseException:
            self.live.pop(tid, None)
            self.recent.pop(tid, None)
            tpl.deleted = True
            if tpl.state_id and tpl.state_id.startswith(tid + ":"):
                self.cache.discard(tpl.state_id)
            raise
        return tpl

    async def _fill_template(self, tpl: Task, src: Task) -> None:
        """Give the template a stored state that has consumed all but the last token."""
        state, pos, key = await self._resolve_state(src)
        try:
            if state is not None and pos >= len(src.tokens) - 1:
                tpl.state_id, tpl.state_pos = f"{tpl.id}:{key.rsplit(':', 1)[-1]}", pos
                self.cache.put(tpl.state_id, state, template=True)
                tpl.pending_writes += 1
                item = (tpl, self._row(tpl), tpl.state_id, state, None, None)
                await (await self._queue_settled(item))
                return
        finally:
            self._unpin(key)
        # no usable state: prefill the template's history once (forks then start at no cost)
        tpl.state_id, tpl.state_pos = src.state_id, src.state_pos
        await self._start(tpl, None, new=True, max_tokens=0)
        await self._wait_done(tpl, None)
        if tpl.saved is not None:
            await tpl.saved

    async def wait(self, task_id: str, owner: str | None = None, timeout: float | None = None) -> Task:
        t = await self.get(task_id, owner)
        await self._wait_done(t, timeout)
        return t

    async def _wait_done(self, t: Task, timeout: float | None) -> None:
        if t.running and t.done is not None:
            try:
                await asyncio.wait_for(asyncio.shield(t.done.wait()), timeout)
            except asyncio.TimeoutError:
                pass

    def stream(self, t: Task, pos: int = 0, ping: float = 15.0) -> AsyncIterator[Any]:
        """Stream events of t from token index pos (see streaming.events)."""
        return streaming.events(t, pos, ping=ping)

    # --- helpers ---------------------------------------------------------------------------------
    async def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > 20000:
                return list(await asyncio.to_thread(self.tokenizer.encode, prompt))
            return list(self.tokenizer.encode(prompt))
        ids = [int(x) for x in prompt]
        bad = next((x for x in ids if not 0 <= x < self.vocab_size), None)
        if bad is not None:
            raise TaskInvalid(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param="prompt")
        return ids
