"""Where states live (issues 20 and 22): finished TMP_ tasks keep their text for the TTL but their
states only within a byte bound of their own (tier "tmp"; a dropped one is rebuilt when forked or
continued); the database tier's bytes drop as soon as a task is deleted; the write-behind lane
is bounded in bytes (the states it drops are rebuilt later); the `fp16` storage dtype halves a
stored fp32 WKV state. Scripted engine, real SQLite files."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch
from task_fakes import FakeEngine, FakeShape, FakeTokenizer, consumed, counted_state

from server.tasks import TaskConfig, TaskManager
from server.tasks.behind import Pending, StateLane
from server.tasks.codec import decode_state, encode_state

ONE = counted_state(0).nbytes()


async def manager(eng: FakeEngine, path, **kw) -> TaskManager:
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3, **kw), FakeShape())
    await tm.start()
    return tm


async def test_tmp_states_are_bounded_in_bytes_and_their_tasks_stay_usable(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "t.db", tmp_state_bytes=int(2.5 * ONE))
    try:
        tasks = [await tm.wait((await tm.create(f"p{i}")).id, timeout=10) for i in range(8)]
        tier = tm.stats()["tiers"]["tmp"]
        assert tier == {"bytes": 2 * ONE, "entries": 2, "hits": 0}  # the two newest
        assert tm.stats()["tiers"]["tasks_lru"]["entries"] == 0  # not in the tasks' LRU
        assert [t.state for t in tasks] == ["rebuild"] * 6 + ["cached"] * 2
        assert [t.out.text for t in tasks] == ["<100><101><102>"] * 8 and all(t.id in tm.live for t in tasks)
        f = await tm.wait((await tm.fork(tasks[0].id, {"max_tokens": 1}, tmp=True)).id, timeout=10)
        sub = eng.submissions[-1]
        assert sub.init_state is None and sub.prompt == list(tasks[0].tokens)  # rebuilt from its tokens
        assert f.out.text == "<100>" and tm.counters["rebuilds"] == 1
        g = await tm.wait((await tm.fork(tasks[7].id, {"max_tokens": 1}, tmp=True)).id, timeout=10)
        assert eng.submissions[-1].prompt == [tasks[7].tokens[-1]] and g.out.text == "<100>"  # cached: no rebuild
        assert tm.stats()["tiers"]["tmp"]["hits"] >= 1  # found in the tmp tier, counted there
        c = await tm.wait((await tm.continue_(tasks[1].id, {"max_tokens": 1})).id, timeout=10)
        assert eng.submissions[-1].init_state is None and c.out.text == "<100><101><102><100>"
        assert tm.stats()["tiers"]["tmp"]["bytes"] <= 2.5 * ONE
        assert tm.stats()["counters"]["rebuild_tokens"] == 2 * (len(tasks[0].tokens) - 1)
    finally:
        await tm.close()


async def test_the_database_tier_drops_at_delete(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "d.db")
    try:
        ts = [await tm.wait((await tm.create(f"keep {i}", persistent=True)).id, timeout=10) for i in range(3)]
        await tm.flush()
        assert tm.stats()["tiers"]["database"]["bytes"] == 3 * ONE
        await tm.delete(ts[0].id)
        assert tm.stats()["tiers"]["database"]["bytes"] == 2 * ONE  # at once, not at a budget check
        f = await tm.wait((await tm.fork(ts[1].id, {"max_tokens": 1})).id, timeout=10)
        await tm.flush()
        assert tm.stats()["tiers"]["database"]["bytes"] == 3 * ONE
        await tm.delete(ts[1].id)  # the fork still names its parent's state? no: its own, so it goes
        assert tm.stats()["tiers"]["database"]["bytes"] == 2 * ONE
        await tm.delete(f.id)
        await tm.delete(ts[2].id)
        assert tm.stats()["tiers"]["database"]["bytes"] == 0 == await tm.store.states.states_bytes()
    finally:
        await tm.close()


async def test_the_write_behind_lane_is_bounded_in_bytes(tmp_path):
    """A lane of two states: a burst of finished tasks keeps the newest two pending; the older
    ones are not written (shown finished all the same) and are rebuilt when continued."""
    eng = FakeEngine(gate=asyncio.Event())
    tm = await manager(eng, tmp_path / "w.db", write_behind_bytes=2 * ONE)
    try:
        made = [await tm.create(f"burst {i}", persistent=True) for i in range(5)]  # rows committed
        hold = asyncio.Event()
        await tm.writer.put(hold.wait)  # the writer is busy: their settle rows queue up behind
        eng.gate.set()
        while tm.writer.queue.qsize() < 5:
            await asyncio.sleep(0.01)
        hold.set()  # five rows commit together: five states reach a lane that holds two
        done = [await tm.wait(t.id, timeout=10) for t in made]
        await tm.flush()
        assert all(t.finish_reason == "length" for t in done)
        stored = [t.state == "stored" for t in done]
        assert sum(stored) == 2 and tm.counters["state_writes_dropped"] == 3  # the two newest kept
        assert tm.stats()["tiers"]["write_behind"] == {"bytes": 0, "entries": 0}
        assert tm.cache.pinned_keys() == set()
        lost = next(t for t, s in zip(done, stored) if not s)
        tm.cache.discard(lost.state_id)  # and gone from memory too
        tm._state_evicted(lost.state_id)
        assert lost.state == "rebuild"
        c = await tm.wait((await tm.continue_(lost.id, {"max_tokens": 1})).id, timeout=10)
        assert eng.submissions[-1].init_state is None and c.out.text == "<100><101><102><100>"
    finally:
        await tm.close()


async def test_fp16_storage_halves_an_fp32_wkv_state(tmp_path):
    st = counted_state(7)
    st.wkv.normal_()
    enc = encode_state(st, "s", wkv_dtype="float16")
    assert enc.nbytes == st.nbytes() - st.wkv.numel() * 2
    back = decode_state(enc.meta, enc.data, "s", enc.checksum)
    assert back.wkv.dtype == torch.float32 and consumed(back) == 7  # shifts exact, wkv rounded
    assert torch.allclose(back.wkv, st.wkv, rtol=1e-3, atol=1e-3) and not torch.equal(back.wkv, st.wkv)
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "h.db", state_store_dtype="fp16")
    try:
        t = await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)
        await tm.flush()
        row = await tm.store.states.get_state(t.state_id)
        assert row.nbytes < ONE and '"as":"float32"' in row.meta
        tm.cache.discard(t.state_id)
        await tm.wait((await tm.continue_(t.id, {"max_tokens": 1})).id, timeout=10)
        init = eng.submissions[-1].init_state
        assert init is not None and init.wkv.dtype == torch.float32 and consumed(init) == 5
    finally:
        await tm.close()


async def test_written_waits_for_a_task_s_pending_state():
    """StateLane.written (TaskManager.state_written: what a compaction of a response waits for):
    False while the task's state is pending or being written, True once it is written; a task
    with nothing pending is written at once."""
    gate, wrote = asyncio.Event(), []

    async def write(p: Pending, prepared: object) -> None:
        await gate.wait()
        wrote.append(p.task.id)

    lane = StateLane(lambda p: asyncio.sleep(0), write, lambda p, why: None, max_bytes=10**9)
    lane.start()
    lane.add(Pending(SimpleNamespace(id="T", deleted=False), "T:1", counted_state(0), 3, False, ONE))  # type: ignore[arg-type]
    assert await lane.written("T", timeout=0.1) is False  # (the write waits on the gate)
    assert await lane.written("U", timeout=0.1) is True
    gate.set()
    assert await lane.written("T", timeout=5) is True and wrote == ["T"]
    await lane.drain(1)
