"""rwkv_lightning's state sessions as persistent tasks of the TaskManager.

A session (`/state/chat/completions`, name `<session_id>`) is one persistent task: its first call
creates it from the zero state, every later call continues it (the task layer feeds only the new
prompt after the state it stored). A branching session (`/multi_state/chat/completions`) is a tree
of tasks: node `<session_id>:<n>` is a task made from the zero state (dialogue_idx 0) or forked
from node `<session_id>:<dialogue_idx>` (the source is untouched, so continuing one node twice
makes two branches). States, restarts, eviction and ownership are the task layer's: a session
lives under the API key that made it and survives restarts.

The registry (API key, name) -> task id is kept in the tasks themselves, so it needs no table of
its own: each session task's stop strings carry one more, `TAG + name`. TAG starts with U+FFFF, a
Unicode noncharacter that never appears in text, so that stop string never matches; the task
parameters are stored with the task and kept by its continuations. After a start the registry of
a key is rebuilt from that key's stored tasks on its first session request (one read per stored
task of the key, once per process), then kept in memory.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from server.tasks.errors import TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

TAG = "\uffffrwkv_lightning session "
MAX_NAME = 200
"""Longest session name (the tag is one stop string: server.engine.types.MAX_STOP_CHARS)."""
SCAN_PAGE = 1000


class SessionNotFound(Exception):
    """The named session (or dialogue node) does not exist for this key."""


def name_of(params: dict[str, Any]) -> str | None:
    """The session name a task's parameters carry, or None (not a session task)."""
    for s in params.get("stop") or ():
        if isinstance(s, str) and s.startswith(TAG):
            return s[len(TAG) :]
    return None


def tagged(fields: dict[str, Any], name: str) -> dict[str, Any]:
    """Sampling fields with the session's tag added to the stop strings."""
    return {**fields, "stop": [*fields.get("stop", ()), TAG + name]}


def continued(prompt: str) -> str:
    """lightning's rule for a prompt that continues a state: it starts with a blank line."""
    return prompt if not prompt or prompt.startswith("\n\n") else "\n\n" + prompt


class Sessions:
    """The session registry of one TaskManager, and the session operations on it."""

    _of: ClassVar[weakref.WeakKeyDictionary[TaskManager, Sessions]] = weakref.WeakKeyDictionary()

    def __init__(self, tasks: TaskManager) -> None:
        self.tasks = tasks
        self._names: dict[str | None, dict[str, str]] = {}  # owner id -> name -> task id
        self._next: dict[tuple[str | None, str], int] = {}  # (owner id, session id) -> next dialogue_idx
        self._locks: weakref.WeakValueDictionary[tuple[Any, ...], asyncio.Lock] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, tasks: TaskManager) -> Sessions:
        """The registry of this task manager (one per manager, made on first use)."""
        found = cls._of.get(tasks)
        if found is None:
            found = cls._of[tasks] = cls(tasks)
        return found

    def _lock(self, *key: Any) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    # --- the registry --------------------------------------------------------------------------
    async def names(self, owner: str | None) -> dict[str, str]:
        """name -> task id of `owner`'s sessions (rebuilt from the stored tasks on first use)."""
        oid = self.tasks.owner_id(owner)
        found = self._names.get(oid)
        if found is not None:
            return found
        async with self._lock("scan", oid):
            found = self._names.get(oid)
            if found is None:
                found = self._names[oid] = await self._scan(owner)
        return found

    async def _scan(self, owner: str | None) -> dict[str, str]:
        """The session tasks among `owner`'s stored tasks (the newest task of a name wins)."""
        found: dict[str, tuple[float, str]] = {}
        offset = 0
        while True:
            page = (await self.tasks.list(owner, limit=SCAN_PAGE, offset=offset, kind="task"))["tasks"]
            for item in page:
                try:
                    t = await self.tasks.get(item["task_id"], owner)
                except TaskNotFound:
                    continue
                name = name_of(t.params)
                if name is not None and (name not in found or found[name][0] < t.created_at):
                    found[name] = (t.created_at, t.id)
            if len(page) < SCAN_PAGE:
                return {name: tid for name, (_, tid) in found.items()}
            offset += SCAN_PAGE

    async def find(self, owner: str | None, name: str) -> Task | None:
        """The task of session `name`, or None (a task deleted meanwhile leaves the registry)."""
        names = await self.names(owner)
        tid = names.get(name)
        if tid is None:
            return None
        try:
            return await self.tasks.get(tid, owner)
        except TaskNotFound:
            if names.get(name) == tid:
                del names[name]
            return None

    # --- operations ----------------------------------------------------------------------------
    async def chat(self, owner: str | None, session_id: str, prompt: str, fields: dict[str, Any]) -> Task:
        """/state: start the session's next run (create it on its first call)."""
        async with self._lock(self.tasks.owner_id(owner), session_id):
            t = await self.find(owner, session_id)
            params = tagged(fields, session_id)
            if t is None:
                t = await self.tasks.create(prompt, params, persistent=True, owner=owner)
                (await self.names(owner))[session_id] = t.id
                return t
            return await self.tasks.continue_(t.id, params, continued(prompt), owner=owner)

    async def branch(
        self, owner: str | None, session_id: str, dialogue_idx: int, prompt: str, fields: dict[str, Any]
    ) -> tuple[Task, int]:
        """/multi_state: a new node from node `dialogue_idx` (0: the zero state); (its task, its
        dialogue_idx). SessionNotFound for an unknown non-zero dialogue_idx."""
        oid = self.tasks.owner_id(owner)
        async with self._lock(oid, session_id):
            names = await self.names(owner)
            src = None
            if dialogue_idx != 0:
                src = await self.find(owner, f"{session_id}:{dialogue_idx}")
                if src is None:
                    raise SessionNotFound(f"State not found for dialogue_idx={dialogue_idx}")
            new = self._next_index(oid, session_id, names)
            params = tagged(fields, f"{session_id}:{new}")
            if src is None:
                t = await self.tasks.create(prompt, params, persistent=True, owner=owner)
            else:
                t = await self.tasks.fork(src.id, params, continued(prompt), owner=owner)
            names[f"{session_id}:{new}"] = t.id
            self._next[(oid, session_id)] = new + 1
            return t, new

    def _next_index(self, oid: str | None, session_id: str, names: dict[str, str]) -> int:
        """One more than any node of the session has had (never reused while the process runs)."""
        node = re.compile(re.escape(session_id) + r":(\d+)")
        used = max((int(m.group(1)) for n in names if (m := node.fullmatch(n))), default=0)
        return max(used + 1, self._next.get((oid, session_id), 1))

    async def delete(self, owner: str | None, session_id: str, prefix: bool) -> bool:
        """Delete the session `session_id` (and with `prefix`, every `<session_id>:*` node);
        whether `session_id` itself existed."""
        async with self._lock(self.tasks.owner_id(owner), session_id):
            names = await self.names(owner)
            doomed = [session_id] + ([n for n in names if n.startswith(session_id + ":")] if prefix else [])
            found = False
            for name in doomed:
                tid = names.pop(name, None)
                if tid is None:
                    continue
                try:
                    await self.tasks.delete(tid, owner)
                    found = found or name == session_id
                except TaskNotFound:
                    pass
            return found

    async def listing(self, owner: str | None) -> list[tuple[str, Task]]:
        """(name, task) of every session and node of `owner`, oldest first."""
        out = []
        for name in list(await self.names(owner)):
            t = await self.find(owner, name)
            if t is not None:
                out.append((name, t))
        return sorted(out, key=lambda nt: nt[1].created_at)
