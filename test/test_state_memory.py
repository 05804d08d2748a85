"""What holds a state's bytes besides the caches that account for them (the open item "RSS about
2x the state bytes"; docs/performance.md, "Host memory of states"). Each test counts objects,
never RSS: a state (or its encoded blob) that no cache holds must be freed by reference counting,
at once, not left to the cyclic garbage collector (which runs rarely under load, while states
are MBs each) nor kept by a library's cache."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer, counted_state

from server.model.state import ModelShape, State
from server.tasks import TaskConfig, TaskManager
from server.tasks.claims import settle_claim
from server.tasks.codec import encode_state
from server.tasks.records import Task, to_row
from server.tasks.behind import Pending, StateLane
from server.tasks.statestore import state_row
from server.tasks.store import Store
from server.tasks.writer import Writer

SHAPE = ModelShape(n_layer=2, n_embd=128, n_head=2, head_size=64, vocab_size=65536, ffn_dim=512,
                   d_decay=32, d_aaa=32, d_mv=32, d_gate=32)
SIG = SHAPE.signature()


@contextmanager
def no_cycle_collector() -> Iterator[None]:
    """Only reference counting frees objects inside the block."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Blob(bytearray):
    """An encoded state's bytes that a weak reference can follow (bytearray itself cannot)."""


def task_row(tid: str, **kw: Any) -> dict[str, Any]:
    return {**to_row(Task(id=tid, kind="task")), "status": 3, **kw}


async def _save(store: Store, row: dict[str, Any]) -> None:
    await store.save(state=row)


async def _insert_new(store: Store, row: dict[str, Any]) -> None:
    assert await store.insert_new(task_row("TASK_new"), row)


async def _store_state(store: Store, row: dict[str, Any]) -> None:
    await store.save(task_row("TASK_x"))
    assert (await store.states.store_state("TASK_x", row, 5))[0]


async def _settle_claim(store: Store, row: dict[str, Any]) -> None:
    claim = {**to_row(Task(id="_tpl", kind="template")), "status": 2, "instance": "a"}
    assert await store.insert_new(claim)
    done = {**to_row(Task(id="_tpl", kind="template", finish_reason="stop")), "instance": None}
    assert await settle_claim(store, done, row, "a")


@pytest.mark.parametrize("write", [_save, _insert_new, _store_state, _settle_claim])
async def test_a_written_state_blob_is_not_kept_by_the_statement_cache(
    tmp_path, write: Callable[[Store, dict[str, Any]], Awaitable[None]]
):
    """A statement with the blob among its values was compiled once and kept in SQLAlchemy's
    compiled cache with those values: one state's bytes per statement shape (21 MB on a 2.9B
    model), outside every budget, for the life of the process."""
    store = Store(str(tmp_path / "m.db"))  # its own engine: a compiled cache of its own
    await store.open()
    try:
        st = State.zeros(SHAPE, 1)
        enc = encode_state(st, SIG)
        row = state_row("s1", "TASK_x", enc, False)
        row["data"] = blob = Blob(enc.data)
        ref = weakref.ref(blob)
        with no_cycle_collector():
            await write(store, row)
            del blob, row, enc
            kept = [type(r).__qualname__ for r in gc.get_referrers(ref())] if ref() is not None else None
            assert kept is None, f"the blob is still referred to by {kept}"
        got = await store.states.get_state("s1")
        assert got is not None and len(got.data) == st.nbytes()  # written all the same
    finally:
        await store.close()


async def test_finished_runs_free_their_final_states_by_reference_counting(tmp_path):
    """A finished run (its handle, its Result and the Result's final state) was freed only by the
    cyclic GC: `run.undo = partial(self._discard, t, run, ...)` made a cycle. States the cache
    evicted meanwhile stayed in memory, unaccounted, until a full collection (36 states of 2.2 MB
    = 78 MB in the mixed-load script's server after 150 s)."""
    eng = FakeEngine()
    one = counted_state(0).nbytes()
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(tmp_path / "r.db"), default_max_tokens=2,
                                                      state_cache_bytes=2 * one, tmp_state_bytes=2 * one), FakeShape())
    await tm.start()
    try:
        with no_cycle_collector():
            for i in range(6):
                await tm.wait((await tm.create(f"p{i}")).id, timeout=10)
                await tm.wait((await tm.create(f"q{i}", persistent=True)).id, timeout=10)
            await tm.flush()
            finals = [weakref.ref(h.peek_result().state) for h in eng.handles]
            eng.handles.clear()  # (the fake engine's own references)
            eng.submissions.clear()
            cached = {id(tm.cache.get(k)) for k in tm.cache.keys()}
            alive = [r() for r in finals if r() is not None]
            assert len(cached) <= 4 and all(isinstance(s, State) for s in alive)
            assert [id(s) for s in alive if id(s) not in cached] == []  # evicted: freed at once
    finally:
        await tm.close()



@pytest.mark.parametrize("items", [1, 2])
async def test_the_writer_lets_go_of_the_items_it_wrote(items: int):
    """The writer's loop kept the entries of its last merged write (a loop variable) while it
    waited for the next job: one state write's item, MBs, outside every budget, until the next
    write of that kind (the mixed test above failed on it now and then, as the timing went).
    items=1: an entry written alone; 2: two merged into one call."""
    writer, wrote = Writer(16), []

    async def job(batch: list[Any]) -> None:
        wrote.append(len(batch))

    writer.start()
    try:
        with no_cycle_collector():
            blobs = [Blob(b"x" * 64) for _ in range(items)]
            refs = [weakref.ref(b) for b in blobs]
            futs = [await writer.put_many(job, b) for b in blobs]  # queued before the loop runs
            for f in futs:
                await f
            await writer.flush()  # another job (not put_many) runs after them
            del blobs, futs
            assert wrote == [items]
            assert [r() for r in refs] == [None] * items
    finally:
        await writer.close()


async def test_the_state_lane_lets_go_of_the_state_it_wrote():
    """The lane's loop kept the Pending it last wrote (and its state) while it waited for the
    next one: a written state the cache then evicted stayed in memory, unaccounted."""
    written: list[str] = []

    async def prepare(p: Pending) -> bytes:
        return b"encoded"

    async def write(p: Pending, prepared: bytes) -> None:
        written.append(p.key)

    lane = StateLane(prepare, write, lambda p, why: None, max_bytes=10**6)
    lane.start()
    try:
        with no_cycle_collector():
            st = counted_state(1)
            ref = weakref.ref(st)
            lane.add(Pending(Task(id="TASK_a", kind="task"), "TASK_a:1", st, 1, False, st.nbytes()))
            del st
            await lane.idle()
            assert written == ["TASK_a:1"] and lane.bytes == 0
            assert ref() is None
    finally:
        await lane.drain(1.0)


async def test_with_the_real_engine_only_the_caches_and_the_slot_pool_hold_states(tmp_path, parts):
    """Every State alive once the tasks have settled and their states are written is one a cache
    accounts for, or the engine's slot pool: none kept by the engine, its output, the pump or the
    writers (the tiny synthetic model on the CPU engine; creates, forks, continues and a
    template, with cache budgets that evict)."""
    model, tok, eng = parts
    one = model.zero_state(1).nbytes()
    tm = TaskManager(eng, tok, TaskConfig(db=str(tmp_path / "e.db"), default_max_tokens=3,
                                          state_cache_bytes=2 * one, tmp_state_bytes=2 * one), model.shape)
    await tm.start()
    try:
        with no_cycle_collector():
            ids = []
            for i in range(4):
                t = await tm.wait((await tm.create(f"turn {i}: " + "words " * 20, persistent=i % 2 == 1)).id, timeout=30)
                ids.append(t.id)
            await tm.wait((await tm.fork(ids[1], prompt=" and more")).id, timeout=30)
            await tm.wait((await tm.continue_(ids[3], prompt=" again")).id, timeout=30)
            await tm.as_template(ids[1], name="mem")
            await tm.flush()
            cached = {id(tm.cache.get(k)) for k in tm.cache.keys()}
            live = [o for o in gc.get_objects() if type(o) is State]
            stray = [s.nbytes() for s in live if id(s) not in cached and s is not eng.runner.pool]
            del live
            assert stray == []
            assert len(cached) <= 4 + 1  # (the template's state is kept apart from the budgets)
    finally:
        await tm.close()
