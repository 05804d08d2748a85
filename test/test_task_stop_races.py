"""A stop or delete that meets a run still reading its starting state (claimed, its state not
yet read from the database: after a restart, or once the state left memory), and the calls
that waited for a delete's stop.

The run in that window has no engine handle yet: a stop then did nothing (the run went on,
the stop answered after its 5 s wait with the task running) and a delete left a sequence that
no route could reach. Now the run is aborted once submitted. A fork, continue or as_template
that waited for a delete's stop answers 404, as it would have after the delete (they forked
the deleted task). The scripted engine (task_fakes) runs until aborted while its gate is shut.
"""

from __future__ import annotations

import asyncio

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.tasks import TaskConfig, TaskManager
from server.tasks.errors import TaskNotFound
from server.tasks.records import Task


@pytest.fixture
async def tm(tmp_path):
    eng = FakeEngine()
    m = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(tmp_path / "r.db"), default_max_tokens=3), FakeShape())
    await m.start()
    yield m
    await m.close()


def slow_reads(tm: TaskManager) -> tuple[asyncio.Event, asyncio.Event]:
    """(entered, gate): a run's state read signals `entered`, then waits for `gate`."""
    entered, gate = asyncio.Event(), asyncio.Event()
    read = tm.runs.persistence.resolve_state

    async def slow(t: Task, holder: str | None = None):
        entered.set()
        await gate.wait()
        return await read(t, holder)

    tm.runs.persistence.resolve_state = slow  # type: ignore[method-assign]
    return entered, gate


async def finished_task(tm: TaskManager) -> Task:
    t = await tm.wait((await tm.create("p", persistent=True)).id, timeout=10)
    assert t.finish_reason == "length"
    await tm.flush()
    return t


@pytest.mark.parametrize("how", ["stop", "interrupt", "delete"])
async def test_a_stop_while_the_run_reads_its_state_ends_the_run(tm, how):
    eng: FakeEngine = tm.engine
    t = await finished_task(tm)
    entered, gate = slow_reads(tm)
    eng.gate = asyncio.Event()  # shut: a submitted run generates nothing until aborted
    cont = asyncio.create_task(tm.continue_(t.id, {"max_tokens": 50}))
    await asyncio.wait_for(entered.wait(), 10)
    assert t.running and t.run is None  # claimed, nothing submitted yet
    if how == "interrupt":
        tm.interrupt(t)
        ending = asyncio.create_task(tm.wait(t.id, timeout=10))
    else:
        ending = asyncio.create_task(tm.stop(t.id) if how == "stop" else tm.delete(t.id))
    await asyncio.sleep(0.05)  # the stop was asked (synchronously) and waits for the settle
    gate.set()
    assert await asyncio.wait_for(cont, 10) is t  # acknowledged, then stopped
    answered = await asyncio.wait_for(ending, 10)
    assert eng.handles[-1].aborted and len(eng.handles) == 2  # the continue's sequence was aborted
    assert not t.running and answered is t
    assert t.finish_reason == ("interrupted" if how == "interrupt" else "stopped")
    if how == "delete":
        assert t.deleted
        with pytest.raises(TaskNotFound):
            await tm.get(t.id)


async def test_a_later_run_is_not_stopped_by_an_earlier_stop(tm):
    """A stop marks only the run it meets: the next continue runs to its end."""
    eng: FakeEngine = tm.engine
    eng.gate = asyncio.Event()
    t = await tm.create("p", {"max_tokens": 50}, persistent=True)
    await tm.stop(t.id)
    assert (t.finish_reason, t.stop_requested) == ("stopped", True)
    eng.gate = None
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 4})).id, timeout=10)
    assert (t.finish_reason, len(eng.handles[-1].tokens)) == ("length", 4)


@pytest.mark.parametrize("call", ["fork", "fork_tmp", "continue", "as_template"])
async def test_a_call_that_waited_for_a_deletes_stop_answers_not_found(tm, call):
    eng: FakeEngine = tm.engine
    eng.gate = asyncio.Event()
    t = await tm.create("p", {"max_tokens": 50}, persistent=True)
    assert t.running
    calls = {
        "fork": lambda: tm.fork(t.id, {"max_tokens": 3}),
        "fork_tmp": lambda: tm.fork(t.id, {"max_tokens": 3}, tmp=True),
        "continue": lambda: tm.continue_(t.id, {"max_tokens": 3}),
        "as_template": lambda: tm.as_template(t.id),
    }
    deleted, other = await asyncio.wait_for(
        asyncio.gather(tm.delete(t.id), calls[call](), return_exceptions=True), 10
    )
    assert deleted is t and t.deleted and not t.running, deleted
    assert (t.finish_reason, t.out.finished) == ("stopped", True)  # the stopped run, not a new one
    assert isinstance(other, TaskNotFound), other
    assert len(eng.handles) == 1  # nothing else started
    assert not [x for x in tm.table.running()]
