"""The conversations' rows (server/tasks/conversations.py) on a SQLite file and on a fresh
PostgreSQL database (pg_util; that half skips without PostgreSQL or asyncpg): items in order,
pages, owners, the head a finished run becomes (or not, when the conversation moved since its
base), a deleted item dropping the head, refusals that write nothing, and two stores writing at
once (two replicas): appends numbered without a gap or a repeat, runs begun together of which
one is recorded (one response at a time)."""

from __future__ import annotations

import asyncio

import pytest

from server.tasks.conversations import (
    ConversationLocked,
    ConversationNotFound,
    Conversations,
    ItemIdTaken,
    ItemNotFound,
    Run,
)
from server.tasks.store import Store

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures


def msg(i: int | str) -> dict:
    return {"type": "message", "id": f"msg_{i}", "role": "user", "content": [{"type": "input_text", "text": str(i)}],
            "status": "completed"}  # fmt: skip


async def opened(db: str) -> tuple[Store, Conversations]:
    s = Store(db)
    await s.open()
    return s, Conversations(s)


async def test_items_pages_owners_and_refusals(db_url):
    store, cs = await opened(db_url)
    try:
        c = await cs.create("o1", {"k": "v"}, [msg(1), msg(2)])
        assert (c.owner, c.metadata, c.last_seq, c.head_task) == ("o1", {"k": "v"}, 2, None)
        added = await cs.add(c.id, "o1", [msg(3), msg(4), msg(5)])
        assert [a.seq for a in added] == [3, 4, 5]
        page, more = await cs.items(c.id, "o1", order="desc", limit=2)
        assert [p.id for p in page] == ["msg_5", "msg_4"] and more
        page, more = await cs.items(c.id, "o1", order="desc", limit=2, after="msg_4")
        assert [p.id for p in page] == ["msg_3", "msg_2"] and more
        page, more = await cs.items(c.id, "o1", order="asc", after="msg_3")
        assert [p.id for p in page] == ["msg_4", "msg_5"] and not more
        assert (await cs.item(c.id, "o1", "msg_2")).body == msg(2)
        with pytest.raises(ConversationNotFound):  # another owner's
            await cs.items(c.id, "o2")
        with pytest.raises(ItemNotFound):
            await cs.items(c.id, "o1", after="msg_9")
        with pytest.raises(ItemIdTaken) as ei:  # one taken id refuses the whole add
            await cs.add(c.id, "o1", [msg(6), msg(2)])
        assert ei.value.index == 1
        with pytest.raises(ItemIdTaken):
            await cs.add(c.id, "o1", [msg(7), msg(7)])
        assert [p.id for p in (await cs.items(c.id, "o1"))[0]] == [f"msg_{i}" for i in range(1, 6)]
        await cs.delete(c.id, "o1")
        with pytest.raises(ConversationNotFound):
            await cs.get(c.id, "o1")
    finally:
        await store.close()


async def test_a_finished_run_joins_and_becomes_the_head_unless_the_base_moved(db_url):
    store, cs = await opened(db_url)
    try:
        c = await cs.create(None, {}, [msg(1)])
        await cs.begin_run(c, "TASK_a", 0, None)
        run = (await cs.runs(c.id))[0]
        assert run == Run("TASK_a", 1, 0, 0, None)
        assert await cs.finish_run(c.id, run, [msg("a_in"), msg("a_out")], tokens=40)
        assert not await cs.finish_run(c.id, run, [msg("again")])  # finished once only
        c = await cs.get(c.id, None)
        assert (c.last_seq, c.head_task, c.head_seq, c.head_tokens) == (3, "TASK_a", 3, 40)
        # a run started on this conversation, then an item added before it ended: it joins after
        # that item, and is no head (its state does not hold the item)
        await cs.begin_run(c, "TASK_b", 0, None)
        await cs.add(c.id, None, [msg(4)])
        assert await cs.finish_run(c.id, (await cs.runs(c.id))[0], [msg("b_out")], tokens=50)
        c = await cs.get(c.id, None)
        assert (c.last_seq, c.head_task, c.head_seq) == (5, "TASK_a", 3)
        assert [p.id for p in (await cs.items(c.id, None))[0]][-2:] == ["msg_4", "msg_b_out"]
        # an item after the head goes: the head stands; one it holds goes: the head goes
        await cs.delete_item(c.id, None, "msg_4")
        assert (await cs.get(c.id, None)).head_task == "TASK_a"
        c = await cs.delete_item(c.id, None, "msg_a_in")
        assert (c.head_task, c.cuts) == (None, 2)
        # a run whose base saw a deletion since is no head either
        await cs.begin_run(c, "TASK_c", 0, None)
        await cs.delete_item(c.id, None, "msg_1")
        assert await cs.finish_run(c.id, (await cs.runs(c.id))[0], [msg("c_out")])
        assert (await cs.get(c.id, None)).head_task is None
        # a run that adds nothing (cancelled, failed) leaves the conversation as it was
        c = await cs.get(c.id, None)
        await cs.begin_run(c, "TASK_d", 0, None)
        assert await cs.finish_run(c.id, (await cs.runs(c.id))[0], None)
        assert (await cs.get(c.id, None)).last_seq == c.last_seq and await cs.runs(c.id) == []
    finally:
        await store.close()


async def test_a_run_item_whose_id_is_taken_joins_under_a_new_id(db_url):
    store, cs = await opened(db_url)
    try:
        c = await cs.create(None, {}, [msg(1)])
        await cs.begin_run(c, "TASK_a", 0, None)
        assert await cs.finish_run(c.id, (await cs.runs(c.id))[0], [msg(1), msg(2)])
        ids = [p.id for p in (await cs.items(c.id, None))[0]]
        assert ids[0] == "msg_1" and ids[1].startswith("msg_") and ids[1] != "msg_1" and ids[2] == "msg_2"
    finally:
        await store.close()


async def test_two_stores_appending_at_once_number_every_item_once(db_url):
    s1, cs1 = await opened(db_url)
    s2, cs2 = await opened(db_url)
    try:
        c = await cs1.create(None, {}, [])
        adds = [(cs1 if i % 2 else cs2).add(c.id, None, [msg(f"{i}_{j}") for j in range(3)]) for i in range(10)]
        await asyncio.gather(*adds)
        rows, _ = await cs1.items(c.id, None)
        assert [r.seq for r in rows] == list(range(1, 31))
        for i in range(10):  # each add's items together, in its order
            seqs = [r.seq for r in rows if r.id.startswith(f"msg_{i}_")]
            assert seqs == list(range(seqs[0], seqs[0] + 3))
    finally:
        await s1.close()
        await s2.close()


async def test_one_run_at_a_time_even_when_two_stores_begin_at_once(db_url):
    """A response at a time on a conversation (OpenAI's conversation_locked): two replicas begin
    runs at once, the row locked first: one records its run, the other is refused and records
    nothing; once the run is finished the next may begin. (Two runs of one base used to be
    recorded, each joining in turn: the second's items after the first's, though its state had
    never seen them.)"""
    s1, cs1 = await opened(db_url)
    s2, cs2 = await opened(db_url)
    try:
        for _ in range(8):
            c = await cs1.create(None, {}, [msg("base")])
            got = await asyncio.gather(cs1.begin_run(c, "TASK_a", 0, None), cs2.begin_run(c, "TASK_b", 0, None),
                                       return_exceptions=True)
            won = [r for r in got if isinstance(r, Run)]
            lost = [r for r in got if isinstance(r, ConversationLocked)]
            assert len(won) == 1 and len(lost) == 1, got
            assert lost[0].task_id == won[0].task_id and await cs1.runs(c.id) == won
            with pytest.raises(ConversationLocked):
                await cs2.begin_run(c, "TASK_c", 0, None)
            assert await cs2.finish_run(c.id, won[0], [msg(f"{c.id}_in"), msg(f"{c.id}_out")], 10)
            c = await cs1.get(c.id, None)
            assert (c.last_seq, c.head_task, c.head_seq, c.head_tokens) == (3, won[0].task_id, 3, 10)
            assert await cs2.begin_run(c, "TASK_c", 0, None) == Run("TASK_c", 3, 0, 0, None)
    finally:
        await s1.close()
        await s2.close()
