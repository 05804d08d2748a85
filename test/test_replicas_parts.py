"""Replicas at the TaskManager level: two managers (two "servers", scripted engines) on one
SQLite file. A stream of a task running elsewhere is refused naming the instance; a copy of a
task that another replica changed is not used (read again; a continue from an old copy is
refused by the database and retried on the fresh one); an instance whose lease expired cannot
overwrite what the others did with its tasks."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.tasks import TaskConfig, TaskElsewhere, TaskManager, TaskNotFound
from server.tasks.schema import instances
from server.tasks.streaming import events

# Long enough that no test here sees a lease expire by accident (a loaded CI loop stalled a
# 0.6 s one: b reaped a's task mid-test); the tests about expiry set heartbeat_at=0 themselves.
LEASE = 5.0


async def replica(eng: FakeEngine, path, name: str, lease: float = LEASE) -> TaskManager:
    cfg = TaskConfig(db=str(path), default_max_tokens=3, lease_timeout=lease, instance_name=name,
                     public_url=f"http://{name}.internal:8000")
    tm = TaskManager(eng, FakeTokenizer(), cfg, FakeShape())
    await tm.start()
    return tm


async def until(cond, timeout: float = 10.0) -> None:
    async def loop():
        while not await cond():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(loop(), timeout)


async def test_streams_and_writes_of_a_task_running_elsewhere_name_its_instance(tmp_path):
    ea, eb = FakeEngine(gate=asyncio.Event()), FakeEngine()
    a, b = await replica(ea, tmp_path / "r.db", "a"), await replica(eb, tmp_path / "r.db", "b")
    try:
        t = await a.create("runs on a", persistent=True)
        seen = await b.get(t.id)  # readable: the row a committed, and who runs it
        assert seen.running and seen.instance == a.instance and seen.response()["instance"] == a.instance
        for call in (lambda: b.get(t.id, stream=True), lambda: b.continue_(t.id),
                     lambda: b.stop(t.id), lambda: b.delete(t.id), lambda: b.fork(t.id)):
            with pytest.raises(TaskElsewhere) as e:
                await call()
            assert e.value.status == 409 and e.value.instance == a.instance
            assert "http://a.internal:8000" in e.value.message
        assert (await a.get(t.id, stream=True)) is t  # its own instance streams it
        got = [e async for e in events(seen, 0, ping=None)]  # a stream that was not refused ends at once
        assert got[-1]["error"]["message"].endswith("(http://a.internal:8000); stream it there")
        ea.gate.set()
        await a.wait(t.id, timeout=10)
        await a.flush()
        await until(lambda: _finished_on(b, t.id))
        c = await b.wait((await b.continue_(t.id, {"max_tokens": 2})).id, timeout=10)  # now b may
        assert c.out.text == "<100><101><102><100><101>" and eb.submissions[-1].init_state is not None
    finally:
        await a.close()
        await b.close()


async def _finished_on(tm: TaskManager, task_id: str) -> bool:
    return not (await tm.get(task_id)).running


async def test_a_copy_changed_by_another_replica_is_not_used(tmp_path):
    ea, eb = FakeEngine(), FakeEngine()
    a = await replica(ea, tmp_path / "s.db", "a")
    t = await a.wait((await a.create("shared", persistent=True)).id, timeout=10)
    await a.flush()
    b = await replica(eb, tmp_path / "s.db", "b")
    try:
        a.lease._task.cancel()  # no heartbeat for now: a has not seen b yet, and trusts its copy
        a.lease.peers = {}
        await b.wait((await b.continue_(t.id, {"max_tokens": 2})).id, timeout=10)
        assert (await a.get(t.id)) is t and t.out.text == "<100><101><102>"  # the old copy
        # a continues from its old copy: the database refuses the claim, a reads the task again
        c = await a.wait((await a.continue_(t.id, {"max_tokens": 1})).id, timeout=10)
        assert c is not t and c.out.text == "<100><101><102><100><101><100>" and c.version == 2
        await b.lease.beat()  # b's row fresh
        await a.lease.beat()  # once a knows b, every read checks its copy against the row
        assert a.lease.shared
        await b.wait((await b.continue_(t.id, {"max_tokens": 1})).id, timeout=10)
        fresh = await a.get(t.id)
        assert fresh is not c and fresh.out.text.endswith("<100><100>") and fresh.version == 3
        await b.delete(t.id)
        with pytest.raises(Exception, match="not found"):
            await a.get(t.id)
    finally:
        await a.close()
        await b.close()


async def test_a_delete_from_an_old_copy_never_removes_a_task_running_elsewhere(tmp_path):
    """b holds a finished copy it trusts (b has not seen a: no row check on reads) while a runs
    the task: b's delete is refused by the database (409 naming a), the row and a's run stay."""
    ea, eb = FakeEngine(gate=asyncio.Event()), FakeEngine()
    a = await replica(ea, tmp_path / "d.db", "a")
    ea.gate.set()
    t = await a.wait((await a.create("shared", persistent=True)).id, timeout=10)
    await a.flush()
    b = await replica(eb, tmp_path / "d.db", "b")
    try:
        b.lease._task.cancel()
        b.lease.peers = {}
        old = await b.get(t.id)
        assert not old.running
        ea.gate.clear()
        await a.continue_(t.id, {"max_tokens": 2})  # runs on a (held at the gate)
        with pytest.raises(TaskElsewhere) as e:
            await b.delete(t.id)
        assert e.value.instance == a.instance
        assert await b.store.task_exists(t.id) and (await a.get(t.id)).running
        ea.gate.set()
        assert (await a.wait(t.id, timeout=10)).out.text == "<100><101><102><100><101>"
    finally:
        await a.close()
        await b.close()


async def test_an_instance_whose_lease_expired_cannot_overwrite_its_tasks(tmp_path):
    ea, eb = FakeEngine(gate=asyncio.Event()), FakeEngine()
    a = await replica(ea, tmp_path / "l.db", "a")
    b = await replica(eb, tmp_path / "l.db", "b")
    try:
        t = await a.create("a stalls", persistent=True)
        a.lease._task.cancel()  # a stops heartbeating (a stalled process, a database outage)
        async with a.store.write() as conn:  # ... long enough for b to take a for dead
            await conn.execute(sa.update(instances).where(instances.c.id == a.instance).values(heartbeat_at=0))
        assert t.id in await b.lease.beat()
        seen = await b.get(t.id)
        assert seen.finish_reason == "interrupted" and not seen.running
        c = await b.wait((await b.continue_(t.id, {"max_tokens": 2})).id, timeout=10)  # b goes on with it
        ea.gate.set()  # a's run ends: its final row is refused, it shows the task interrupted
        await until(lambda: _not_running(t))
        assert t.finish_reason == "interrupted" and t.id not in a.live
        await a.flush()
        row = await a.store.get_task(t.id)
        assert row.text == c.out.text and row.instance is None  # b's result stands
        assert (await a.get(t.id)).out.text == c.out.text  # a reads it again from the database
        await a.lease.beat()  # a finds its lease gone and registers again
        assert a.lease.lost == 1
    finally:
        await a.close()
        await b.close()


async def test_after_its_lease_expired_an_instance_stops_only_the_tasks_taken_from_it(tmp_path):
    # It used to abort every task it was running, also those it had accepted after the others
    # had taken its old ones: they ended "interrupted" although nobody else had touched them.
    ea = FakeEngine(gate=asyncio.Event())
    a, b = await replica(ea, tmp_path / "k.db", "a"), await replica(FakeEngine(), tmp_path / "k.db", "b")
    try:
        old = await a.create("taken over", persistent=True)
        a.lease._task.cancel()
        b.lease._task.cancel()  # b beats only when told: its loop could take old first
        async with a.store.write() as conn:
            await conn.execute(sa.update(instances).where(instances.c.id == a.instance).values(heartbeat_at=0))
        assert old.id in await b.lease.beat()
        new = await a.create("accepted since", persistent=True)  # before a's next heartbeat
        await a.lease.beat()
        a.takeover.lost()  # what a's heartbeat loop calls when it finds its lease gone
        await asyncio.gather(*a.takeover.background)
        # old's run is aborted as "interrupted": the flag stands until its settle reads it (and in
        # the same step sets old.run None), which on a loaded machine may come before this line
        assert old.stop_requested and (old.interrupted or old.run is None)
        assert new.running and not new.stop_requested and not new.interrupted
        await until(lambda: _not_running(old))
        assert old.finish_reason == "interrupted"
        ea.gate.set()
        assert (await a.wait(new.id, timeout=10)).finish_reason == "length"
    finally:
        await a.close()
        await b.close()


async def test_each_instance_is_judged_by_its_own_lease_timeout(tmp_path):
    # Replicas with different --lease-timeout values reaped each other's live tasks: one with a
    # short timeout took a peer that heartbeats at a third of a longer one for dead.
    slow = await replica(FakeEngine(gate=asyncio.Event()), tmp_path / "m.db", "slow", lease=30.0)
    quick = await replica(FakeEngine(), tmp_path / "m.db", "quick", lease=0.3)
    try:
        t = await slow.create("runs on slow", persistent=True)
        async with slow.store.write() as conn:  # slow's last heartbeat 2 s ago: alive by its 30 s
            now = await slow.store.db_now(conn)
            await conn.execute(sa.update(instances).where(instances.c.id == slow.instance).values(heartbeat_at=now - 2))
        assert t.id not in await quick.lease.beat() and slow.instance in quick.lease.peers
        assert (await quick.get(t.id)).running
        async with slow.store.write() as conn:  # 40 s: past its own timeout, so dead
            await conn.execute(sa.update(instances).where(instances.c.id == slow.instance).values(heartbeat_at=now - 40))
        assert t.id in await quick.lease.beat()
    finally:
        slow.engine.gate.set()
        await slow.close()
        await quick.close()


async def _not_running(t) -> bool:
    return not t.running


@pytest.mark.parametrize("how", ["as_template", "upload"])
async def test_one_template_name_taken_on_two_replicas_at_once_has_one_winner(tmp_path, how):
    # Each checked the name in its own memory and then upserted its row: both answered, and the
    # second silently overwrote the template the first had acknowledged (or, on PostgreSQL, hit
    # a unique violation: a 500).
    from server.tasks import TaskConflict
    from server.tasks.imports import template_from_state
    from task_fakes import counted_state

    a, b = await replica(FakeEngine(), tmp_path / "n.db", "a"), await replica(FakeEngine(), tmp_path / "n.db", "b")
    try:
        srcs = [await m.wait((await m.create(p, persistent=True)).id, timeout=10) for m, p in ((a, "x"), (b, "y"))]
        await a.flush(), await b.flush()
        if how == "as_template":
            calls = [m.as_template(s.id, name="shared") for m, s in zip((a, b), srcs)]
        else:
            calls = [template_from_state(m, "shared", counted_state(3)) for m in (a, b)]
        res = await asyncio.gather(*calls, return_exceptions=True)
        won = [r for r in res if not isinstance(r, BaseException)]
        assert len(won) == 1 and sum(isinstance(r, TaskConflict) for r in res) == 1, res
        row = await a.store.get_task("_shared")
        assert row.parent_id == won[0].parent_id and row.status == 3  # the winner's, finished
        for m in (a, b):  # both read the winner's
            assert (await m.get("_shared")).parent_id == won[0].parent_id
    finally:
        await a.close()
        await b.close()


async def test_a_template_deleted_on_another_replica_is_gone_on_its_maker(tmp_path):
    a, b = await replica(FakeEngine(), tmp_path / "d.db", "a"), await replica(FakeEngine(), tmp_path / "d.db", "b")
    try:
        src = await a.wait((await a.create("x", persistent=True)).id, timeout=10)
        await a.flush()
        tpl = await a.as_template(src.id, name="gone")

        async def shared():
            return a.lease.shared

        await until(shared)  # a has seen b (copies of tasks may go stale from now on)
        await b.delete(tpl.id, force=True)
        with pytest.raises(TaskNotFound):
            await a.get("_gone")
        with pytest.raises(TaskNotFound):
            await a.fork("_gone")
    finally:
        await a.close()
        await b.close()


async def test_a_copy_read_before_its_state_was_written_is_read_again(tmp_path):
    """b reads a's finished task before a's write-behind stores its state: the row changes only
    its state_id then. b's copy named no stored state for good (every fork of it on b fed the
    whole history again, QA saw it minutes later); now b reads the row again and forks from the
    stored state."""
    ea, eb = FakeEngine(), FakeEngine()
    # a lease of 5 s: nothing here waits for one to expire, and a CI run's loaded loop let the
    # 0.6 s one of `a` lapse (b took its task over, so its state was never stored)
    a, b = await replica(ea, tmp_path / "w.db", "a", 5.0), await replica(eb, tmp_path / "w.db", "b", 5.0)
    try:
        await a.lease.beat()
        await b.lease.beat()
        assert a.lease.shared and b.lease.shared
        t = await a.create("written behind", persistent=True)
        await a.wait(t.id, timeout=10)
        await until(lambda: _finished_on(b, t.id))
        early = await b.get(t.id)
        assert early.stored_id is None or early.stored_id == t.stored_id
        await a.flush()  # a's state lands in the database
        assert t.stored_id is not None
        fresh = await b.get(t.id)
        assert fresh.stored_id == t.stored_id and fresh.state == "stored"
        f = await b.wait((await b.fork(t.id, {"max_tokens": 1})).id, timeout=10)
        assert eb.submissions[-1].init_state is not None and len(eb.submissions[-1].prompt) == 1  # the pending token
        assert f.finish_reason == "length"
    finally:
        await a.close()
        await b.close()


async def test_a_conversation_run_continued_elsewhere_is_left_to_its_live_maker(tmp_path):
    """A response made on A, its task continued on B before A's background join wrote (its
    version moved): a read on B leaves the run to A, whose join read the output as the run ended,
    while A lives; once A's lease is gone B drops it, nothing joining (server.api.responses.joins)."""
    from server.api.responses.joins import settle

    a, b = await replica(FakeEngine(), tmp_path / "c.db", "a"), await replica(FakeEngine(), tmp_path / "c.db", "b")
    try:
        conv = await b.conversations.create(None, {}, [])
        t = await a.wait((await a.create("a response", persistent=True, tag="response")).id, timeout=10)
        await a.flush()
        await a.conversations.begin_run(conv, t.id, t.version, a.instance)
        await until(lambda: _finished_on(b, t.id))
        await b.wait((await b.continue_(t.id, {"max_tokens": 2})).id, timeout=10)
        await until(lambda: _sees(b, a.instance))
        await settle(b, conv.id, None)
        assert [r.task_id for r in await b.conversations.runs(conv.id)] == [t.id]  # left to A
    finally:
        await a.close()
    try:
        await until(lambda: _gone(b, a.instance))
        c = await settle(b, conv.id, None)
        assert await b.conversations.runs(conv.id) == [] and c.last_seq == 0  # dropped, nothing joined
    finally:
        await b.close()


async def _sees(tm: TaskManager, instance: str) -> bool:
    return instance in tm.lease.peers


async def _gone(tm: TaskManager, instance: str) -> bool:
    return instance not in tm.lease.peers
