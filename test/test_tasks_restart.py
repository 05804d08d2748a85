"""TaskManager across restarts and under budgets (real engine, tiny model, real SQLite files):
continue after a restart == never stopping, a crash image marks running tasks interrupted,
byte budgets hold under churn (templates survive), foreign-shape states are refused."""

from __future__ import annotations

import asyncio
import os
import sqlite3

import pytest
import torch

from server.config import Settings
from server.tasks import TaskConflict, TaskManager, pump
from server.tasks.codec import encode_state
from server.tasks.records import Task, to_row
from server.tasks.statestore import state_row

GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}


async def manager(parts, db, **kw) -> TaskManager:
    model, tok, eng = parts
    s = Settings(db=str(db), device="cpu", stats_interval=0, default_max_tokens=6, **kw)
    m = TaskManager(eng, tok, s, model.shape)
    await m.start()
    return m


def out_ids(t) -> list[int]:
    return list(t.tokens[t.out_start:t.out_start + t.generated])


async def test_continue_after_restart_equals_never_stopping(parts, tmp_path):
    db = tmp_path / "r.db"
    tm = await manager(parts, db)
    t = await tm.wait((await tm.create("A story about a cat", {"max_tokens": 8, **GREEDY}, persistent=True)).id)
    ref = await tm.wait((await tm.create("A story about a cat", {"max_tokens": 20, **GREEDY})).id)
    await tm.close()
    tm = await manager(parts, db)  # a new process: everything comes from the database
    loaded = await tm.get(t.id)
    assert loaded is not t and loaded.out.text == t.out.text and loaded.state_pos == t.state_pos
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 12})).id)
    assert out_ids(loaded) == out_ids(ref) and tm.counters["db_state_loads"] == 1
    assert loaded.prompt_tokens == 1  # only the pending token was fed: the state came from disk
    await tm.close()


def crash_image(src, dst) -> None:
    """What a SIGKILL leaves: the committed content of a WAL database at this instant."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


async def test_running_tasks_become_interrupted_and_continuable(parts, tmp_path, monkeypatch):
    monkeypatch.setattr(pump, "PROGRESS_INTERVAL", 0.02)
    db = tmp_path / "live.db"
    tm = await manager(parts, db)
    done = await tm.wait((await tm.create("finished one", {"max_tokens": 4}, persistent=True)).id)
    tpl = await tm.as_template(done.id, name="kept")
    t = await tm.create("A long run", {"max_tokens": 100000, **GREEDY}, persistent=True)
    while t.generated < 12:
        await asyncio.sleep(0.02)
    for _ in range(1500):  # a progress write lands (committed by the writer: a loaded machine may take a while)
        row = await tm.store.get_task(t.id)
        if row.completion_tokens > 0 and row.text:
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail(f"no progress row of {t.id} was committed")
    crash_image(db, tmp_path / "crash.db")
    await tm.stop(t.id)
    await tm.close()
    tm = await manager(parts, tmp_path / "crash.db")
    assert tm.interrupted == [t.id]
    back = await tm.get(t.id)
    assert back.finish_reason == "interrupted" and back.status == 3 and back.generated > 0
    assert t.out.text.startswith(back.out.text) and back.out.text
    assert (await tm.get(done.id)).out.text == done.out.text and (await tm.get("_kept")).id == tpl.id
    n = back.generated
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 5})).id)  # its history is re-fed
    ref = await tm.wait((await tm.create("A long run", {"max_tokens": n + 5, **GREEDY})).id)
    assert out_ids(back) == out_ids(ref)
    await tm.close()


def schema_bytes(db) -> int:
    """The bytes of an SQLite file's schema: its first page and one root page per table and index
    (64 KiB pages: server/tasks/sqlitefile.py)."""
    with sqlite3.connect(db) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        trees = conn.execute("SELECT count(*) FROM sqlite_master WHERE rootpage > 0").fetchone()[0]
    return (1 + trees) * page


async def test_byte_budgets_hold_under_churn_and_templates_survive(parts, tmp_path):
    one = parts[0].shape.state_bytes(torch.float32, torch.float32)
    db = tmp_path / "b.db"
    tm = await manager(parts, db, state_cache_bytes=4 * one, db_budget_bytes=6 * one, writer_queue=4)
    base = await tm.wait((await tm.create("the template", {"max_tokens": 0}, persistent=True)).id)
    tpl = await tm.as_template(base.id, name="tpl")
    first = await tm.wait((await tm.create("evict me", {"max_tokens": 3, **GREEDY}, persistent=True)).id)
    peak = 0
    for round_ in range(6):  # 60 stored states = 10x the database budget
        batch = [await tm.create(f"churn {round_} {i}", {"max_tokens": 2}, persistent=True) for i in range(10)]
        await asyncio.gather(*[tm.wait(x.id) for x in batch])
        peak = max(peak, tm.cache.stats()["lru_bytes"])
    await tm.flush()
    assert peak <= 4 * one and tm.cache.stats()["pinned_count"] == 0
    assert await tm.store.states.states_bytes(templates=False) <= 6 * one and tm.counters["db_evictions"] >= 50
    size = os.path.getsize(db) - schema_bytes(db)  # (the schema's pages are no churn)
    assert size < 60 * one // 2, f"database file of {size} bytes past its schema for a {6 * one}-byte budget"
    assert len(tm.live) <= 2  # finished stored tasks leave the live set
    f = await tm.wait((await tm.fork("_tpl", {"max_tokens": 2}, " hi")).id)
    assert f.prompt_tokens == len(tm.tokenizer.encode(" hi")) + 1  # template state still there
    assert await tm.store.states.get_state(tpl.state_id) is not None
    evicted = await tm.get(first.id)  # its state is gone, its text stays; continuing recomputes
    assert evicted.out.text == first.out.text
    # gone everywhere, and the task says so: the budget drops only states no cache holds
    assert evicted.state_id is None and evicted.state_pos == 0
    t2 = await tm.as_template(first.id, name="from-evicted")  # prefills the history once
    assert t2.state_pos == len(t2.tokens) - 1 and t2.out.text == first.out.text
    assert (await tm.wait((await tm.fork(t2.id, {"max_tokens": 2})).id)).prompt_tokens == 1
    await tm.wait((await tm.continue_(first.id, {"max_tokens": 3})).id)
    ref = await tm.wait((await tm.create("evict me", {"max_tokens": 6, **GREEDY})).id)
    assert out_ids(evicted) == out_ids(ref)
    await tm.close()


async def test_no_task_names_a_state_the_database_dropped(parts, tmp_path):
    """A database budget below the cache's: the budget drops states the cache still holds (those
    last); each leaves the cache too, and its task says state_id None, as its row does."""
    one = parts[0].shape.state_bytes(torch.float32, torch.float32)
    tm = await manager(parts, tmp_path / "n.db", state_cache_bytes=8 * one, db_budget_bytes=2 * one)
    ids = [(await tm.wait((await tm.create(f"task {i}", {"max_tokens": 2}, persistent=True)).id)).id
           for i in range(6)]
    await tm.flush()
    assert await tm.store.states.states_bytes(templates=False) <= 2 * one and tm.counters["db_evictions"] >= 4
    named = []
    for i in ids:
        t = await tm.get(i)
        if t.state_id is not None:
            named.append(t.state_id)
            assert await tm.store.states.get_state(t.state_id) is not None, f"{i} names a dropped state"
        assert (t.state_id is None) == ((await tm.store.get_task(i)).state_id is None)
    assert len(named) == 2  # the two newest fit the budget
    for sid in tm.cache.keys():
        assert await tm.store.states.get_state(sid) is not None, f"cache holds {sid}, gone from the database"
    await tm.close()


async def test_a_lower_database_budget_after_a_restart_holds_at_start(parts, tmp_path):
    """A restart with a lower --db-budget-bytes drops the states past it as it starts (QA: an idle
    server stayed at 4x its budget until its next state write); the tasks that named them say so."""
    one = parts[0].shape.state_bytes(torch.float32, torch.float32)
    db = tmp_path / "r.db"
    tm = await manager(parts, db, db_budget_bytes=10 * one)
    ids = [(await tm.wait((await tm.create(f"task {i}", {"max_tokens": 2}, persistent=True)).id)).id
           for i in range(5)]
    await tm.flush()
    await tm.close()
    tm = await manager(parts, db, db_budget_bytes=2 * one)
    assert await tm.store.states.states_bytes(templates=False) <= 2 * one
    assert tm.db_state_bytes <= 2 * one  # the figure /metrics shows, as the database holds
    named = [t.state_id for t in [await tm.get(i) for i in ids] if t.state_id is not None]
    assert len(named) == 2 and all([await tm.store.states.get_state(sid) is not None for sid in named])
    await tm.close()


async def test_state_of_another_model_shape_is_refused(parts, tmp_path):
    from server.model.synthetic import parse_spec
    from server.model.state import State

    other, _ = parse_spec("synthetic:0.1b")
    tm = await manager(parts, tmp_path / "s.db")
    enc = encode_state(State.zeros(other, 1), other.signature())
    t = Task(id="TASK_foreign", kind="task", state_id="S_foreign", state_pos=1, stored_id="S_foreign", stored_pos=1)
    t.tokens.extend([5, 6])
    await tm.store.save(to_row(t), state_row("S_foreign", t.id, enc, False))
    with pytest.raises(TaskConflict, match="rwkv7-L12-C768.*cannot be used with this model"):
        await tm.continue_("TASK_foreign", {"max_tokens": 2})
    assert not (await tm.get("TASK_foreign")).running
    await tm.close()


async def test_state_in_use_is_never_evicted_and_tmp_tasks_expire(parts, tmp_path):
    one = parts[0].shape.state_bytes(torch.float32, torch.float32)
    tm = await manager(parts, tmp_path / "p.db", state_cache_bytes=one, tmp_task_ttl=0.3)
    src = await tm.wait((await tm.create("source", {"max_tokens": 2})).id)
    key = src.state_id
    f = await tm.fork(src.id, {"max_tokens": 100000, "ignore_eos": True}, tmp=True)  # (sampled: runs until stopped)
    assert key in tm.cache.pinned_keys()  # the running fork holds its starting state
    for i in range(4):  # churn a one-state LRU
        await tm.wait((await tm.create(f"churn {i}", {"max_tokens": 1})).id)
    assert key in tm.cache and tm.cache.stats()["lru_bytes"] <= one
    await tm.stop(f.id)
    assert key not in tm.cache.pinned_keys() and f.finish_reason == "stopped"
    await asyncio.sleep(0.6)  # finished TMP_ tasks are dropped tmp_task_ttl seconds later
    assert not [t for t in tm.live.values() if t.kind == "tmp"]
    await tm.close()


async def test_budget_query_runs_only_when_the_budget_may_be_exceeded(parts, tmp_path, monkeypatch):
    """Each stored state adds its bytes to an upper bound of the database's state bytes; the
    budget query (a scan of all states) runs only once that bound passes the budget, and then
    resets the bound to the true total."""
    one = parts[0].shape.state_bytes(torch.float32, torch.float32)
    tm = await manager(parts, tmp_path / "q.db", db_budget_bytes=3 * one)
    calls = []
    real = tm.store.states.enforce_budget

    async def counted(budget, keep, prefer=()):
        calls.append(budget)
        return await real(budget, keep, prefer)

    monkeypatch.setattr(tm.store.states, "enforce_budget", counted)
    for i in range(3):  # three states fit: no query
        await tm.wait((await tm.create(f"fits {i}", {"max_tokens": 2, **GREEDY}, persistent=True)).id)
    await tm.flush()
    assert calls == [] and tm.db_state_bytes == 3 * one
    await tm.wait((await tm.create("one more", {"max_tokens": 2, **GREEDY}, persistent=True)).id)
    await tm.flush()
    assert calls == [3 * one]  # the fourth may exceed the budget: checked, the oldest dropped
    assert tm.db_state_bytes == await tm.store.states.states_bytes(templates=False) <= 3 * one
    await tm.close()


async def test_tasks_finishing_together_commit_in_one_transaction(parts, tmp_path, monkeypatch):
    """Six persistent tasks start while the writer is busy: their six rows are one insert
    transaction; they finish while it is busy again: their six settle rows are one update
    transaction, each task shown finished at that commit; their six states follow, written
    behind, one transaction each."""
    monkeypatch.setattr(pump, "PROGRESS_INTERVAL", 1e12)  # no progress job among them
    tm = await manager(parts, tmp_path / "g.db")
    calls: dict[str, list[int]] = {"rows": [], "owned": [], "states": []}
    real_rows, real_owned, real_state = tm.store.save_rows, tm.store.update_owned, tm.store.states.store_state

    async def save_rows(batch):
        calls["rows"].append(len(batch))
        await real_rows(batch)

    async def update_owned(batch, instance):
        calls["owned"].append(len(batch))
        return await real_owned(batch, instance)

    async def store_state(*a):
        calls["states"].append(1)
        return await real_state(*a)

    monkeypatch.setattr(tm.store, "save_rows", save_rows)
    monkeypatch.setattr(tm.store, "update_owned", update_owned)
    monkeypatch.setattr(tm.store.states, "store_state", store_state)
    gate, gate2 = asyncio.Event(), asyncio.Event()
    await tm.writer.put(gate.wait)
    creates = [asyncio.create_task(tm.create(f"burst {i}", {"max_tokens": 2, **GREEDY}, persistent=True))
               for i in range(6)]
    while tm.writer.queue.qsize() < 6:
        await asyncio.sleep(0.01)
    await tm.writer.put(gate2.wait)  # behind the rows: the settles queue up after it
    gate.set()
    tasks = [await c for c in creates]
    while tm.writer.queue.qsize() < 6:
        await asyncio.sleep(0.01)
    assert all(t.running for t in tasks)  # generated, not shown finished before the commit
    gate2.set()
    done = [await tm.wait(t.id) for t in tasks]
    await tm.flush()
    assert calls == {"rows": [6], "owned": [6], "states": [1] * 6}
    for t in done:
        assert t.finish_reason == "length" and len(out_ids(t)) == 2 and t.state == "stored"
        assert await tm.store.states.get_state(t.state_id) is not None
    await tm.close()


async def test_a_lower_limit_after_restart_caps_inherited_max_tokens(parts, tmp_path):
    """A task made under no limit keeps max_tokens=40 in its parameters; after a restart with
    max_tokens_limit=5 its continue (no max_tokens given) and its fork generate 5, not 40."""
    db = tmp_path / "lim.db"
    tm = await manager(parts, db)
    t = await tm.wait((await tm.create("Limits", {"max_tokens": 40, "ignore_eos": True, **GREEDY},
                                       persistent=True)).id)
    assert t.generated == 40
    await tm.close()
    tm = await manager(parts, db, max_tokens_limit=5)
    c = await tm.wait((await tm.continue_(t.id, {})).id)
    assert c.generated == 40 + 5  # a continue without a prompt extends the output
    f = await tm.wait((await tm.fork(t.id, {}, " more")).id)
    assert f.generated == 5
    await tm.close()


async def test_a_prompt_that_is_not_text_is_refused_before_anything_starts(parts, tmp_path):
    from server.tasks import TaskInvalid

    tm = await manager(parts, tmp_path / "bad.db")
    with pytest.raises(TaskInvalid, match="not valid text"):
        await tm.create("a\ud800b", {"max_tokens": 2}, persistent=True)
    t = await tm.wait((await tm.create("fine", {"max_tokens": 1}, persistent=True)).id)
    with pytest.raises(TaskInvalid):
        await tm.continue_(t.id, {}, "x\udfff")
    listed = await tm.list(None)
    assert [x["task_id"] for x in listed["tasks"]] == [t.id] and tm.engine.stats().running == 0
    await tm.close()


async def test_a_shutdown_says_what_it_interrupts(parts, tmp_path, caplog):
    tm = await manager(parts, tmp_path / "bye.db")
    long = {"max_tokens": 100000, "ignore_eos": True}  # (sampled: both run until the shutdown)
    stored = await tm.create("A long run", long, persistent=True)
    tmp = await tm.create("A temporary one", long)
    while stored.generated < 2 or tmp.generated < 2:
        await asyncio.sleep(0.02)
    with caplog.at_level("INFO", logger="server.tasks"):
        await tm.close()
    assert "2 running task(s) end as interrupted (1 stored" in caplog.text and "1 temporary: gone" in caplog.text
    assert stored.finish_reason == tmp.finish_reason == "interrupted"
