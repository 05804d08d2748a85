"""Conversations in the task database (schema v7): OpenAI's conversation objects, their items in
order, and the responses made in them whose items have not joined yet. Plain rows: what an item
means (a message, a call) is the Responses routes' business (server/api/responses/conversation.py).

A conversation's `head` is the response task whose state holds its items up to `head_seq`: the
next response forks it and prefills only the items after that, instead of the whole history. An
item deleted at or before head_seq drops the head (the state holds it); items added after it
leave it standing. A response made in the conversation is recorded as a run (its base: the
conversation's last_seq and cuts when it started); once it has ended, `finish_run` appends its
input and output items in one transaction and makes it the head when nothing changed since its
base (a run whose base moved joins without becoming the head). A run is finished by whoever
reads the conversation next, so a crash between a response's end and its items joining loses
nothing: the run row is still there, and the response's task in the database.

Every write is one transaction that locks the conversation's row first (`_lock`: SELECT ... FOR
UPDATE on PostgreSQL; SQLite's write transactions are serial anyway), then reads what it checks
(the base of a run, the ids taken, the count): replicas writing one conversation at once take
turns, and none decides on a read another has since changed.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.conversation_data import (
    Conversation,
    ConversationFull,
    ConversationLocked,
    ConversationNotFound,
    ItemIdTaken,
    ItemNotFound,
    Run,
    StoredItem,
)
from server.tasks.database import Database
from server.tasks.schema import DbRow, conversation_items, conversation_runs, conversations

MAX_ITEMS = 100_000
"""Items one conversation may hold (beyond it an add is refused: ConversationFull)."""

_C, _I, _R = conversations.c, conversation_items.c, conversation_runs.c


def new_id() -> str:
    return "conv_" + uuid.uuid4().hex + uuid.uuid4().hex[:16]


def _conversation(row: DbRow) -> Conversation:
    return Conversation(row.id, row.owner, orjson.loads(row.metadata), row.created_at, row.last_seq, row.cuts,
                        row.head_task, row.head_seq, row.head_tokens)  # fmt: skip


def _dump(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class Conversations:
    """The conversation queries over the task database (`owner`: the owner id as tasks keep it,
    TaskManager.owner_id; another owner's conversation is not found)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, owner: str | None, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        """A new conversation holding `items` (each with its `id`)."""
        cid, now = new_id(), time.time()
        async with self.db.write() as conn:
            await conn.execute(conversations.insert().values(
                id=cid, owner=owner, metadata=_dump(metadata), created_at=now, last_seq=0, cuts=0, head_task=None,
                head_seq=0, head_tokens=0))  # fmt: skip
            await self._append(conn, cid, items, fresh_ids=False)
            return await self._row(conn, cid, owner)

    async def get(self, cid: str, owner: str | None) -> Conversation:
        async with self.db.read() as conn:
            return await self._row(conn, cid, owner)

    async def update(self, cid: str, owner: str | None, metadata: dict[str, str]) -> Conversation:
        async with self.db.write() as conn:
            await self._row(conn, cid, owner, lock=True)
            await conn.execute(conversations.update().where(_C.id == cid).values(metadata=_dump(metadata)))
            return await self._row(conn, cid, owner)

    async def delete(self, cid: str, owner: str | None) -> None:
        """The conversation, its items and its runs (the responses stay, as stored responses)."""
        async with self.db.write() as conn:
            await self._row(conn, cid, owner, lock=True)
            for table, col in ((conversation_items, _I.conversation_id), (conversation_runs, _R.conversation_id)):
                await conn.execute(table.delete().where(col == cid))
            await conn.execute(conversations.delete().where(_C.id == cid))

    async def add(self, cid: str, owner: str | None, items: list[dict[str, Any]]) -> list[StoredItem]:
        """Append `items` (each with its `id`): ItemIdTaken when one's id is taken."""
        async with self.db.write() as conn:
            await self._row(conn, cid, owner, lock=True)
            return await self._append(conn, cid, items, fresh_ids=False)

    async def items(
        self, cid: str, owner: str | None, *, order: Literal["asc", "desc"] = "asc", after: str | None = None,
        limit: int | None = None, since_seq: int = 0, until_seq: int | None = None,
    ) -> tuple[list[StoredItem], bool]:  # fmt: skip
        """(a page of the items, whether more follow): in `order`, after the item `after`
        (ItemNotFound: none of that id), those in (since_seq, until_seq] only."""
        async with self.db.read() as conn:
            await self._row(conn, cid, owner)
            q = sa.select(_I.seq, _I.item_id, _I.body).where(_I.conversation_id == cid, _I.seq > since_seq)
            if until_seq is not None:
                q = q.where(_I.seq <= until_seq)
            if after is not None:
                at = await self._seq(conn, cid, after)
                q = q.where(_I.seq > at if order == "asc" else _I.seq < at)
            q = q.order_by(_I.seq if order == "asc" else _I.seq.desc())
            if limit is not None:
                q = q.limit(limit + 1)
            rows = (await conn.execute(q)).fetchall()
        found = [StoredItem(r.seq, r.item_id, orjson.loads(r.body)) for r in rows]
        more = limit is not None and len(found) > limit
        return (found[:limit] if more else found), more

    async def item(self, cid: str, owner: str | None, item_id: str) -> StoredItem:
        async with self.db.read() as conn:
            await self._row(conn, cid, owner)
            q = sa.select(_I.seq, _I.body).where(_I.conversation_id == cid, _I.item_id == item_id)
            row = (await conn.execute(q)).first()
        if row is None:
            raise ItemNotFound(item_id)
        return StoredItem(row.seq, item_id, orjson.loads(row.body))

    async def delete_item(self, cid: str, owner: str | None, item_id: str) -> Conversation:
        """Delete one item; the head goes when its state holds the item."""
        async with self.db.write() as conn:
            await self._row(conn, cid, owner, lock=True)
            seq = await self._seq(conn, cid, item_id)
            await conn.execute(conversation_items.delete().where(_I.conversation_id == cid, _I.seq == seq))
            await conn.execute(conversations.update().where(_C.id == cid).values(cuts=_C.cuts + 1))
            await conn.execute(
                conversations.update().where(_C.id == cid, _C.head_seq >= seq).values(head_task=None, head_seq=0)
            )
            return await self._row(conn, cid, owner)

    # --- runs: the responses made in a conversation ------------------------------------------------
    async def begin_run(self, c: Conversation, task_id: str, task_version: int, instance: str | None) -> Run:
        """Record a response started on `c` as it was read (its base: c.last_seq, c.cuts), its
        task at `task_version` (a later run of the task, a continue, moves it), by `instance`.
        ConversationLocked while another run is recorded (one response at a time: replicas too,
        the row locked first)."""
        async with self.db.write() as conn:
            if await self._lock(conn, c.id) is None:  # deleted meanwhile: nothing to join
                raise ConversationNotFound(c.id)
            other = (await conn.execute(sa.select(_R.task_id).where(_R.conversation_id == c.id).limit(1))).scalar()
            if other is not None:
                raise ConversationLocked(other)
            await conn.execute(conversation_runs.insert().values(
                conversation_id=c.id, task_id=task_id, base_seq=c.last_seq, base_cuts=c.cuts,
                task_version=task_version, instance=instance, created_at=time.time()))  # fmt: skip
        return Run(task_id, c.last_seq, c.cuts, task_version, instance)

    async def taken(self, cid: str, ids: list[str]) -> set[str]:
        """Those of `ids` that are ids of the conversation's items."""
        if not ids:
            return set()
        async with self.db.read() as conn:
            q = sa.select(_I.item_id).where(_I.conversation_id == cid, _I.item_id.in_(set(ids)))
            return {r[0] for r in (await conn.execute(q)).fetchall()}

    async def runs(self, cid: str) -> list[Run]:
        async with self.db.read() as conn:
            return await self._runs(conn, cid)

    async def with_runs(self, cid: str, owner: str | None) -> tuple[Conversation, list[Run]]:
        """The conversation and its runs, in one read: the runs first, so a join that finished a
        run before this read is in the conversation read after it."""
        async with self.db.read() as conn:
            runs = await self._runs(conn, cid)
            return await self._row(conn, cid, owner), runs

    @staticmethod
    async def _runs(conn: AsyncConnection, cid: str) -> list[Run]:
        q = sa.select(_R.task_id, _R.base_seq, _R.base_cuts, _R.task_version, _R.instance)
        rows = (await conn.execute(q.where(_R.conversation_id == cid).order_by(_R.created_at))).fetchall()
        return [Run(r.task_id, r.base_seq, r.base_cuts, r.task_version, r.instance) for r in rows]

    async def finish_run(self, cid: str, run: Run, items: list[dict[str, Any]] | None, tokens: int = 0) -> bool:
        """The run ended: its `items` join the conversation (None: none do), and it becomes the
        head (its history `tokens` long) when the conversation did not change since its base.
        False (nothing written): another
        reader finished it first, or the conversation is gone."""
        async with self.db.write() as conn:
            row = await self._lock(conn, cid)
            if row is None:
                return False
            gone = conversation_runs.delete().where(_R.conversation_id == cid, _R.task_id == run.task_id)
            if (await conn.execute(gone)).rowcount != 1:
                return False
            if items is None:
                return True
            await self._append(conn, cid, items, fresh_ids=True)
            if (row.last_seq, row.cuts) == (run.base_seq, run.base_cuts):
                last = row.last_seq + len(items)
                await conn.execute(conversations.update().where(_C.id == cid).values(
                    head_task=run.task_id, head_seq=last, head_tokens=tokens))  # fmt: skip
            return True

    async def drop_head(self, cid: str, task_id: str) -> None:
        """The head's task is gone (its response deleted): the next response prefills the history."""
        async with self.db.write() as conn:
            q = conversations.update().where(_C.id == cid, _C.head_task == task_id)
            await conn.execute(q.values(head_task=None, head_seq=0))

    # --- helpers -----------------------------------------------------------------------------------
    async def _row(self, conn: AsyncConnection, cid: str, owner: str | None, *, lock: bool = False) -> Conversation:
        """The conversation `owner` may see (ConversationNotFound otherwise); `lock`: its row held
        until the transaction ends (a write's first statement)."""
        row = (
            await self._lock(conn, cid)
            if lock
            else (await conn.execute(sa.select(conversations).where(_C.id == cid))).first()
        )
        if row is None or row.owner != owner:
            raise ConversationNotFound(cid)
        return _conversation(row)

    @staticmethod
    async def _lock(conn: AsyncConnection, cid: str) -> DbRow | None:
        """The conversation's row, held until the transaction ends (None: no such row)."""
        return (await conn.execute(sa.select(conversations).where(_C.id == cid).with_for_update())).first()

    async def _seq(self, conn: AsyncConnection, cid: str, item_id: str) -> int:
        q = sa.select(_I.seq).where(_I.conversation_id == cid, _I.item_id == item_id)
        seq = (await conn.execute(q)).scalar()
        if seq is None:
            raise ItemNotFound(item_id)
        return int(seq)

    async def _append(
        self, conn: AsyncConnection, cid: str, items: list[dict[str, Any]], *, fresh_ids: bool
    ) -> list[StoredItem]:
        """Insert `items` after the last (the caller holds the row: `_lock`); an id taken (in the
        conversation or twice here): ItemIdTaken, or with `fresh_ids` a new id for that item (a
        response's items join whole)."""
        if not items:
            return []
        ids = [str(it["id"]) for it in items]
        q = sa.select(_I.item_id).where(_I.conversation_id == cid, _I.item_id.in_(set(ids)))
        taken = {r[0] for r in (await conn.execute(q)).fetchall()}
        out: list[dict[str, Any]] = []
        for i, (iid, it) in enumerate(zip(ids, items)):
            if iid in taken:
                if not fresh_ids:
                    raise ItemIdTaken(i, iid)
                iid = f"{iid.split('_', 1)[0][:16]}_{uuid.uuid4().hex}"  # (fits ITEM_ID_LEN)
                it = {**it, "id": iid}
            taken.add(iid)
            out.append(it)
        if not fresh_ids and await self._count(conn, cid) + len(out) > MAX_ITEMS:
            raise ConversationFull(cid)
        await conn.execute(conversations.update().where(_C.id == cid).values(last_seq=_C.last_seq + len(out)))
        last = (await conn.execute(sa.select(_C.last_seq).where(_C.id == cid))).scalar_one()
        first = last - len(out) + 1
        stored = [StoredItem(first + i, it["id"], it) for i, it in enumerate(out)]
        await conn.execute(
            conversation_items.insert(),
            [{"conversation_id": cid, "seq": s.seq, "item_id": s.id, "body": _dump(s.body)} for s in stored],
        )
        return stored

    async def _count(self, conn: AsyncConnection, cid: str) -> int:
        q = sa.select(sa.func.count()).select_from(conversation_items).where(_I.conversation_id == cid)
        return int((await conn.execute(q)).scalar_one())
