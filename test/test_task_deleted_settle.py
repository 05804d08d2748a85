"""A task deleted while its run still runs: `delete` aborts the run and waits for it to settle at
most STOPPING_WAIT_S, then deletes. A run that settles later (its abort came late) must leave no
state behind: its new state is neither cached (the TMP LRU, the tasks' LRU) nor written, and the
state it started from left memory with the task. Nor may a run that settled before the delete
and whose writes (its settle row, then its state) are still queued when the delete comes."""

from __future__ import annotations

import asyncio

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

import server.tasks.manager as manager_mod
from server.tasks import TaskConfig, TaskManager


async def manager(eng: FakeEngine, path) -> TaskManager:
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3), FakeShape())
    await tm.start()
    return tm


async def settled(tm: TaskManager) -> None:
    await asyncio.gather(*tm.runs._pumps)
    await tm.flush()


@pytest.mark.parametrize("tmp", [True, False])
@pytest.mark.parametrize("wait", [0.0, 0.05])
async def test_a_run_that_settles_after_its_task_was_deleted_leaves_no_state(tmp_path, monkeypatch, tmp, wait):
    monkeypatch.setattr(manager_mod, "STOPPING_WAIT_S", wait)
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "d.db")
    try:
        t = await tm.wait((await tm.create("p", persistent=not tmp)).id, timeout=10)
        await tm.flush()
        assert t.state_id in tm.cache
        writes = tm.counters["state_writes"]
        eng.gate = asyncio.Event()  # the next run waits
        await tm.continue_(t.id, {"max_tokens": 3}, "ab")
        h = eng.handles[-1]
        h.abort = lambda: True  # the engine ends it later than delete waits
        await tm.delete(t.id)
        assert t.deleted and t.running
        assert tm.cache.keys() == tm.cache.pinned_keys()  # its state is forgotten once the run unpins it
        h.aborted = True  # now it ends, and settles
        await settled(tm)
        assert t.deleted and not t.running and t.finish_reason == "stopped"
        assert tm.cache.keys() == set() and tm.cache.pinned_keys() == set()
        assert tm.stats()["tiers"]["tmp"]["bytes"] == tm.stats()["tiers"]["tasks_lru"]["bytes"] == 0
        assert tm.counters["state_writes"] == writes
        assert not await tm.store.task_exists(t.id)
        assert await tm.store.states.get_state(t.state_id) is None
    finally:
        await tm.close()


@pytest.mark.parametrize("held", ["settle row", "state write"])
async def test_a_task_deleted_while_its_run_is_being_stored_leaves_no_state(tmp_path, monkeypatch, held):
    """The run settled before the delete, its writes are still queued (the writer is held): its
    settle row ("settle row": the task still shows running) or, once that is committed, its
    state ("state write"). The delete's job queues behind them: the row is skipped, the state
    not written, and neither is left in the cache."""
    monkeypatch.setattr(manager_mod, "STOPPING_WAIT_S", 0.0)
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "e.db")
    try:
        t = await tm.wait((await tm.create("p", persistent=True)).id, timeout=10)
        await tm.flush()
        writes = tm.counters["state_writes"]
        eng.gate, holds = asyncio.Event(), [asyncio.Event(), asyncio.Event()]
        await tm.continue_(t.id, {"max_tokens": 3}, "ab")
        assert tm.writer.offer(holds[0].wait)  # the writer waits: then the settle row, then holds[1]
        eng.gate.set()  # the run ends and settles: its row is queued
        while t.run is not None:
            await asyncio.sleep(0.005)
        assert tm.writer.offer(holds[1].wait)
        new = t.state_id
        assert t.running and t.pending_writes == 1 and new in tm.cache.pinned_keys()
        if held == "state write":
            holds[0].set()  # the row is committed: t shows finished, its state write queues behind holds[1]
            await tm.wait(t.id, timeout=10)
            assert t.stored_id != new and new in tm.cache.pinned_keys()
        delete = asyncio.ensure_future(tm.delete(t.id))
        while not t.deleted:
            await asyncio.sleep(0)
        for h in holds:
            h.set()
        await delete
        await settled(tm)
        assert not t.running and tm.cache.keys() == set() and tm.cache.pinned_keys() == set()
        assert tm.counters["state_writes"] == writes
        assert not await tm.store.task_exists(t.id) and await tm.store.states.get_state(new) is None
    finally:
        await tm.close()
