"""A template name is one key's once, across replicas: a key's public `_name` and its private
`_name@<owner prefix>` never both exist (docs/task-api.md, Ownership: the private one would
shadow the public one from that key itself). Two servers of one database making the two at the
same moment: one wins, the other gets the 409 a sequential duplicate gets, and leaves nothing.
On a SQLite file and on PostgreSQL (test/pg_util.py)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.tasks import TaskConfig, TaskConflict, TaskManager
from server.tasks.records import OWNER_TAG, Task, to_row
from server.tasks.store import Store

A, B = "a" * 32, "b" * 32  # owner hashes


def claim_row(tid: str, owner: str | None, public: bool) -> dict:
    """A template's claim row, as Persistence.claim_id inserts it."""
    return {**to_row(Task(id=tid, kind="template", owner=owner, public=public)), "status": 2, "instance": "i"}


class HeldCommit(Store):
    """A store whose write transactions wait for `release` before they commit."""

    def __init__(self, db: str) -> None:
        super().__init__(db)
        self.written, self.release = asyncio.Event(), asyncio.Event()

    @asynccontextmanager
    async def write(self):
        async with super().write() as conn:
            yield conn
            self.written.set()
            await self.release.wait()


@pytest.mark.parametrize("first_public", [True, False])
async def test_a_keys_public_and_private_template_of_one_name_never_both_get_in(db_url, first_public):  # noqa: F811
    slow, other = HeldCommit(db_url), Store(db_url)
    await slow.open()
    await other.open()
    try:
        pub, priv = claim_row("_n", A, True), claim_row(f"_n@{A[:OWNER_TAG]}", A, False)
        first, second = (pub, priv) if first_public else (priv, pub)
        made = asyncio.create_task(slow.insert_new(first))
        await asyncio.wait_for(slow.written.wait(), 10)  # its row is written, not committed
        racing = asyncio.create_task(other.insert_new(second))
        await asyncio.sleep(0.5)
        assert not racing.done(), racing  # waits for the first transaction's outcome
        slow.release.set()
        assert await made is True
        with pytest.raises(TaskConflict) as err:
            await racing
        kind = "public" if first_public else "private"  # the one that exists
        assert (err.value.message, err.value.param) == (f"template '_n' already exists ({kind})", "name")
        assert await other.task_exists(first["id"]) and not await other.task_exists(second["id"])
        # per key: another key's public or private template of that name is its own
        assert await other.insert_new(claim_row("_m", B, True))
        assert await other.insert_new(claim_row(f"_m@{A[:OWNER_TAG]}", A, False))
        assert await other.insert_new(claim_row(f"_n@{B[:OWNER_TAG]}", B, False))
        assert not await other.insert_new(claim_row("_m", A, True))  # the same id: taken, as before
    finally:
        slow.release.set()
        await slow.close()
        await other.close()


async def replica(db: str, name: str) -> TaskManager:
    cfg = TaskConfig(db=db, default_max_tokens=3, lease_timeout=5.0, instance_name=name)
    tm = TaskManager(FakeEngine(), FakeTokenizer(), cfg, FakeShape())
    await tm.start()
    return tm


async def test_two_replicas_making_a_keys_public_and_private_template_at_once_have_one_winner(db_url):  # noqa: F811
    a, b = await replica(db_url, "a"), await replica(db_url, "b")
    try:
        srcs = [await m.wait((await m.create(p, persistent=True, owner="k1")).id, "k1", timeout=10)
                for m, p in ((a, "x"), (b, "y"))]
        await a.flush(), await b.flush()
        both_checked = asyncio.Barrier(2)
        for m in (a, b):  # each inserts its row only once both have found the name free
            claim = m.persistence.claim_id

            async def held(t: Task, claim=claim) -> None:
                await both_checked.wait()
                await claim(t)

            m.persistence.claim_id = held  # type: ignore[method-assign]
        res = await asyncio.gather(a.as_template(srcs[0].id, "k1", name="n", public=True),
                                   b.as_template(srcs[1].id, "k1", name="n"), return_exceptions=True)
        won = [r for r in res if isinstance(r, Task)]
        lost = [r for r in res if isinstance(r, TaskConflict)]
        assert len(won) == 1 and len(lost) == 1, res
        loser = b if res[0] is won[0] else a
        assert not [t for t in loser.table.held() if t.id.startswith("_n")]  # nothing held of its own
        # the message a sequential duplicate gets
        kind = "public" if won[0].public else "private"
        assert (lost[0].message, lost[0].param) == (f"template '_n' already exists ({kind})", "name")
        loser_src = srcs[1] if loser is b else srcs[0]
        with pytest.raises(TaskConflict) as again:
            await loser.as_template(loser_src.id, "k1", name="n", public=loser is a)
        assert again.value.message == lost[0].message
        # nothing of the loser: one row of the name, the winner's, finished; listed once
        rows = [await a.store.get_task(t) for t in ("_n", f"_n@{a.owner_id('k1')[:OWNER_TAG]}")]
        assert [r.id for r in rows if r is not None] == [won[0].id] and rows[0 if won[0].public else 1].status == 3
        for m in (a, b):
            assert (await m.get("_n", "k1")).id == won[0].id
            listed = (await m.list("k1", kind="template"))["tasks"]
            assert [t["task_id"] for t in listed] == ["_n"], listed
    finally:
        await a.close()
        await b.close()


async def test_an_upload_never_shadows_its_keys_own_public_template(tmp_path):
    """The upload route makes a key's private `_name@<owner>` through the same insert: over the
    key's own public `_name` it is the 409 as_template gives, and nothing is stored."""
    from task_fakes import counted_state

    from server.tasks.imports import template_from_state

    a = await replica(str(tmp_path / "u.db"), "a")
    try:
        src = await a.wait((await a.create("x", persistent=True, owner="k1")).id, "k1", timeout=10)
        await a.as_template(src.id, "k1", name="st", public=True)
        with pytest.raises(TaskConflict) as err:
            await template_from_state(a, "st", counted_state(3), owner="k1")
        assert (err.value.message, err.value.param) == ("template '_st' already exists (public)", "name")
        assert not await a.store.task_exists(f"_st@{a.owner_id('k1')[:OWNER_TAG]}")
        assert (await template_from_state(a, "st", counted_state(3), owner="k2")).owner == a.owner_id("k2")
    finally:
        await a.close()


@pytest.mark.parametrize("hexes", ["abcdef0123456789abcdef0123456789", "ABCDEF0123456789ABCDEF0123456789",
                                   "A" * 32, "aBcD" * 8])
def test_a_new_name_of_an_unnamed_templates_form_is_refused_in_either_case(hexes):
    """`TMPL_` and 32 hex digits is refused for a new template (upper-case hex was let through);
    a lookup of that form is a name like any other, and a near miss is no such form."""
    from server.tasks.imports import name_issue

    assert "unnamed template" in (name_issue("TMPL_" + hexes, new=True) or "")
    assert name_issue("TMPL_" + hexes) is None
    assert name_issue("TMPL_" + hexes[:31], new=True) is None and name_issue("TMPL_" + hexes + "0", new=True) is None
