"""A run whose task was taken from this instance while it ran (its lease expired and a replica's
heartbeat marked the row interrupted, or the row is gone) settles "lost": the final row is not
written, the task shows interrupted and is forgotten here (read again from its row). Its new
state is named by nothing then: neither written nor left in the memory cache (it used to be
unpinned back into the tasks' LRU, and stayed there until evicted)."""

from __future__ import annotations

import asyncio

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.tasks import TaskConfig, TaskManager


async def manager(eng: FakeEngine, path) -> TaskManager:
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3), FakeShape())
    await tm.start()
    return tm


async def settled(t) -> None:
    """Until t's run has settled and its settle write is done (t shows finished)."""
    while t.running or t.pending_writes:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("how", ["interrupted", "deleted"])
async def test_a_run_whose_task_was_taken_over_leaves_no_state(tmp_path, how):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "l.db")
    try:
        t = await tm.wait((await tm.create("p", persistent=True)).id, timeout=10)
        await tm.flush()
        stored = t.stored_id
        assert stored is not None and stored in tm.cache
        writes = tm.counters["state_writes"]
        eng.gate = asyncio.Event()  # the next run waits
        await tm.continue_(t.id, {"max_tokens": 3}, "ab")  # its row is claimed: running here
        if how == "interrupted":  # what a replica's heartbeat does to the tasks of a dead instance
            assert await tm.store.mark_interrupted() == [t.id]
        else:  # the row is gone (deleted behind this instance's back)
            await tm.store.delete_task(t.id)
        eng.gate.set()  # the run ends: its final row is refused (not this instance's any more)
        await asyncio.wait_for(settled(t), 10)  # (not tm.wait: t is forgotten here, its row read again)
        await tm.flush()
        new = t.state_id
        assert new is not None and new != stored  # the run made a new state
        assert t.finish_reason == "interrupted" and not t.running and t.id not in tm.live
        assert new not in tm.cache  # nothing names it: not cached (nor pinned)
        assert tm.cache.keys() == set() and tm.cache.pinned_keys() == set()
        assert tm.stats()["tiers"]["tasks_lru"]["bytes"] == 0
        assert tm.counters["state_writes"] == writes  # nor written
        assert await tm.store.states.get_state(new) is None
        if how == "interrupted":  # read again from its row: the state it names is the stored one
            again = await tm.get(t.id)
            assert again is not t and again.finish_reason == "interrupted" and again.state_id == stored
    finally:
        await tm.close()
