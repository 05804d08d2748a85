"""The task store on a live PostgreSQL server (a throwaway cluster, test/pg_util.py; skipped
without PostgreSQL or asyncpg). Tests taking `db_url` run on SQLite too, so each PostgreSQL
result is checked against the same assertions on the reference backend; `pg_url` tests are
PostgreSQL only. test_store.py runs its migration, round-trip, budget and upsert tests on both."""

from __future__ import annotations

import asyncio
import hashlib
import os

import orjson
import sqlalchemy as sa
import torch

from server.model.state import ModelShape, State
from server.tasks import migrate
from server.tasks.codec import decode_state, encode_state
from server.tasks.listing import Listing
from server.tasks.records import Task, from_row, to_row
from server.tasks.statestore import state_row
from server.tasks.store import _CHUNK, Store, _upsert_rows

from pg_util import db_url, pg_cluster, pg_url  # noqa: F401 - fixtures
from test_store import SIG, bits, inspect_schema, open_store, rand_state, run_sql

# a few MB of state (3.2 MB fp32), and the 2.9B model's size (21 MB fp32)
MID = ModelShape(n_layer=12, n_embd=1024, n_head=16, head_size=64, vocab_size=65536, ffn_dim=4096,
                 d_decay=64, d_aaa=64, d_mv=32, d_gate=128)
BIG = ModelShape(n_layer=32, n_embd=2560, n_head=40, head_size=64, vocab_size=65536, ffn_dim=8960,
                 d_decay=96, d_aaa=96, d_mv=64, d_gate=320)


def big_state(shape: ModelShape, seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    st = State.zeros(shape, 1)
    for t in st.tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    return st


def task(i: int | str, **kw) -> Task:
    """A task; `state_id`/`state_pos` name a stored state (what its row says)."""
    if "state_id" in kw:
        kw.setdefault("stored_id", kw["state_id"])
        kw.setdefault("stored_pos", kw.get("state_pos", 0))
    return Task(id=kw.pop("id", f"TASK_{i}"), kind=kw.pop("kind", "task"), **kw)


def full_task(i: int, owner: str | None = None, created_at: float = 1_700_000_000.123456789) -> Task:
    """A task with its columns set to distinct, non-default values (state_id aside)."""
    t = Task(id=f"TASK_{i:04d}", kind="task", owner=owner, parent_id=f"TASK_p{i}",
             params={"max_tokens": 100 + i, "temperature": 0.7, "stop": ["\n\n", "é"]},
             prompt=f"prompt {i} – ünïcødé 🐍", prompt_len=7 + i, state_id=None, state_pos=0,
             status=i % 4, finish_reason="stop" if i % 4 == 3 else None, prompt_tokens=7 + i,
             completion_tokens=3 * i, prefill_time=0.001 * i + 1e-9, gen_time=1 / 3 + i,
             created_at=created_at + i * 0.000001, updated_at=created_at + i + 0.5)
    t.tokens.extend([65535, 0, 1, 2 ** 31 - 1, -1, i])
    t.out_start = 3
    t.out.append(f"out {i} ", 2)
    t.out.append("✓", 1)
    return t


# --- PostgreSQL only ------------------------------------------------------------------------------
async def test_store_is_on_postgresql_with_the_expected_column_types(pg_url):
    store = await open_store(pg_url)
    assert not store.is_sqlite and store.engine.dialect.name == "postgresql"
    assert (store.revision_before, store.revision) == (None, migrate.head_revision())
    async with store.engine.connect() as conn:
        assert (await conn.exec_driver_sql("select version()")).scalar().startswith("PostgreSQL ")
        assert (await conn.exec_driver_sql("show fsync")).scalar() == "on"
        rows = (await conn.exec_driver_sql(
            "select table_name, column_name, data_type, character_maximum_length, is_nullable "
            "from information_schema.columns where table_schema = 'public'")).all()
    await store.close()
    cols = {(r[0], r[1]): (r[2], r[3], r[4]) for r in rows}
    assert cols[("tasks", "id")] == ("character varying", 160, "NO")
    assert cols[("tasks", "instance")] == ("character varying", 80, "YES")
    assert cols[("tasks", "public")] == ("boolean", None, "NO")
    assert cols[("instances", "heartbeat_at")] == ("double precision", None, "NO")
    assert cols[("tasks", "tokens")] == ("bytea", None, "NO")
    assert cols[("tasks", "prompt")] == ("text", None, "NO")
    assert cols[("tasks", "owner")] == ("character varying", 64, "YES")
    assert cols[("tasks", "created_at")] == ("double precision", None, "NO")  # not float4: time.time() exact
    assert cols[("states", "data")] == ("bytea", None, "NO")
    assert cols[("states", "is_template")] == ("boolean", None, "NO")
    assert cols[("states", "nbytes")] == ("bigint", None, "NO")
    assert cols[("states", "last_used")] == ("double precision", None, "NO")
    assert cols[("alembic_version", "version_num")][0] == "character varying"


async def test_two_stores_write_the_same_database_concurrently(pg_url):
    """Two servers' stores (own engines, own write locks) write disjoint tasks at the same time:
    PostgreSQL runs their transactions side by side; nothing is lost or mixed up."""
    a, b = await open_store(pg_url), await open_store(pg_url)
    enc = encode_state(rand_state(3), SIG)

    async def writer(store: Store, tag: str) -> None:
        for i in range(20):
            rows = [to_row(task(f"{tag}_{i}_{j}", prompt=f"{tag} {i} {j}")) for j in range(5)]
            await store.save_rows(rows)
            await store.save(to_row(task(f"{tag}_s{i}", state_id=f"S{tag}{i}", state_pos=1)),
                             state_row(f"S{tag}{i}", f"TASK_{tag}_s{i}", enc, False))
            await store.save_progress([{"id": f"TASK_{tag}_{i}_0", "text": f"progress {tag} {i}"}])

    await asyncio.gather(writer(a, "a"), writer(b, "b"))
    await a.close()
    await b.close()
    c = await open_store(pg_url)
    assert await c.counts() == {"tasks": 2 * 20 * 6, "states": 2 * 20}
    for tag in "ab":
        for i in range(20):
            t = from_row(await c.get_task(f"TASK_{tag}_{i}_0"))
            assert (t.prompt, t.out.text) == (f"{tag} {i} 0", f"progress {tag} {i}")
            assert (await c.states.get_state(f"S{tag}{i}")).data == enc.data
    assert await c.states.states_bytes() == 40 * enc.nbytes
    await c.close()


async def test_plain_strings_are_stored_unescaped_on_postgresql(pg_url):
    """Only a value with a NUL (or the escape mark) is escaped on PostgreSQL; everything else is
    stored as is, readable by plain SQL."""
    store = await open_store(pg_url)
    await store.save(to_row(task("plain", prompt="just text ✓", owner="k" * 32)))
    await store.save(to_row(task("nul", prompt="a\x00b")))
    await store.close()
    raw = await run_sql(pg_url, "select id, prompt, owner from tasks order by id")
    assert raw[1] == ("TASK_plain", "just text ✓", "k" * 32)
    assert raw[0][0] == "TASK_nul" and raw[0][1] != "a\x00b" and "\x00" not in raw[0][1]


# --- both backends --------------------------------------------------------------------------------
async def test_task_rows_create_read_update_list_delete(db_url):
    store = await open_store(db_url)
    owners = [None, "alice", "bob"]
    made = [full_task(i, owner=owners[i % 3]) for i in range(12)]
    for t in made[:6]:
        await store.save(to_row(t))
    await store.save_rows([to_row(t) for t in made[6:]])
    tpl = task("tpl", id="_greeting", kind="template", owner="alice", created_at=made[0].created_at)
    await store.save(to_row(tpl))
    for t in made + [tpl]:  # every column comes back exactly (floats, ints, blobs, unicode, NULLs)
        assert to_row(from_row(await store.get_task(t.id))) == to_row(t)
    assert await store.task_exists("TASK_0003") and not await store.task_exists("TASK_nope")
    assert await store.get_task("TASK_nope") is None

    # update: whole rows (upsert) and progress columns of existing rows only
    made[2].out.append(" more", 1)
    made[2].status, made[2].updated_at = 3, made[2].updated_at + 1
    await store.save(to_row(made[2]))
    await store.save_progress([{"id": "TASK_0004", "text": "partial", "completion_tokens": 99},
                               {"id": "TASK_gone", "text": "never", "completion_tokens": 1}])
    assert to_row(from_row(await store.get_task("TASK_0002"))) == to_row(made[2])
    t4 = from_row(await store.get_task("TASK_0004"))
    assert (t4.out.text, t4.completion_tokens, t4.prompt) == ("partial", 99, made[4].prompt)
    assert not await store.task_exists("TASK_gone")

    # list: owner / all owners / kind filters, newest first, limit + offset, total
    listing = Listing(store)
    rows, total = await listing.list_tasks("alice", False, None, 100, 0)
    alice = [t for t in made if t.owner == "alice"]
    assert total == len(alice) + 1
    assert [r.id for r in rows] == [t.id for t in sorted(alice, key=lambda t: -t.created_at)] + ["_greeting"]
    rows, total = await listing.list_tasks(None, False, None, 100, 0)
    assert total == 4 and {r.id for r in rows} == {t.id for t in made if t.owner is None}
    rows, total = await listing.list_tasks(None, True, "task", 5, 3)
    newest = sorted(made, key=lambda t: -t.created_at)
    assert total == 12 and [r.id for r in rows] == [t.id for t in newest[3:8]]
    assert rows[0].completion_tokens == newest[3].completion_tokens and rows[0].parent_id == newest[3].parent_id
    rows, total = await listing.list_tasks("alice", False, "template", 10, 0)
    assert total == 1 and [r.id for r in rows] == ["_greeting"]

    # delete: the task's state goes with it unless another task still uses it
    enc = encode_state(rand_state(5), SIG)
    await store.save(to_row(task("a", state_id="SH", state_pos=2)), state_row("SH", "TASK_a", enc, False))
    await store.save(to_row(task("b", state_id="SH", state_pos=2)))  # a fork sharing the state
    n = enc.nbytes
    assert await store.delete_task("TASK_a") == (True, 0) and (await store.states.get_state("SH")) is not None
    assert await store.delete_task("TASK_b") == (True, n) and (await store.states.get_state("SH")) is None
    assert await store.delete_task("TASK_b") == (False, 0)
    assert await store.counts() == {"tasks": 13, "states": 0}
    await store.close()


async def test_text_with_nul_characters_round_trips(db_url):
    """Prompts and output may contain NUL (token 1 decodes to "\\x00"); PostgreSQL text cannot
    hold it, so the store escapes it there. Lookups of ids with a NUL, or longer than the id column,
    find nothing (no error)."""
    store = await open_store(db_url)
    odd = ["a\x00b", "\x00", "\x00\x00end", "\uffff", "\uffff0", "\ufffflead", "x\uffff0\x00\uffff1y",
           "no nul at all", ""]
    for i, s in enumerate(odd):
        t = task(i, prompt=s, params={"stop": [s]})
        t.out.append(s + "!", 2)
        await store.save(to_row(t))
    await store.save_progress([{"id": "TASK_0", "text": "progress\x00"}])
    await store.save_rows([to_row(task(100, prompt="\x00 upserted"))])
    for i, s in enumerate(odd):
        t = from_row(await store.get_task(f"TASK_{i}"))
        assert t.prompt == s and t.params == {"stop": [s]}
        assert t.out.text == ("progress\x00" if i == 0 else s + "!") and list(t.out.offsets)[-1] == len(s) + 1
    assert from_row(await store.get_task("TASK_100")).prompt == "\x00 upserted"
    assert await store.get_task("TASK_\x00") is None and not await store.task_exists("TASK_\x00")
    assert not (await store.delete_task("TASK_0\x00"))[0] and await store.task_exists("TASK_0")
    rows, total = await Listing(store).list_tasks(None, True, "task\x00", 10, 0)
    assert (rows, total) == ([], 0)
    long_id = "TASK_" + "x" * 155  # the column's 160 characters: a longer id is another id, not cut
    await store.save(to_row(task("", id=long_id)))
    assert await store.task_exists(long_id) and not await store.task_exists(long_id + "y")
    assert await store.get_task(long_id + "\x00") is None and not (await store.delete_task(long_id + "y" * 100))[0]
    await store.close()


async def test_states_of_realistic_size_round_trip_byte_exact(db_url):
    """States of a few MB and of the 2.9B model's size (21 MB) in one save_each transaction,
    read back by a new store (a restarted server) byte for byte."""
    mid_sig, big_sig = MID.signature(), BIG.signature()
    mids = [big_state(MID, s) for s in range(3)]
    big = big_state(BIG, 9)
    encs = [encode_state(st, mid_sig) for st in mids] + [encode_state(big, big_sig)]
    assert 3 << 20 < encs[0].nbytes < 4 << 20 and encs[3].nbytes > 20 << 20

    async def items():
        for i, enc in enumerate(encs):
            yield to_row(task(i, state_id=f"S{i}", state_pos=10)), state_row(f"S{i}", f"TASK_{i}", enc, i == 3), []

    store = await open_store(db_url)
    commits = []
    sa.event.listen(store.engine.sync_engine, "commit", lambda conn: commits.append(1))
    await store.save_each(items())
    assert len(commits) == 1
    await store.close()
    store = await open_store(db_url)
    for i, enc in enumerate(encs):
        row = await store.states.get_state(f"S{i}")
        assert bytes(row.data) == bytes(enc.data) and row.nbytes == enc.nbytes == len(row.data)
        assert row.checksum == hashlib.sha256(row.data).hexdigest() == enc.checksum
        assert bool(row.is_template) == (i == 3) and row.signature == (big_sig if i == 3 else mid_sig)
        back = decode_state(orjson.loads(row.meta), row.data, row.signature, row.checksum)
        assert bits(back) == bits(mids[i] if i < 3 else big)
    total = sum(e.nbytes for e in encs[:3])
    assert await store.states.states_bytes() == total and await store.states.states_bytes(True) == encs[3].nbytes
    assert await store.states.states_bytes(None) == total + encs[3].nbytes
    assert isinstance(await store.states.states_bytes(), int)
    await store.close()


async def test_upserts_in_chunks_and_many_evictions(db_url):
    """_upsert_rows over more ids than one IN list (_CHUNK), half of them existing, a repeated id,
    inside one transaction; then a budget that evicts more states than one IN list."""
    n = _CHUNK + 50
    store = await open_store(db_url)
    await store.save_rows([to_row(task(i, prompt=f"old {i}")) for i in range(0, n, 2)])
    rows = [to_row(task(i, prompt=f"new {i}", completion_tokens=i)) for i in range(n)]
    rows.append(to_row(task(7, prompt="last write wins")))
    async with store.write() as conn:
        await _upsert_rows(conn, rows)
    assert (await store.counts())["tasks"] == n
    got = {r.id: (r.prompt, r.completion_tokens)
           for r in await run_sql(db_url, "select id, prompt, completion_tokens from tasks")}
    assert got == {f"TASK_{i}": ("last write wins" if i == 7 else f"new {i}", 0 if i == 7 else i) for i in range(n)}

    # n small states, last_used in id order; keep two; the budget leaves room for three
    enc = encode_state(State.zeros(ModelShape(1, 4, 1, 4, 16, 8, 4, 4, 4, 4), 1), "tiny")

    async def items():
        for i in range(n):
            srow = state_row(f"S{i}", f"TASK_{i}", enc, False)
            srow["last_used"] = 1000.0 + i
            yield dict(rows[i], state_id=f"S{i}", state_pos=1), srow, []

    await store.save_each(items())
    await store.states.touch_states(["S5"], when=5000.0)  # most recently used now: the last to go
    victims, left = await store.states.enforce_budget(3 * enc.nbytes, keep={"S0", "S1"})
    survivors = {"S0", "S1", "S5"}
    assert len(victims) == n - 3 and set(victims) == {f"S{i}" for i in range(n)} - survivors
    assert victims[:3] == ["S2", "S3", "S4"] and left == 3 * enc.nbytes
    assert await store.counts() == {"tasks": n, "states": 3}
    nulls = await run_sql(db_url, "select count(*) from tasks where state_id is null and state_pos = 0")
    assert nulls == [(n - 3,)]
    assert (await store.states.enforce_budget(3 * enc.nbytes, keep=set())) == ([], 3 * enc.nbytes)
    await store.close()


async def test_concurrent_writers_and_readers_on_one_store(db_url):
    """Many coroutines writing (serialized by the store's write lock) and reading (on the pool)
    at once, as the server's writer, requests and budget checks do."""
    store = await open_store(db_url)
    enc = encode_state(rand_state(2), SIG)
    errors: list[BaseException] = []

    async def worker(w: int) -> None:
        try:
            for i in range(5):
                tid = f"TASK_w{w}_{i}"
                await store.save(to_row(task(tid, id=tid, prompt=f"{w}/{i}", state_id=f"S{w}_{i}", state_pos=1)),
                                 state_row(f"S{w}_{i}", tid, enc, False))
                await store.save_progress([{"id": tid, "text": f"text {w}/{i}"}])
                await store.states.touch_states([f"S{w}_{i}"])
                got = from_row(await store.get_task(tid))
                assert (got.prompt, got.out.text) == (f"{w}/{i}", f"text {w}/{i}")
                await Listing(store).list_tasks(None, True, None, 10, 0)
                if i == 4:
                    assert (await store.delete_task(f"TASK_w{w}_0"))[0]
        except BaseException as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    await asyncio.gather(*(worker(w) for w in range(16)), store.states.enforce_budget(1 << 40, set()))
    assert errors == []
    assert await store.counts() == {"tasks": 16 * 4, "states": 16 * 4}
    assert await store.states.states_bytes() == 16 * 4 * enc.nbytes
    assert await store.get_task("TASK_w3_0") is None and await store.states.get_state("S3_0") is None
    await store.close()


async def test_reopen_keeps_everything(db_url):
    """Close the store and open a new one on the same database (a restart): schema untouched,
    rows, states and the interrupted marks all still there."""
    store = await open_store(db_url)
    enc = encode_state(rand_state(4), SIG)
    t = full_task(3)  # FINISHED
    t.state_id, t.state_pos = t.stored_id, t.stored_pos = "S1", 4
    await store.save(to_row(t), state_row("S1", t.id, enc, False))
    await store.save(to_row(task(2, status=2)))
    assert await store.mark_interrupted() == ["TASK_2"]
    await store.close()
    assert store.engine is None
    again = Store(db_url)
    await again.open()
    assert again.revision_before == again.revision == migrate.head_revision()
    assert to_row(from_row(await again.get_task(t.id))) == to_row(t)
    t2 = from_row(await again.get_task("TASK_2"))
    assert (t2.status, t2.finish_reason) == (3, "interrupted")
    assert (await again.states.get_state("S1")).data == enc.data
    assert await again.counts() == {"tasks": 2, "states": 1} and await again.mark_interrupted() == []
    await again.close()
    assert set(await inspect_schema(db_url)) == {"tasks", "states", "instances", "alembic_version", "conversations",
                                                 "conversation_items", "conversation_runs"}


async def test_pg_cluster_listens_on_loopback_only(pg_cluster, pg_url):
    """The fixture's server: loopback TCP on its own port, its socket in its own directory."""
    store = await open_store(pg_url)
    async with store.engine.connect() as conn:
        show = {k: (await conn.exec_driver_sql(f"show {k}")).scalar()
                for k in ("listen_addresses", "port", "unix_socket_directories", "data_directory")}
    await store.close()
    assert show == {"listen_addresses": "127.0.0.1", "port": str(pg_cluster.port),
                    "unix_socket_directories": pg_cluster.dir, "data_directory": pg_cluster.data}
    assert os.path.exists(os.path.join(pg_cluster.dir, f".s.PGSQL.{pg_cluster.port}"))


async def test_a_budget_check_counts_only_the_states_it_dropped(pg_url):
    """Two replicas' budget checks at once (PostgreSQL, read committed): B has deleted S0 and not
    committed when A chooses its victims, S0 among them. A's drop waits for B's commit, then
    drops (and reports, for db_evictions) only the states still there: S0 was B's."""
    a, b = await open_store(pg_url), await open_store(pg_url)
    enc = encode_state(State.zeros(ModelShape(1, 4, 1, 4, 16, 8, 4, 4, 4, 4), 1), "tiny")

    async def items():
        for i in range(4):
            srow = state_row(f"S{i}", f"TASK_{i}", enc, False)
            srow["last_used"] = 1000.0 + i
            yield dict(to_row(task(i)), state_id=f"S{i}", state_pos=1), srow, []

    await a.save_each(items())
    async with b.write() as conn:  # B's own budget check, caught between its delete and its commit
        await conn.execute(sa.text("delete from states where id = 'S0'"))
        racing = asyncio.create_task(a.states.enforce_budget(2 * enc.nbytes, keep=set()))
        await asyncio.sleep(0.5)
        assert not racing.done()  # A waits for B's row lock
    victims, _ = await racing
    assert victims == ["S1"], victims  # S0 is gone by B's hand, S1 by A's; S2 and S3 fit
    assert await a.counts() == {"tasks": 4, "states": 2}
    await a.close()
    await b.close()
