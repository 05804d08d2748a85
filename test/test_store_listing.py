"""Store.list_tasks with API keys, on SQLite and PostgreSQL (test/pg_util.py; PostgreSQL skipped
without it): a key's private template shadows a public one of the same name, so the key's
listing leaves the public one out, with counts and pages to match."""

from __future__ import annotations

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from test_store import open_store

from server.tasks.records import Task, new_id, to_row

K1, K2 = "1" * 64, "2" * 64  # owner hashes
T0 = 1_700_000_000.0


def template(name: str | None, owner: str, public: bool, age: int) -> Task:
    """A stored template `_name` (public) or `_name@<owner prefix>` (private), `age` seconds old."""
    tid = new_id("template", name, None if public else owner)
    return Task(id=tid, kind="template", owner=owner, public=public, created_at=T0 - age, updated_at=T0 - age)


async def test_a_private_template_shadows_a_public_one_of_its_name(db_url):  # noqa: F811 - the fixture
    store = await open_store(db_url)
    made = [
        template("pubt", K1, True, 1),  # shadowed for K2 by K2's own "pubt"
        template("pubt", K2, False, 2),
        template("other", K1, True, 3),  # public, not shadowed
        template("pubt", K1, False, 4),  # K1's private one: no business of K2's
        Task(id="TASK_k2", kind="task", owner=K2, created_at=T0 - 5, updated_at=T0 - 5),
    ]
    for t in made:
        await store.save(to_row(t))
    try:
        rows, total = await store.list_tasks(K2, False, "template", 100, 0)
        assert [r.id for r in rows] == ["_pubt@" + K2[:12], "_other"] and total == 2
        rows, total = await store.list_tasks(K2, False, None, 100, 0)
        assert [r.id for r in rows] == ["_pubt@" + K2[:12], "_other", "TASK_k2"] and total == 3
        pages = [(await store.list_tasks(K2, False, None, 1, i))[0] for i in range(4)]
        assert [[r.id for r in p] for p in pages] == [["_pubt@" + K2[:12]], ["_other"], ["TASK_k2"], []]
        rows, total = await store.list_tasks(K1, False, "template", 100, 0)
        assert [r.id for r in rows] == ["_other", "_pubt@" + K1[:12]] and total == 2  # K1's own public _pubt too
        rows, total = await store.list_tasks(None, True, "template", 100, 0)
        assert total == 4  # all owners (no keys): every row
        assert await store.shadowed(K2, ["_pubt", "_other"]) == {"_pubt"}
        assert await store.shadowed("3" * 64, ["_pubt", "_other"]) == set()
    finally:
        await store.close()
