"""Which task a caller's id names, and whether the caller may see or change it.

Visibility: without API keys (owner None) every task; with a key, its own tasks, plus the
templates that are public (published, or made without keys). Another key's task or private
template answers 404, exactly as an id that does not exist. A client names a private template
by its plain name (`_coder`); its key's own `_coder@<owner hash>` is found first, then a public
`_coder`.

Replicas: a copy of a finished task held in memory may be out of date once another instance
shares the database (it may have continued or deleted the task); while one does, a copy is
checked against its row's (version, status, updated_at) before it is used. A task running on
another instance can be read (its last committed progress) but not streamed or changed here.
"""

from __future__ import annotations

from server.tasks.errors import TaskConflict, TaskElsewhere, TaskForbidden, TaskNotFound
from server.tasks.lease import Lease
from server.tasks.persist import Persistence
from server.tasks.records import TEMPLATE, TMP, Task, kind_of, qualified
from server.tasks.store import Store
from server.tasks.table import TaskTable


def visible(t: Task, owner: str | None) -> bool:
    """May the key with hash `owner` (None: no keys) see t?"""
    return owner is None or t.owner == owner or (t.kind == TEMPLATE and (t.public or t.owner is None))


class Access:
    def __init__(self, table: TaskTable, store: Store, persistence: Persistence, lease: Lease) -> None:
        self.table, self.store, self.persistence, self.lease = table, store, persistence, lease

    async def get(
        self, task_id: str, owner: str | None, *, write: bool = False, force: bool = False, stream: bool = False
    ) -> Task:
        """TaskManager.get, for an owner hash."""
        t = await self.lookup(task_id, owner)
        if t is None:
            raise TaskNotFound(f"task {task_id!r} not found", param="task_id")
        if write and owner is not None and t.owner != owner:  # a public template of another key
            raise TaskForbidden(
                f"template {t.display_id!r} {'belongs to another API key' if t.owner else 'is public (read-only)'}"
            )
        if write and t.kind == TEMPLATE and not force:
            raise TaskForbidden(f"{t.display_id!r} is a template (read-only); pass force=true to change it")
        if (write or stream) and self.elsewhere(t):
            what = "stream" if stream else "continue, stop or delete"
            raise TaskElsewhere(t.display_id, t.instance, self.lease.url_of(t.instance), what)
        return t

    async def lookup(self, task_id: str, owner: str | None) -> Task | None:
        """The task a caller's id names and the caller may see (None: none)."""
        for cand in (qualified(task_id, owner), task_id):
            if cand is None:
                continue
            t = await self.find(cand)
            if t is not None and not t.deleted and visible(t, owner):
                return t
        return None

    async def find(self, task_id: str) -> Task | None:
        """The task with this (stored) id, from memory when the copy there is current."""
        t = self.table.find(task_id)
        if t is not None:
            if task_id in self.table.live or not self.lease.shared:
                return t
            head = await self.store.task_head(task_id)
            mine = (t.version, t.status, t.updated_at, t.stored_id)
            if head is not None and (head.version, head.status, head.updated_at, head.state_id) == mine:
                return t  # (a state written behind the row since this copy was read: read again)
            self.table.forget(task_id)
            if head is None:
                return None
        if kind_of(task_id) == TMP:
            return None
        return await self.persistence.load_task(task_id)

    def finished(self, src: Task, what: str) -> None:
        """TaskConflict (TaskElsewhere when it runs on another instance) unless `src` has
        finished; `what`: the operation, for the message."""
        if not src.running:
            return
        if self.elsewhere(src):
            raise TaskElsewhere(src.display_id, src.instance, self.lease.url_of(src.instance), what)
        raise TaskConflict(f"task {src.display_id} is running; {what} it once it has finished")

    def elsewhere(self, t: Task) -> bool:
        """t runs, but not here (another instance, or one that died and is not reaped yet)."""
        return t.running and t.id not in self.table.live and t.instance != self.lease.instance
