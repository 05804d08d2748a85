"""Task store on real databases: state codec round trips, migrations, budgets, the writer. Tests
taking `db_url` run on a SQLite file and on a fresh PostgreSQL database (test/pg_util.py; that
half skips without PostgreSQL or asyncpg); test_store_pg.py has the rest of the PostgreSQL tests."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.ext.asyncio import create_async_engine

from server.model.state import ModelShape, State
from server.tasks import migrate
from server.tasks.cache import StateCache
from server.tasks.codec import StateCodecError, decode_state, encode_state
from server.tasks.errors import TaskUnavailable
from server.tasks.records import Task, from_row, to_row
from server.tasks.schema import metadata
from server.tasks.statestore import state_row
from server.tasks.store import RowHeld, Store, TagTaken, database_url
from server.tasks.token_digest import history_digest
from server.tasks.writer import Writer

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures

SHAPE = ModelShape(n_layer=2, n_embd=128, n_head=2, head_size=64, vocab_size=65536, ffn_dim=512,
                   d_decay=32, d_aaa=32, d_mv=32, d_gate=32)
SIG = SHAPE.signature()


def rand_state(seed: int = 0, shift=torch.float32, wkv=torch.float32) -> State:
    g = torch.Generator().manual_seed(seed)
    st = State.zeros(SHAPE, 1, shift_dtype=shift, wkv_dtype=wkv)
    for t in st.tensors():
        t.copy_(torch.randn(t.shape, generator=g) * 3)
    st.wkv.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])  # odd values survive too
    return st


def bits(st: State) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in st.tensors()]


async def open_store(path) -> Store:
    s = Store(str(path))
    await s.open()
    return s


async def run_sql(db: str, sql: str, params: dict | None = None) -> list | None:
    """One statement on database `db` (path or URL) through its own engine, committed; its rows."""
    eng = create_async_engine(database_url(db))
    try:
        async with eng.begin() as conn:
            res = await conn.execute(sa.text(sql), params or {})
            return res.all() if res.returns_rows else None
    finally:
        await eng.dispose()


async def inspect_schema(db: str) -> dict[str, tuple[set[str], set[str]]]:
    """{table: (column names, index names)} of database `db`, as the database reports them."""
    def names(conn):
        insp = sa.inspect(conn)
        out = {t: ({c["name"] for c in insp.get_columns(t)}, {i["name"] for i in insp.get_indexes(t)})
               for t in insp.get_table_names()}
        if conn.dialect.name == "sqlite":  # its reflection skips indexes on expressions
            rows = conn.exec_driver_sql("select tbl_name, name from sqlite_master where type = 'index' and sql is not null")
            for table, name in rows:
                out[table][1].add(name)
        return out

    eng = create_async_engine(database_url(db))
    try:
        async with eng.connect() as conn:
            return await conn.run_sync(names)
    finally:
        await eng.dispose()


@pytest.mark.parametrize("shift,wkv", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                       (torch.bfloat16, torch.float16)])
async def test_state_round_trip_through_the_database_is_bit_exact(db_url, shift, wkv):
    st = rand_state(1, shift, wkv)
    enc = encode_state(st, SIG)
    assert enc.checksum == st.checksum() and enc.nbytes == st.nbytes()
    store = await open_store(db_url)
    await store.save(state=state_row("s1", "TASK_x", enc, False))
    await store.close()
    store = await open_store(db_url)  # a fresh process would see the same bytes
    row = await store.states.get_state("s1")
    back = decode_state(orjson.loads(row.meta), row.data, SIG, row.checksum)
    assert bits(back) == bits(st)
    assert [t.dtype for t in back.tensors()] == [shift, shift, wkv]
    assert [t.shape for t in back.tensors()] == [t.shape for t in st.tensors()]
    await store.close()


def test_codec_refuses_other_model_shape_and_corruption():
    enc = encode_state(rand_state(), SIG)
    with pytest.raises(StateCodecError, match="model shape.*rwkv7-L2-C128.*rwkv7-L12-C768"):
        decode_state(enc.meta, enc.data, "rwkv7-L12-C768-H12-N64")
    bad = bytearray(enc.data)
    bad[100] ^= 1
    with pytest.raises(StateCodecError, match="checksum"):
        decode_state(enc.meta, bytes(bad), SIG, enc.checksum)
    with pytest.raises(StateCodecError, match="shorter"):
        decode_state(enc.meta, enc.data[:-4], SIG)
    meta = dict(enc.meta, layout="something-else")
    with pytest.raises(StateCodecError, match="layout"):
        decode_state(meta, enc.data, SIG)
    assert isinstance(enc.data, (bytes, bytearray)) and orjson.loads(orjson.dumps(enc.meta)) == enc.meta  # plain data


async def test_sqlite_runs_in_wal_mode_with_full_sync(tmp_path):
    store = await open_store(tmp_path / "w.db")
    async with store.engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
        assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == 2  # FULL
        assert (await conn.exec_driver_sql("PRAGMA page_size")).scalar() == 65536  # a new file
    await store.close()
    import sqlite3  # an existing file keeps its pages (SQLite ignores page_size once written)

    old = tmp_path / "old.db"
    with sqlite3.connect(old) as c:
        c.execute("create table x(a)")
    store = await open_store(old)
    async with store.engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA page_size")).scalar() == 4096
        assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
    await store.close()


async def test_migrations_from_empty_database_reach_head_and_match_schema(db_url):
    store = await open_store(db_url)
    assert store.revision_before is None and store.revision == migrate.head_revision() == "0008"
    await store.close()
    schema = await inspect_schema(db_url)
    assert set(schema) == {t.name for t in metadata.sorted_tables} | {"alembic_version"}
    for table in metadata.sorted_tables:
        cols, idx = schema[table.name]
        assert cols == {c.name for c in table.columns}, table.name
        assert idx == {i.name for i in table.indexes}, table.name
    store = await open_store(db_url)  # reopening: nothing to migrate
    assert store.revision_before == store.revision == "0008"
    await store.close()
    assert await run_sql(db_url, "select version_num from alembic_version") == [("0008",)]


MARKED = {
    "TASK_session": ["\n\nUser:", "\uffffrwkv_lightning session chat:3"],
    "TASK_response": ["\n\nUser:", "\uffffrwkv openai response"],
    "TASK_plain": ["\uffff is mine"],  # a client's own stop string that merely starts with U+FFFF
    "TASK_session_fork": ["\n\nUser:", "\uffffrwkv_lightning session chat:3"],  # a task-API fork inherited it
    "TASK_session_twin": ["\uffffrwkv_lightning session chat:3"],  # an older server made it twice (replicas)
}


async def _v1_database(db: str) -> None:
    """A database as schema version 0001 left it, with one task and one state."""
    eng = create_async_engine(database_url(db))
    async with eng.begin() as aconn:
        await aconn.run_sync(_v1_rows)
    await eng.dispose()


def _v1_rows(conn) -> None:
    migrate.upgrade(conn, "0001")
    enc = encode_state(rand_state(7), SIG)
    row = state_row("S1", "TASK_old", enc, False)
    row.pop("last_used")
    conn.execute(sa.text("INSERT INTO states (id, task_id, is_template, signature, meta, nbytes, checksum, "
                         "data, created_at) VALUES (:id, :task_id, :is_template, :signature, :meta, "
                         ":nbytes, :checksum, :data, :created_at)"), {**row, "created_at": 123.0})
    t = Task(id="TASK_old", kind="task", prompt="hi", stored_id="S1", stored_pos=1)
    t.tokens.extend([1, 2])
    t.out.append("x", 1)
    row = {k: v for k, v in to_row(t).items() if k not in ("public", "instance", "version", "base_id", "tag",
                                                    "digest")}  # v1's
    conn.execute(sa.text(f"INSERT INTO tasks ({', '.join(row)}) VALUES ({', '.join(':' + k for k in row)})"), row)
    for tid, stop in MARKED.items():  # the marks of sessions and responses before v6: stop strings
        parent = "TASK_session" if tid == "TASK_session_fork" else None
        marked = {**row, "id": tid, "parent_id": parent, "params": orjson.dumps({"stop": stop, "max_tokens": 5}).decode(),
                  "created_at": 1.0 if tid == "TASK_session_twin" else row["created_at"]}  # the twin: older
        conn.execute(sa.text(f"INSERT INTO tasks ({', '.join(marked)}) VALUES ({', '.join(':' + k for k in marked)})"), marked)
    tpl = {**row, "id": "_old_public", "kind": "template", "owner": None}
    conn.execute(sa.text(f"INSERT INTO tasks ({', '.join(tpl)}) VALUES ({', '.join(':' + k for k in tpl)})"), tpl)
    own = {**row, "id": "_old_private", "kind": "template", "owner": "k" * 32}
    conn.execute(sa.text(f"INSERT INTO tasks ({', '.join(own)}) VALUES ({', '.join(':' + k for k in own)})"), own)


async def test_migration_from_previous_version_upgrades_in_place(db_url):
    await _v1_database(db_url)
    assert await run_sql(db_url, "select version_num from alembic_version") == [("0001",)]
    assert "last_used" not in (await inspect_schema(db_url))["states"][0]
    store = await open_store(db_url)
    assert (store.revision_before, store.revision) == ("0001", "0008")
    t = from_row(await store.get_task("TASK_old"))
    assert t.prompt == "hi" and list(t.tokens) == [1, 2] and t.out.text == "x"
    assert (t.stored_id, t.stored_pos, t.version, t.instance, t.public, t.base_id) == ("S1", 1, 0, None, False, None)
    # templates made without keys were readable by every key: public; those of a key: private
    assert from_row(await store.get_task("_old_public")).public
    assert not from_row(await store.get_task("_old_private")).public
    row = await store.states.get_state("S1")
    assert decode_state(orjson.loads(row.meta), row.data, SIG, row.checksum).checksum() == rand_state(7).checksum()
    await store.close()
    assert await run_sql(db_url, "select last_used from states where id='S1'") == [(123.0,)]  # backfilled
    assert "ix_states_evict" in (await inspect_schema(db_url))["states"][1]
    assert "lease_timeout" in (await inspect_schema(db_url))["instances"][0]  # v5
    store = await open_store(db_url)  # v6: the marks moved from the stop strings to the tag column
    got = {tid: from_row(await store.get_task(tid)) for tid in MARKED}
    await store.close()
    assert {tid: (t.tag, t.params) for tid, t in got.items()} == {
        "TASK_session": ("lightning session chat:3", {"stop": ["\n\nUser:"], "max_tokens": 5}),
        "TASK_response": ("response", {"stop": ["\n\nUser:"], "max_tokens": 5}),
        "TASK_plain": (None, {"stop": ["\uffff is mine"], "max_tokens": 5}),
        "TASK_session_fork": (None, {"stop": ["\n\nUser:"], "max_tokens": 5}),  # not part of the session
        "TASK_session_twin": (None, {"stop": [], "max_tokens": 5}),  # the newer of two of one name is the session
    }
    assert from_row(await (s := await open_store(db_url)).get_task("TASK_old")).tag is None
    await s.close()
    # v8: the responses that ended have the digest of their token history; others get theirs at their next write
    digests = dict(await run_sql(db_url, "select id, digest from tasks"))
    assert digests.pop("TASK_response") == history_digest([1, 2]).hex()
    assert set(digests.values()) == {None}


async def test_newer_schema_is_refused_with_a_clear_message(db_url):
    await (await open_store(db_url)).close()
    await run_sql(db_url, "update alembic_version set version_num='0099'")
    store = Store(db_url)
    with pytest.raises(migrate.SchemaTooNewError, match="0099.*newer server"):
        await store.open()
    assert store.engine is None
    assert await run_sql(db_url, "select version_num from alembic_version") == [("0099",)]


async def test_db_budget_drops_oldest_non_template_states_and_keeps_text(db_url):
    store = await open_store(db_url)
    enc = encode_state(rand_state(), SIG)
    n = enc.nbytes
    for i in range(6):
        t = Task(id=f"TASK_{i}", kind="task", stored_id=f"S{i}", stored_pos=3)
        t.out.append(f"text {i}", 1)
        row = state_row(f"S{i}", t.id, enc, is_template=(i == 0))
        row["last_used"] = 1000.0 + i
        await store.save(to_row(t), row)
    victims, left = await store.states.enforce_budget(2 * n, keep={"S2"})
    assert victims == ["S1", "S3", "S4"] and left == 2 * n  # S0 is a template, S2 is in use
    for i in range(6):
        t = from_row(await store.get_task(f"TASK_{i}"))
        assert t.out.text == f"text {i}"
        assert (t.stored_id is None) == (f"S{i}" in victims) and (t.stored_pos == 0) == (f"S{i}" in victims)
    assert await store.states.states_bytes(templates=True) == n
    await store.close()


async def test_digests_list_an_owners_ended_responses_newest_first(db_url):
    """Store.digests: (id, tokens, digest) of one owner's tasks of one tag that ended, newest
    first, up to a limit; a running task has no digest yet, another owner's or tag's is not listed."""
    store = await open_store(db_url)
    for i, (owner, tag, status, n) in enumerate([("k", "response", 3, 5), ("k", "response", 2, 6), ("k", None, 3, 7),
                                                 ("k2", "response", 3, 8), ("k", "response", 3, 9),
                                                 (None, "response", 3, 4)]):  # fmt: skip
        t = Task(id=f"R{i}", kind="task", owner=owner, tag=tag, status=status, created_at=100.0 + i)
        t.tokens.extend(range(1000, 1000 + n))
        await store.save(to_row(t))
    want = [("R4", 9, history_digest(range(1000, 1009))), ("R0", 5, history_digest(range(1000, 1005)))]
    assert await store.digests("k", "response", 10) == want
    assert await store.digests("k", "response", 1) == want[:1]
    assert await store.digests(None, "response", 10) == [("R5", 4, history_digest(range(1000, 1004)))]
    await store.close()


async def test_tags_are_found_exactly_by_owner_name_and_prefix(db_url):
    """Store.tagged: exact tags, or tags starting with a prefix, of one owner; LIKE's wildcards
    in a name are plain characters, and case matters (SQLite's LIKE ignores ASCII case)."""
    store = await open_store(db_url)
    tags = {"T1": ("k", "s a%b:1"), "T2": ("k", "s a_b:1"), "T3": ("k", "s A%b:2"), "T4": ("k", "s a%b"),
            "T5": ("other", "s a%b:3"), "T6": (None, "s a%b:4"), "T7": ("k", None), "T8": ("k", "s a%b:12")}
    for i, (tid, (owner, tag)) in enumerate(tags.items()):
        await store.save(to_row(Task(id=tid, kind="task", owner=owner, tag=tag, created_at=100.0 + i)))
    assert await store.tagged("k", "s a%b:", prefix=True) == [("s a%b:1", "T1"), ("s a%b:12", "T8")]
    assert await store.tagged("k", "s a%b") == [("s a%b", "T4")]
    assert await store.tagged(None, "s ", prefix=True) == [("s a%b:4", "T6")]  # no keys: the keyless rows
    assert await store.tagged("k", "s a_b:1") == [("s a_b:1", "T2")] and await store.tagged("k", "s a_c:1") == []
    # one task per tag and owner (keyless rows too), but any number of responses
    for owner in ("k", None):
        with pytest.raises(TagTaken):
            await store.save_rows([to_row(Task(id=f"TX{owner}", kind="task", owner=owner, tag="s a%b:4" if owner is None
                                               else "s a%b:1"))])
    await store.save(to_row(Task(id="T9", kind="task", owner="k2", tag="s a%b:1")))  # another owner's
    for i in range(2):
        await store.save(to_row(Task(id=f"R{i}", kind="task", owner="k", tag="response")))
    assert len(await store.tagged("k", "response")) == 2 and not await store.task_exists("TXk")
    await store.close()


async def test_a_delete_leaves_a_row_another_instance_runs(db_url):
    store = await open_store(db_url)
    await store.save(to_row(Task(id="T_run", kind="task", status=2, instance="a")))
    await store.save(to_row(Task(id="T_done", kind="task", instance=None)))
    with pytest.raises(RowHeld) as e:
        await store.delete_task("T_run", "b")
    assert e.value.instance == "a" and await store.task_exists("T_run")
    assert await store.delete_task("T_done", "b") == (True, 0)  # finished: any instance deletes it
    assert await store.delete_task("T_run", "a") == (True, 0)  # its own instance does
    assert await store.delete_task("T_run", "a") == (False, 0)
    await store.close()


async def test_db_budget_drops_preferred_states_last(db_url):
    """`prefer` (the states a cache holds) go only when the others do not make the budget."""
    store = await open_store(db_url)
    enc = encode_state(rand_state(), SIG)
    n = enc.nbytes
    for i in range(5):
        row = state_row(f"S{i}", f"TASK_{i}", enc, is_template=False)
        row["last_used"] = 1000.0 + i
        await store.save(to_row(Task(id=f"TASK_{i}", kind="task", stored_id=f"S{i}", stored_pos=3)), row)
    victims, left = await store.states.enforce_budget(3 * n, keep=set(), prefer={"S0", "S1"})
    assert victims == ["S2", "S3"] and left == 3 * n  # the oldest two are cached: kept
    victims, left = await store.states.enforce_budget(1 * n, keep={"S4"}, prefer={"S0", "S1"})
    assert victims == ["S0", "S1"] and left == n  # nothing else left: the cached ones go, oldest first
    await store.close()


async def test_mark_interrupted_and_delete(db_url):
    store = await open_store(db_url)
    for i, status in enumerate([0, 1, 2, 3]):
        await store.save(to_row(Task(id=f"TASK_{i}", kind="task", status=status, finish_reason=None)))
    assert sorted(await store.mark_interrupted()) == ["TASK_0", "TASK_1", "TASK_2"]
    rows = [from_row(await store.get_task(f"TASK_{i}")) for i in range(4)]
    assert [(r.status, r.finish_reason) for r in rows] == [(3, "interrupted")] * 3 + [(3, None)]
    assert await store.delete_task("TASK_0") == (True, 0) and await store.delete_task("TASK_0") == (False, 0)
    assert await store.get_task("TASK_0") is None
    await store.close()


def test_state_cache_budget_pins_and_templates():
    one = rand_state().nbytes()
    cache = StateCache(3 * one)
    for i in range(10):
        cache.put(f"k{i}", rand_state(i))
        assert cache.stats()["lru_bytes"] <= 3 * one
    assert {"k7", "k8", "k9"} == {k for k in cache.keys()} and cache.evictions == 7
    cache.put("tpl", rand_state(), template=True)
    cache.pin("k9")
    for i in range(10, 20):
        cache.put(f"k{i}", rand_state(i))
    assert cache.get("tpl") is not None and cache.get("k9") is not None  # never evicted
    cache.unpin("k9")  # back in the LRU, most recent
    assert "k9" in cache and cache.stats()["lru_bytes"] <= 3 * one
    cache.put("huge", State.zeros(SHAPE, 8))  # larger than the budget: simply not cached
    assert "huge" not in cache


async def test_writer_queue_is_bounded_and_ordered():
    w = Writer(2)
    w.start()
    gate, done = asyncio.Event(), []

    async def job(i):
        await gate.wait()
        done.append(i)

    await w.put(job, 0)
    await asyncio.sleep(0.01)  # job 0 is running (blocked); two more fill the queue
    await w.put(job, 1)
    await w.put(job, 2)
    assert not w.offer(job, 99) and w.dropped == 1
    blocked = asyncio.create_task(w.put(job, 3))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # back-pressure: the producer waits
    gate.set()
    await blocked
    await w.flush()
    assert done == [0, 1, 2, 3]
    await w.close()


async def test_writer_merges_consecutive_put_many_and_keeps_order():
    """Entries of one list job queued back to back run as one call; any other job between them
    ends the group, so the order of writes is the order of submission."""
    w = Writer(100)
    gate, calls = asyncio.Event(), []

    async def hold():
        await gate.wait()

    async def rows(items):
        calls.append(("rows", list(items)))

    async def one(x):
        calls.append(("one", x))

    w.start()
    await w.put(hold)  # the writer is busy while the rest is queued
    futs = [await w.put_many(rows, i) for i in range(3)]
    await w.put(one, "x")
    futs += [await w.put_many(rows, i) for i in (3, 4)]
    gate.set()
    await asyncio.gather(*futs)
    assert calls == [("rows", [0, 1, 2]), ("one", "x"), ("rows", [3, 4])]
    assert all(f.result() is None for f in futs) and w.done == 7 and w.failed == 0
    await w.close()


async def test_writer_groups_close_at_their_byte_weight(monkeypatch):
    """Weighted put_many items (a settled task's state bytes) group up to GROUP_BYTES: the first
    group is committed (and acknowledged) without waiting for the whole burst; an item heavier
    than the limit still goes, alone; weightless items fill a group as before."""
    from server.tasks import writer as writer_mod

    monkeypatch.setattr(writer_mod, "GROUP_BYTES", 100)
    w = Writer(100)
    gate, calls = asyncio.Event(), []

    async def hold():
        await gate.wait()

    async def settle(items):
        calls.append([name for name, _ in items])

    w.start()
    await w.put(hold)
    items = [("a", 40), ("b", 40), ("c", 40), ("big", 500), ("d", 0), ("e", 0), ("f", 60), ("g", 60)]
    futs = [await w.put_many(settle, it, weight=it[1]) for it in items]
    gate.set()
    await asyncio.gather(*futs)
    assert calls == [["a", "b"], ["c"], ["big"], ["d", "e", "f"], ["g"]]
    await w.close()


async def test_writer_group_failure_fails_only_the_bad_item():
    w = Writer(100)
    gate, calls = asyncio.Event(), []

    async def hold():
        await gate.wait()

    async def rows(items):
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("bad row")

    w.start()
    await w.put(hold)
    futs = [await w.put_many(rows, x) for x in ("a", "bad", "c")]
    gate.set()
    done = await asyncio.gather(*futs, return_exceptions=True)
    assert done[0] is None and done[2] is None and isinstance(done[1], ValueError)
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]  # the group, then one by one
    assert w.failed == 1
    await w.close()


async def test_requests_queued_behind_a_write_that_found_the_database_away_fail_at_once():
    """A write that waited out the busy timeout (TaskUnavailable) fails the requests' jobs
    (fail_fast) queued while it waited at once, with its error, instead of each waiting the
    timeout again (the QA saw 503s after 1, 2, 3 and 4 timeouts); background jobs still run
    (each handles its own failure: a settle row's retry, the progress flag); a request queued
    after it tries, and one success ends it."""
    w = Writer(100)
    gate, tries = asyncio.Event(), []

    async def locked(name):  # the database is locked beyond the busy timeout
        tries.append(name)
        await gate.wait()
        raise TaskUnavailable("the task database is locked by another writer")

    async def rows(items):
        tries.append(list(items))

    async def ok(name):
        tries.append(name)
        return name

    w.start()
    first = await w.put(locked, "first", fail_fast=True)
    behind = [await w.put(locked, "second", fail_fast=True), await w.put_many(rows, "row", fail_fast=True),
              await w.put(ok, "third", fail_fast=True)]
    background = await w.put(ok, "progress")
    await asyncio.sleep(0.01)
    gate.set()
    for fut in (first, *behind):
        with pytest.raises(TaskUnavailable, match="locked"):
            await fut
    assert await background == "progress" and tries == ["first", "progress"] and w.failed == 4
    assert await w.call(ok, "later", fail_fast=True) == "later"  # queued after: it runs
    await w.close()


async def test_writer_logs_an_unavailable_database_once_a_while_and_bugs_in_full(caplog):
    # an outage made every background retry log ~100 lines of traceback, once a second
    w = Writer(100)

    async def away():
        raise TaskUnavailable("database is locked beyond the busy timeout")

    async def bug():
        raise RuntimeError("a bug")

    w.start()
    with caplog.at_level(logging.WARNING, logger="server.tasks.writer"):
        for _ in range(5):
            w.offer(away)
        w.offer(bug)
        await w.flush()
    recs = caplog.records
    assert [r.levelno for r in recs] == [logging.WARNING, logging.ERROR], [r.getMessage() for r in recs]
    assert recs[0].exc_info is None and "busy timeout" in recs[0].getMessage()
    assert recs[1].exc_info is not None and w.failed == 6
    await w.close()


async def test_save_rows_upserts_in_one_transaction(db_url):
    store = await open_store(db_url)
    now = time.time()
    old = to_row(Task(id="TASK_old", kind="task", created_at=now))
    await store.save(old)
    commits = []
    sa.event.listen(store.engine.sync_engine, "commit", lambda conn: commits.append(1))
    rows = [to_row(Task(id=f"TASK_{i}", kind="task", created_at=now)) for i in range(3)]
    upd = dict(old, prompt="changed")
    again = dict(rows[1], prompt="second write wins")
    await store.save_rows([rows[0], rows[1], upd, rows[2], again])
    assert len(commits) == 1
    got = {i: (await store.get_task(i)).prompt for i in ("TASK_old", "TASK_0", "TASK_1", "TASK_2")}
    assert got == {"TASK_old": "changed", "TASK_0": rows[0]["prompt"], "TASK_1": "second write wins",
                   "TASK_2": rows[2]["prompt"]}
    assert (await store.counts())["tasks"] == 4
    await store.close()


async def test_store_opens_in_memory_and_urls(tmp_path):
    from server.tasks.store import database_url

    assert database_url("x.db").startswith("sqlite+aiosqlite:////")
    assert database_url("postgresql+asyncpg://u@h/db") == "postgresql+asyncpg://u@h/db"
    # the blocking drivers' URLs (what users paste) get the async driver the store needs
    assert database_url("postgresql://u:p@h:5433/db") == "postgresql+asyncpg://u:p@h:5433/db"
    assert database_url("postgres://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert database_url("sqlite:////tmp/x.db") == "sqlite+aiosqlite:////tmp/x.db"
    store = Store(":memory:")
    await store.open()
    await store.save(to_row(Task(id="TASK_m", kind="task", created_at=time.time())))
    assert (await store.counts())["tasks"] == 1
    await store.close()


def test_migrations_and_queries_render_for_postgresql():
    from sqlalchemy.dialects import postgresql

    from server.tasks.schema import states, tasks

    ddl = migrate.render_sql("postgresql")
    assert "CREATE TABLE tasks" in ddl and "data BYTEA NOT NULL" in ddl and "is_template BOOLEAN" in ddl
    assert "ALTER TABLE states ADD COLUMN last_used" in ddl and "PRAGMA" not in ddl
    pg = postgresql.dialect()
    for stmt in (sa.update(tasks).where(tasks.c.state_id.in_(["a", "b"])).values(state_id=None, state_pos=0),
                 sa.select(states.c.id).where(states.c.is_template == sa.false()).order_by(states.c.last_used),
                 sa.delete(states).where(states.c.id == "x").where(~sa.select(tasks.c.id).where(
                     tasks.c.state_id == "x").exists())):
        assert str(stmt.compile(dialect=pg))


async def test_a_missing_database_driver_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "asyncpg", None)  # as if not installed
    store = Store("postgresql://u@127.0.0.1:1/db")
    with pytest.raises(RuntimeError, match=r"needs the asyncpg package.*\[postgres\]"):
        await store.open()
    assert store.engine is None


def _open_together(db: str, barrier, q) -> None:
    """Child process: wait until every child has imported, open (migrate) the store, report."""
    try:
        barrier.wait(timeout=120)

        async def go():
            s = Store(db)
            await s.open()
            rev = s.revision
            await s.close()
            return rev
        q.put(("ok", asyncio.run(go())))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def test_processes_opening_one_empty_database_at_once_all_succeed(db_url):
    """Several servers started together on one new database: each migrates or waits for the one
    that does; none fails on a table the other created."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_open_together, args=(str(db_url), barrier, q)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    head = migrate.head_revision()
    assert results == [("ok", head)] * 4, results
    assert asyncio.run(run_sql(db_url, "select version_num from alembic_version")) == [(head,)]


def test_a_server_without_its_migrations_says_where_to_run_it(monkeypatch, tmp_path):
    """Installed from a built wheel (no source tree), the migrations are missing: a message that
    says so, not alembic's 'Path doesn't exist'."""
    from server.tasks import migrate

    monkeypatch.setattr(migrate, "MIGRATIONS_DIR", tmp_path / "site-packages" / "migrations")
    with pytest.raises(migrate.MigrationsMissing, match="source tree"):
        migrate.head_revision()
