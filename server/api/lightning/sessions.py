"""rwkv_lightning's state sessions as persistent tasks of the TaskManager.

A session (`/state/chat/completions`, name `<session_id>`) is one persistent task: its first call
creates it from the zero state, every later call continues it (the task layer feeds only the new
prompt after the state it stored). A branching session (`/multi_state/chat/completions`) is a tree
of tasks: node `<session_id>:<n>` is a task made from the zero state (dialogue_idx 0) or forked
from node `<session_id>:<dialogue_idx>` (the source is untouched, so continuing one node twice
makes two branches). States, restarts, eviction and ownership are the task layer's: a session
lives under the API key that made it and survives restarts.

The registry (API key, name) -> task is the tasks' own tag column (Task.tag = TAG + name, set
when the task is made, indexed with the owner): one database read finds a session, on any
replica, after any restart. The database keeps one task per name and key (a unique index): a
replica that makes a session or node another made meanwhile is refused (TaskTagTaken), and goes
on with that session, or takes the next node number.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from server.tasks.errors import TaskNotFound, TaskTagTaken
from server.tasks.schema import TAG_LEN

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

TAG = "lightning session "
"""Task.tag of a session task: TAG + its name (server.tasks.schema.TAG_LEN bounds it)."""
MAX_NAME = 200
"""Longest session name, not counting the `:<n>` suffixes of a dialogue node's name (node n of
session s is `s:<n>`; a node's name used as a /multi_state session_id nests them): so a node's
name is as usable as the session_id it was made from."""
MAX_FULL_NAME = TAG_LEN - len(TAG)
"""Longest name in all, suffixes included (its tag fits the tag column): a node whose name would
be longer is not made (NameTooLong); one level of nodes of any name always fits."""
_SUFFIXES = re.compile(r"(?::[0-9]+)+\Z")
MAX_NUMBER_TRIES = 16
"""Node numbers a branch tries while other replicas take them at the same moment."""
DELETED_MARKS = 4096
"""Task ids of the latest session deletions kept (Sessions.deleted: a call cut by a deletion)."""


class SessionNotFound(Exception):
    """The named session (or dialogue node) does not exist for this key."""


class NameTooLong(Exception):
    """A session name, or the name a new dialogue node would get, is too long (name_problem)."""


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a session (too long, or a NUL in it), or None. Every node name a
    /multi_state call makes passes (it is made only when it does)."""
    n = len(name)
    if n > MAX_FULL_NAME or len(_SUFFIXES.sub("", name)) > MAX_NAME:  # (the regex: only on short names)
        return f"session_id has {n} characters; at most {MAX_NAME}, not counting a dialogue node's ':<n>' suffixes"
    if "\x00" in name:
        return "session_id must not contain the NUL character"
    return None


def name_of(t: Task) -> str | None:
    """The session name of a task, or None (not a session task)."""
    return t.tag[len(TAG) :] if t.tag is not None and t.tag.startswith(TAG) else None


def continued(prompt: str) -> str:
    """lightning's rule for a prompt that continues a state: it starts with a blank line."""
    return prompt if not prompt or prompt.startswith("\n\n") else "\n\n" + prompt


class Sessions:
    """The session registry of one TaskManager, and the session operations on it."""

    _of: ClassVar[weakref.WeakKeyDictionary[TaskManager, Sessions]] = weakref.WeakKeyDictionary()

    def __init__(self, tasks: TaskManager) -> None:
        # weakly: `_of`'s value must not reach its key, or no task manager is ever freed
        self._tasks = weakref.ref(tasks)
        self._next: dict[tuple[str | None, str], int] = {}  # (owner id, session id) -> next dialogue_idx
        self._locks: weakref.WeakValueDictionary[tuple[Any, ...], asyncio.Lock] = weakref.WeakValueDictionary()
        self._deleted: dict[str, None] = {}  # task ids delete() deleted (or is deleting), oldest first

    @property
    def tasks(self) -> TaskManager:
        tasks = self._tasks()
        if tasks is None:  # (only a Sessions kept past its server's task manager)
            raise RuntimeError("the task manager of these sessions is gone")
        return tasks

    @classmethod
    def of(cls, tasks: TaskManager) -> Sessions:
        """The sessions of this task manager (one object per manager, made on first use)."""
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
    async def _newest(self, owner: str | None, found: list[tuple[str, str]]) -> Task | None:
        """The newest task of `found` (tag, id; oldest first) that still exists."""
        for _, tid in reversed(found):
            try:
                return await self.tasks.get(tid, owner)
            except TaskNotFound:  # deleted since the read
                continue
        return None

    async def find(self, owner: str | None, name: str) -> Task | None:
        """The task of session `name`, or None."""
        return await self._newest(owner, await self.tasks.tagged(owner, TAG + name))

    # --- operations ----------------------------------------------------------------------------
    async def chat(self, owner: str | None, session_id: str, prompt: str, fields: dict[str, Any]) -> Task:
        """/state: start the session's next run (create it on its first call)."""
        async with self._lock(self.tasks.owner_id(owner), session_id):
            t = await self.find(owner, session_id)
            if t is None:
                try:
                    return await self.tasks.create(prompt, fields, persistent=True, owner=owner, tag=TAG + session_id)
                except TaskTagTaken:  # another replica made it meanwhile: this call continues it
                    t = await self.find(owner, session_id)
                    if t is None:
                        raise
            return await self.tasks.continue_(t.id, fields, continued(prompt), owner=owner)

    async def branch(
        self, owner: str | None, session_id: str, dialogue_idx: int, prompt: str, fields: dict[str, Any]
    ) -> tuple[Task, int]:
        """/multi_state: a new node from node `dialogue_idx` (0: the zero state); (its task, its
        dialogue_idx). SessionNotFound for an unknown non-zero dialogue_idx."""
        oid = self.tasks.owner_id(owner)
        async with self._lock(oid, session_id):
            src = None
            if dialogue_idx != 0:
                src = await self.find(owner, f"{session_id}:{dialogue_idx}")
                if src is None:
                    raise SessionNotFound(f"State not found for dialogue_idx={dialogue_idx}")
            for _ in range(MAX_NUMBER_TRIES):
                new = await self._next_index(owner, oid, session_id)
                if len(f"{session_id}:{new}") > MAX_FULL_NAME:  # (only names nested deeply)
                    n = len(session_id) + 1 + len(str(new))
                    raise NameTooLong(
                        f"the name of node {new} of this session_id would have {n} characters; at most {MAX_FULL_NAME}"
                    )
                tag = f"{TAG}{session_id}:{new}"
                try:
                    if src is None:
                        t = await self.tasks.create(prompt, fields, persistent=True, owner=owner, tag=tag)
                    else:
                        t = await self.tasks.fork(src.id, fields, continued(prompt), owner=owner, tag=tag)
                except TaskTagTaken:  # another replica made node `new` meanwhile: the next number
                    self._next[(oid, session_id)] = new + 1
                    continue
                self._next[(oid, session_id)] = new + 1
                return t, new
            raise TaskTagTaken(f"no free node number of session {session_id!r} after {MAX_NUMBER_TRIES} tries")

    async def _next_index(self, owner: str | None, oid: str | None, session_id: str) -> int:
        """One more than any stored node of the session (and than any node this process made:
        a deleted node's index is not reused while it runs)."""
        nodes = await self.tasks.tagged(owner, f"{TAG}{session_id}:", prefix=True)
        n = len(TAG) + len(session_id) + 1
        used = max((int(tag[n:]) for tag, _ in nodes if re.fullmatch(r"\d+", tag[n:])), default=0)
        return max(used + 1, self._next.get((oid, session_id), 1))

    async def delete(self, owner: str | None, session_id: str, prefix: bool) -> bool:
        """Delete the session `session_id` (and with `prefix`, every `<session_id>:*` node);
        whether `session_id` itself existed."""
        async with self._lock(self.tasks.owner_id(owner), session_id):
            doomed = await self.tasks.tagged(owner, TAG + session_id)
            if prefix:
                doomed += await self.tasks.tagged(owner, f"{TAG}{session_id}:", prefix=True)
            found = False
            for tag, tid in doomed:
                self._mark_deleted(tid)  # before the delete stops its run: its call reads it then
                try:
                    await self.tasks.delete(tid, owner)
                    found = found or tag == TAG + session_id
                except TaskNotFound:
                    pass
                except BaseException:  # not deleted
                    self._deleted.pop(tid, None)
                    raise
            return found

    def _mark_deleted(self, tid: str) -> None:
        self._deleted[tid] = None
        if len(self._deleted) > DELETED_MARKS:
            del self._deleted[next(iter(self._deleted))]

    def deleted(self, t: Task) -> bool:
        """Whether t (a session's task) was deleted, or is being deleted by delete(): a call whose
        run ended `stopped` was cut by the deletion then. (Also a deletion through the task API,
        once it marked the task.)"""
        return t.deleted or t.id in self._deleted

    async def listing(self, owner: str | None) -> list[tuple[str, Task]]:
        """(name, task) of every session and node of `owner`, oldest first."""
        newest: dict[str, list[tuple[str, str]]] = {}
        for tag, tid in await self.tasks.tagged(owner, TAG, prefix=True):
            newest.setdefault(tag[len(TAG) :], []).append((tag, tid))
        out = []
        for name, found in newest.items():
            t = await self._newest(owner, found)
            if t is not None:
                out.append((name, t))
        return sorted(out, key=lambda nt: nt[1].created_at)
