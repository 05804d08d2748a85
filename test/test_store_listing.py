"""Listing.list_tasks with API keys, on SQLite and PostgreSQL (test/pg_util.py; PostgreSQL skipped
without it): a key's private template shadows a public one of the same name, so the key's
listing leaves the public one out, with counts and pages to match."""

from __future__ import annotations

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from test_store import open_store

from server.tasks.inventory import PREVIEW_CHARS, preview
from server.tasks.listing import Listing
from server.tasks.records import Task, new_id, to_row

K1, K2 = "1" * 64, "2" * 64  # owner hashes
T0 = 1_700_000_000.0


def template(name: str | None, owner: str, public: bool, age: int) -> Task:
    """A stored template `_name` (public) or `_name@<owner prefix>` (private), `age` seconds old."""
    tid = new_id("template", name, None if public else owner)
    return Task(id=tid, kind="template", owner=owner, public=public, created_at=T0 - age, updated_at=T0 - age)


async def test_a_private_template_shadows_a_public_one_of_its_name(db_url):  # noqa: F811 - the fixture
    store = await open_store(db_url)
    listing = Listing(store)
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
        rows, total = await listing.list_tasks(K2, False, "template", 100, 0)
        assert [r.id for r in rows] == ["_pubt@" + K2[:12], "_other"] and total == 2
        rows, total = await listing.list_tasks(K2, False, None, 100, 0)
        assert [r.id for r in rows] == ["_pubt@" + K2[:12], "_other", "TASK_k2"] and total == 3
        pages = [(await listing.list_tasks(K2, False, None, 1, i))[0] for i in range(4)]
        assert [[r.id for r in p] for p in pages] == [["_pubt@" + K2[:12]], ["_other"], ["TASK_k2"], []]
        rows, total = await listing.list_tasks(K1, False, "template", 100, 0)
        assert [r.id for r in rows] == ["_other", "_pubt@" + K1[:12]] and total == 2  # K1's own public _pubt too
        rows, total = await listing.list_tasks(None, True, "template", 100, 0)
        assert total == 4  # all owners (no keys): every row
        assert await listing.shadowed(K2, ["_pubt", "_other"]) == {"_pubt"}
        assert await listing.shadowed("3" * 64, ["_pubt", "_other"]) == set()
    finally:
        await store.close()


def task(tid: str, prompt: str, age: int, owner: str | None = None, kind: str = "task", public: bool = False) -> Task:
    return Task(id=tid, kind=kind, owner=owner, public=public, prompt=prompt,
                created_at=T0 - age, updated_at=T0 - age)


async def test_prompt_search_and_prompt_heads(db_url):  # noqa: F811 - the fixture
    """prompt_contains: a substring of the prompt, ASCII letters of either case alike, its `%`, `_`
    and quotes taken as text, with the owner, kind and paging rules as without it; prompts holding
    NUL or starting with U+FFFF (escaped on PostgreSQL) are found by what they hold, no more; each
    row's prompt_head gives the prompt's preview (the Inventory's), escapes and NULs as they were."""
    store = await open_store(db_url)
    listing = Listing(store)
    long = "Ünïcode start – " + "x" * 300
    made = [
        task("TASK_pct", "100% sure", 1, K1),
        task("TASK_num", "1000 sure", 2, K1),
        task("TASK_und", "a_b", 3, K1),
        task("TASK_axb", "aXb AND MORE", 4, K1),
        task("TASK_quote", "it's \\ fine'); DROP TABLE tasks; --", 5, K1),
        task("TASK_nul", "before\x00after 0b", 6, K1),  # PostgreSQL: \uffff "before" \uffff "0after 0b"
        task("TASK_mark", "\uffff1x lead", 7, K1),  # escaped too (it starts with U+FFFF)
        task("TASK_mid", "a\uffff0b", 8, K1),  # U+FFFF inside, no NUL: stored as it is
        task("TASK_long", long, 9, K1),
        task("TASK_ids", "", 10, K1),  # a prompt of token ids has no text
        task("TASK_k2", "100% sure, says key two", 11, K2),
        task("_pub", "public template: 100% sure", 12, K2, "template", True),
        task("_priv@" + K2[:12], "private template: 100% sure", 13, K2, "template", False),
    ]
    for t in made:
        await store.save(to_row(t))

    async def ids(owner=K1, search=None, kind=None, limit=100, offset=0, all_owners=False):
        rows, total = await listing.list_tasks(owner, all_owners, kind, limit, offset, search)
        return [r.id for r in rows], total

    try:
        assert await ids(search="%") == (["TASK_pct", "_pub"], 2)  # a LIKE wildcard is a character
        assert await ids(search="_") == (["TASK_und"], 1)
        assert await ids(search="A_B") == (["TASK_und"], 1)  # ASCII case ignored
        assert await ids(search="axb and") == (["TASK_axb"], 1)
        assert await ids(search="sure") == (["TASK_pct", "TASK_num", "_pub"], 3)  # K2's own stay K2's
        assert await ids(search="SURE", limit=1, offset=1) == (["TASK_num"], 3)  # paging over the matches
        assert await ids(search="sure", kind="template") == (["_pub"], 1)
        assert await ids(K2, search="100%") == (["TASK_k2", "_pub", "_priv@" + K2[:12]], 3)
        assert await ids(None, search="100%", all_owners=True) == (
            ["TASK_pct", "TASK_k2", "_pub", "_priv@" + K2[:12]], 4)
        assert await ids(search="'); DROP TABLE tasks; --") == (["TASK_quote"], 1)
        assert await ids(search="\\ fine") == (["TASK_quote"], 1)
        assert await ids(search="e\\") == ([], 0)
        assert await ids(search="after 0") == (["TASK_nul"], 1)
        assert await ids(search="0after") == ([], 0)  # (the escape's "0" is not text)
        assert await ids(search="1x lead") == (["TASK_mark"], 1)
        assert await ids(search="0b") == (["TASK_nul", "TASK_mid"], 2)
        assert await ids(search="ünïcode") == ([], 0)  # only ASCII letters are folded
        assert await ids(search="Ünïcode start – xx") == (["TASK_long"], 1)
        assert await ids(search="x" * 300) == (["TASK_long"], 1)
        assert await ids(search="x" * 301) == ([], 0)
        assert (await ids())[1] == 11  # no search: K1's rows and the public template

        nul_long = task("TASK_nul_long", "\x00é" * 100, 20, K1)  # escaped on PostgreSQL: 301 characters
        await store.save(to_row(nul_long))
        rows, _ = await listing.list_tasks(K1, False, None, 100, 0, head=PREVIEW_CHARS + 1)
        previews = {r.id: preview(r.prompt_head) for r in rows}
        assert previews["TASK_long"] == long[:80] + "…"
        assert previews["TASK_nul"] == "before\x00after 0b" and previews["TASK_mark"] == "\uffff1x lead"
        assert previews["TASK_mid"] == "a\uffff0b" and previews["TASK_ids"] == ""
        assert previews["TASK_nul_long"] == "\x00é" * 40 + "…"
        assert previews["TASK_pct"] == "100% sure"
    finally:
        await store.close()
