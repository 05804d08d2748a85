"""TaskManager semantics on the real engine (tiny synthetic model, CPU): create, fork, continue,
stop, templates (economy + 50 concurrent forks), streams from a position, owners, delete, FIM."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from server.config import Settings
from server.tasks import TaskConflict, TaskForbidden, TaskInvalid, TaskManager, TaskNotFound, fim_prompt
from server.tasks.streaming import events

GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}


def settings(tmp_path, **kw) -> Settings:
    return Settings(db=str(tmp_path / "tasks.db"), device="cpu", stats_interval=0, default_max_tokens=6, **kw)


@pytest.fixture
async def tm(parts, tmp_path):
    model, tok, eng = parts
    m = TaskManager(eng, tok, settings(tmp_path), model.shape)
    await m.start()
    yield m
    await m.close()


def out_ids(t) -> list[int]:
    return list(t.tokens[t.out_start:t.out_start + t.generated])


async def done(tm, t):
    return await tm.wait(t.id, timeout=60)


async def test_create_tmp_and_persistent(tm, tmp_path):
    t = await tm.create("Hello there", {"max_tokens": 5, **GREEDY}, persistent=True)
    assert t.status in (0, 2, 3)  # PREFILL (a free slot), then RUNNING, FINISHED
    # the row is committed before create() returns (a crash now would not lose the task)
    row = sqlite3.connect(tmp_path / "tasks.db").execute("select status from tasks where id=?", (t.id,)).fetchone()
    assert t.id.startswith("TASK_") and row is not None and row[0] in (0, 1, 2, 3)
    tmp = await tm.create([1, 2, 3], {"max_tokens": 5})
    await done(tm, t), await done(tm, tmp)
    r = t.response()
    assert r["finished"] and r["finish_reason"] == "length" and r["completion_tokens"] == 5
    assert r["result"] and r["prompt_tokens"] == len(tm.tokenizer.encode("Hello there"))
    assert set(r) >= {"task_id", "result", "prefill_time", "gen_time", "speed", "finished"}
    assert tmp.id.startswith("TMP_") and not await tm.store.task_exists(tmp.id)
    assert t.info() == {"task_id": t.id, "generated_buf": 5, "status": 3, "finish_reason": "length"}


async def test_fork_leaves_source_untouched_and_owns_its_output(tm):
    src = await done(tm, await tm.create("The source prompt", {"max_tokens": 6, **GREEDY}, persistent=True))
    await tm.writer.flush()
    before = (list(src.tokens), src.out.text, src.state_id, src.state_pos, dict(src.params),
              tm.cache.get(src.state_id).checksum())
    f1 = await done(tm, await tm.fork(src.id, {"max_tokens": 4, "temperature": 1.0, "seed": 3}, " and a fork"))
    f2 = await done(tm, await tm.fork(src.id, {"max_tokens": 6}))  # no prompt: keeps generating
    after = (list(src.tokens), src.out.text, src.state_id, src.state_pos, dict(src.params),
             tm.cache.get(src.state_id).checksum())
    assert after == before
    assert f1.parent_id == src.id and f1.generated == 4 and f1.out is not src.out
    assert f1.params["temperature"] == 1.0 and f1.params["max_tokens"] == 4 and src.params["max_tokens"] == 6
    # fork without prompt (greedy) == the source never having stopped
    ref = await done(tm, await tm.create("The source prompt", {"max_tokens": 12, **GREEDY}))
    assert out_ids(src) + out_ids(f2) == out_ids(ref)


async def test_continue_with_and_without_prompt(tm):
    t = await done(tm, await tm.create("Once upon a time", {"max_tokens": 6, **GREEDY}, persistent=True))
    first = out_ids(t)
    await done(tm, await tm.continue_(t.id, {"max_tokens": 6}))  # no prompt: the output grows
    ref = await done(tm, await tm.create("Once upon a time", {"max_tokens": 12, **GREEDY}))
    assert out_ids(t) == out_ids(ref) and out_ids(t)[:6] == first and t.generated == 12
    assert t.response()["result"] == ref.out.text
    history = list(t.tokens)  # with a prompt: prefill it, then generate; the output restarts
    await done(tm, await tm.continue_(t.id, {"max_tokens": 5}, " The end."))
    ids = tm.tokenizer.encode(" The end.")
    assert t.generated == 5 and t.prompt == " The end." and t.prompt_tokens == len(ids) + 1
    whole = await done(tm, await tm.create(history + ids, {"max_tokens": 5, **GREEDY}))
    assert out_ids(t) == out_ids(whole) and t.out.text == whole.out.text


async def test_running_task_conflicts_and_stop_by_identity(tm):
    t = await tm.create("Run for a while", {"max_tokens": 100000, **GREEDY}, persistent=True)
    other = await tm.create("A neighbour", {"max_tokens": 40})
    while t.generated < 3:
        await asyncio.sleep(0.01)
    for op in (tm.continue_(t.id), tm.fork(t.id), tm.as_template(t.id)):
        with pytest.raises(TaskConflict):
            await op
    with pytest.raises(TaskInvalid):  # a bad name is bad input, running task or not
        await tm.as_template(t.id, name="a b")
    stopped = await tm.stop(t.id)
    assert stopped.finish_reason == "stopped" and not stopped.running and t.generated < 100000
    assert not (await done(tm, other)).finish_reason == "stopped"  # the neighbour was not touched
    n = t.generated
    await done(tm, await tm.continue_(t.id, {"max_tokens": 3}))  # a stopped task continues
    assert t.generated == n + 3 and t.finish_reason == "length"


async def test_calls_on_a_stopping_task_wait_for_it_to_settle(tm):
    """A run whose stop was asked for (its streaming client left) but has not settled yet: a
    continue or a fork waits for it instead of answering 409; a running task still conflicts."""
    t = await tm.create("Run for a while", {"max_tokens": 100000, **GREEDY}, persistent=True)
    while t.generated < 3:
        await asyncio.sleep(0.01)
    with pytest.raises(TaskConflict):
        await tm.continue_(t.id)
    tm.abort(t)  # as a stream route does when its client goes away: no wait
    assert t.running  # not settled yet
    again = await tm.continue_(t.id, {"max_tokens": 100000})
    assert again is t and t.finish_reason is None and t.running  # the new run
    n = t.generated
    while t.generated < n + 3:
        await asyncio.sleep(0.01)
    tm.abort(t)
    assert t.running
    f = await tm.fork(t.id, {"max_tokens": 2})
    assert t.finish_reason == "stopped" and not t.running and f.parent_id == t.id
    assert (await done(tm, f)).finish_reason == "length"


async def test_template_economy_and_fifty_concurrent_forks(tm):
    doc = " ".join(f"line {i} of a long shared document." for i in range(40))
    base = await done(tm, await tm.create(doc, {"max_tokens": 0, **GREEDY}, persistent=True))
    P = len(tm.tokenizer.encode(doc))
    tpl = await tm.as_template(base.id, name="doc")
    assert tpl.id == "_doc" and await tm.store.task_exists("_doc") and tpl.state_pos == P - 1
    # a fork of P + q tokens prefills q + 1 (the template's held-back last token), not P + q
    q_ids = tm.tokenizer.encode(" Question: what is line 3?")
    stats0 = tm.engine.stats().prompt_tokens_total
    f = await done(tm, await tm.fork("_doc", {"max_tokens": 6}, " Question: what is line 3?"))
    assert f.prompt_tokens == len(q_ids) + 1 < P
    assert tm.engine.stats().prompt_tokens_total - stats0 == len(q_ids) + 1
    full = await done(tm, await tm.create(doc + " Question: what is line 3?", {"max_tokens": 6, **GREEDY}))
    assert full.prompt_tokens == P + len(q_ids) and out_ids(f) == out_ids(full)  # same tokens
    # 50 concurrent forks of a max_tokens=0 template, each generating
    tiers0 = tm.stats()["tiers"]
    forks = await asyncio.gather(*[tm.fork("_doc", {"max_tokens": 4, "temperature": 1.0, "seed": i},
                                           f" Item {i}:", tmp=i % 2 == 0) for i in range(50)])
    forks = await asyncio.gather(*[done(tm, x) for x in forks])
    assert len({x.id for x in forks}) == 50
    assert all(x.generated >= 1 and x.finish_reason in ("length", "stop") for x in forks)
    assert all(x.prompt_tokens == len(tm.tokenizer.encode(f" Item {i}:")) + 1 for i, x in enumerate(forks))
    tiers = tm.stats()["tiers"]  # each fork's state was found in the template tier, and counted there
    assert tiers["templates"]["hits"] - tiers0["templates"]["hits"] >= 50
    assert tiers["tasks_lru"]["hits"] - tiers0["tasks_lru"]["hits"] < 50
    g = await done(tm, await tm.fork("_doc"))  # no max_tokens given: a 0 is not inherited
    assert g.generated == 6 and tpl.state_pos == P - 1 and tpl.generated == 0


async def test_templates_are_read_only_and_private_to_their_key(tm):
    base = await done(tm, await tm.create("template text", {"max_tokens": 0}, persistent=True, owner="k1"))
    tpl = await tm.as_template(base.id, owner="k1")
    assert tpl.id.startswith("_TMPL_") and not tpl.public
    with pytest.raises(TaskForbidden):
        await tm.continue_(tpl.id, owner="k1")
    with pytest.raises(TaskForbidden):
        await tm.delete(tpl.id, owner="k1")
    with pytest.raises(TaskNotFound):
        await tm.get(base.id, "k2")  # another key's task: not found
    for call in (lambda: tm.get(tpl.id, "k2"), lambda: tm.fork(tpl.id, {"max_tokens": 2}, owner="k2"),
                 lambda: tm.fork(tpl.id, tmp=True, owner="k2"), lambda: tm.as_template(tpl.id, "k2"),
                 lambda: tm.delete(tpl.id, owner="k2", force=True),
                 lambda: tm.continue_(tpl.id, owner="k2", force=True)):
        with pytest.raises(TaskNotFound):  # another key's private template: as if it did not exist
            await call()
    f = await done(tm, await tm.fork(tpl.id, {"max_tokens": 2}, owner="k1"))
    listing = await tm.list("k2")
    assert tpl.id not in listing["db_tasks"] and base.id not in listing["db_tasks"] + listing["cpu_tasks"]
    assert {f.id, tpl.id} <= set((await tm.list("k1"))["db_tasks"])
    assert (await tm.delete(tpl.id, owner="k1", force=True)).id == tpl.id
    with pytest.raises(TaskNotFound):
        await tm.get(tpl.id, "k1")
    assert not await tm.store.task_exists(tpl.id)


async def test_template_names_are_per_key_and_published_ones_are_shared(tm):
    a = await done(tm, await tm.create("key one's prompt", {"max_tokens": 0}, persistent=True, owner="k1"))
    b = await done(tm, await tm.create("the prompt of key two", {"max_tokens": 0}, persistent=True, owner="k2"))
    t1 = await tm.as_template(a.id, "k1", name="coder")
    t2 = await tm.as_template(b.id, "k2", name="coder")  # the same name, another key: no conflict
    assert t1.display_id == t2.display_id == "_coder" and t1.id != t2.id and "@" in t1.id
    assert t1.response()["task_id"] == "_coder" and t1.summary()["parent_id"] == a.id
    with pytest.raises(TaskConflict):
        await tm.as_template(a.id, "k1", name="coder")  # k1's own name exists
    assert (await tm.get("_coder", "k1")) is t1 and (await tm.get("_coder", "k2")) is t2
    f = await done(tm, await tm.fork("_coder", {"max_tokens": 1}, owner="k2"))
    assert f.parent_id == t2.id and f.summary()["parent_id"] == "_coder"
    assert list(f.tokens[:len(b.tokens)]) == list(b.tokens)  # k2's template, not k1's
    events_ids = {e["task_id"] async for e in events(t1, 0)}
    assert events_ids == {"_coder"}
    assert (await tm.list("k1"))["db_tasks"].count("_coder") == 1
    # published: every key reads and forks it; only its owner writes it
    pub = await tm.as_template(a.id, "k1", name="shared", public=True)
    assert pub.id == "_shared" and pub.public
    assert (await tm.get("_shared", "k2")) is pub and "_shared" in (await tm.list("k2"))["db_tasks"]
    g = await done(tm, await tm.fork("_shared", {"max_tokens": 1}, owner="k2"))
    with pytest.raises(TaskNotFound):
        await tm.get(g.id, "k1")  # the fork is k2's own
    for call in (lambda: tm.delete("_shared", owner="k2", force=True),
                 lambda: tm.continue_("_shared", owner="k2", force=True)):
        with pytest.raises(TaskForbidden):
            await call()
    # a template made without keys is public too
    c = await done(tm, await tm.create("no keys", {"max_tokens": 0}, persistent=True))
    op = await tm.as_template(c.id, name="operator")
    assert op.public and op.id == "_operator" and (await tm.get("_operator", "k2")) is op


async def test_stream_replays_and_attaches_from_any_position(tm):
    t = await tm.create("Stream me", {"max_tokens": 30, **GREEDY})
    live = [e async for e in events(t, 0)]  # attached while it runs
    text = "".join(e.get("data", "") for e in live)
    assert text == t.out.text and live[-1]["finished"] and live[-1]["usage"]["completion_tokens"] == 30
    assert [e["pos"] for e in live[:-1]] == sorted({e["pos"] for e in live[:-1]})
    for pos in (0, 7, 29, 30):  # replay of a finished task
        got = [e async for e in events(t, pos)]
        assert "".join(e.get("data", "") for e in got) == t.out.text[t.out.char_at(pos):]
    pre = await done(tm, await tm.create("prefill only", {"max_tokens": 0}))
    got = [e async for e in events(pre, 0)]
    assert len(got) == 1 and got[0]["finished"] and got[0]["usage"]["completion_tokens"] == 0


async def test_fim_prompt_delete_list_and_tmp_ttl(tm):
    f = await done(tm, await tm.fim("def add(a, b):\n", "\n\nprint(add(1, 2))", {"max_tokens": 3}))
    assert fim_prompt("P", "S") == "✿prefix✿✿suffix✿S✿middle✿P"
    assert list(f.tokens[:f.prompt_len]) == tm.tokenizer.encode(fim_prompt("def add(a, b):\n", "\n\nprint(add(1, 2))"))
    p = await done(tm, await tm.create("keep me", {"max_tokens": 2}, persistent=True))
    listing = await tm.list(limit=1)
    assert listing["total_count"] == 2 and len(listing["tasks"]) == 1 and listing["database_count"] == 1
    assert set(listing["cpu_tasks"]) >= {f.id}
    await tm.delete(p.id)
    with pytest.raises(TaskNotFound):
        await tm.get(p.id)
    assert not await tm.store.task_exists(p.id) and (await tm.store.counts())["states"] == 0
    assert tm.sweep(cutoff=f.finished_at + 1) == 1
    with pytest.raises(TaskNotFound):
        await tm.get(f.id)


@pytest.mark.parametrize("reader", ["get", "fork", "as_template"])
async def test_a_read_that_overlaps_a_delete_does_not_bring_the_task_back(tm, reader):
    # The delete drops the task from memory, then waits for its row's delete to commit; a read
    # in that window reads the row from the database and used to keep it as recently read: the
    # deleted task answered (and forked) again until a restart.
    t = await done(tm, await tm.create("soon gone", {"max_tokens": 2}, persistent=True))
    await tm.writer.flush()
    calls = {"get": lambda: tm.get(t.id), "fork": lambda: tm.fork(t.id, {"max_tokens": 1}),
             "as_template": lambda: tm.as_template(t.id, name=f"zombie_{reader}")}
    res = await asyncio.gather(tm.delete(t.id), calls[reader](), return_exceptions=True)
    assert not isinstance(res[0], BaseException)
    with pytest.raises(TaskNotFound):
        await tm.get(t.id)
    assert t.id not in tm.table.recent and t.id not in tm.table.live
    assert t.id not in (await tm.list())["cpu_tasks"]
    if reader == "fork" and not isinstance(res[1], BaseException):
        await done(tm, res[1])  # a fork that won the race is a task of its own
