"""The task layer's collaborators on their own: the state cache's single-flight load, parameter
checks, Persistence on a real SQLite file with no engine, Runs against a scripted engine
(test/task_fakes.py) with an in-memory persistence, and the TaskManager over that engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from task_fakes import VOCAB, FakeEngine, FakeShape, FakeTokenizer, consumed, counted_state

from server.engine import types
from server.engine.types import FIELD_KINDS, FIELDS, STOP, SamplingParams, field_kinds
from server.tasks import TaskConfig, TaskConflict, TaskInvalid, TaskManager
from server.tasks.cache import StateCache
from server.tasks import params
from server.tasks.params import clean_params
from server.tasks.persist import Outcome, Persistence, SettleJob
from server.tasks.statewrites import StateWrites
from server.tasks.records import CACHED, FINISHED, PREFILL, READY, RUNNING, STORED, TASK, TMP, Run, Task, new_id, to_row, update_row
from server.tasks.runs import Runs
from server.tasks.store import Store
from server.tasks.table import TaskTable
from server.tasks.writer import Writer

ROOT = str(Path(__file__).resolve().parents[1])


def test_importing_the_task_layer_imports_no_torch():
    code = "import sys, server.tasks; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- StateCache.get_or_load ---------------------------------------------------------------------
async def test_get_or_load_shares_one_load_among_concurrent_callers():
    cache: StateCache = StateCache(10**6)
    calls, gate = [], asyncio.Event()

    async def load():
        calls.append(1)
        await gate.wait()
        return counted_state(7)

    waiters = [asyncio.create_task(cache.get_or_load("k", load)) for _ in range(5)]
    await asyncio.sleep(0.01)
    waiters[0].cancel()  # a caller that leaves does not cancel the load of the others
    gate.set()
    got = await asyncio.gather(*waiters[1:])
    assert len(calls) == 1 and all(g is got[0] for g in got) and consumed(got[0]) == 7
    assert cache.get("k") is got[0] and cache.stats()["lru_count"] == 1
    assert await cache.get_or_load("k", load) is got[0] and len(calls) == 1  # now from memory


async def test_an_abandoned_load_is_cancelled_once_its_last_caller_leaves():
    """abandon=True (a conversation prefill): the load goes on while one caller waits, is
    cancelled when the last leaves (its engine request aborted), and a caller after that starts
    a load of its own rather than joining the cancelled one."""
    cache: StateCache = StateCache(10**6)
    started, cancelled, gate = [], [], asyncio.Event()

    async def load():
        started.append(1)
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return counted_state(3)

    a, b = (asyncio.create_task(cache.get_or_load("k", load, abandon=True)) for _ in range(2))
    await asyncio.sleep(0.01)
    a.cancel()
    await asyncio.sleep(0.01)
    assert started == [1] and not cancelled  # b still waits: the load goes on
    b.cancel()
    c = asyncio.create_task(cache.get_or_load("k", load, abandon=True))  # at once: not the cancelled one
    await asyncio.sleep(0.01)
    assert cancelled == [1] and len(started) == 2
    gate.set()
    assert consumed(await c) == 3 and cache.get("k") is not None


async def test_get_or_load_failure_reaches_every_caller_and_caches_nothing():
    cache: StateCache = StateCache(10**6)

    async def boom():
        await asyncio.sleep(0.01)
        raise RuntimeError("disk gone")

    res = await asyncio.gather(*(cache.get_or_load("k", boom) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in res) and "k" not in cache

    async def none():
        return None

    assert await cache.get_or_load("k", none) is None and "k" not in cache

    async def as_template():  # a loader may choose the tier itself
        st = counted_state(1)
        cache.put("k", st, template=True)
        return st

    st = await cache.get_or_load("k", as_template)
    assert cache.stats()["template_count"] == 1 and cache.stats()["lru_count"] == 0 and cache.get("k") is st


# --- parameters -----------------------------------------------------------------------------------
def test_clean_params_keeps_the_stored_form_and_names_a_bad_field():
    p = clean_params({"temperature": 0, "top_k": -1, "stop": "\n\n", "seed": None, "stream": True}, 100)
    assert p == {"temperature": 0, "top_k": -1, "stop": ["\n\n"]}  # ints stay ints; unknown keys go
    for bad, field in (({"temperature": 9.0}, "temperature"), ({"max_tokens": "5"}, "max_tokens"),
                       ({"top_p": True}, "top_p"), ({"stop": [""]}, "stop"), ({"stop": ["\ud800"]}, "stop"),
                       ({"stop_token_ids": [100]}, "stop_token_ids"), ({"seed": -1}, "seed"),
                       ({"stop": [1]}, "stop"), ({"ignore_eos": 1}, "ignore_eos")):
        with pytest.raises(TaskInvalid) as e:
            clean_params(bad, 100)
        assert e.value.param == field, (bad, e.value.message)



def test_task_params_take_a_new_fields_type_from_the_one_definition(monkeypatch):
    """A field a newcomer adds to SamplingParams (its type), LIMITS and FIELDS is checked by the
    task layer with that type: the task layer keeps no type table of its own (it once answered
    a new float field with "has the wrong type")."""

    @dataclass(frozen=True)
    class WithMinP(SamplingParams):
        min_p: float = 0.0

    fields = (*FIELDS, "min_p")
    for name, kind in field_kinds(WithMinP, fields).items():  # what types.py derives at import
        monkeypatch.setitem(types.FIELD_KINDS, name, kind)
    monkeypatch.setattr(params, "FIELDS", fields)  # the names as the task module imported them
    monkeypatch.setitem(types.LIMITS, "min_p", (0.0, 1.0))
    assert clean_params({"min_p": 0.1, "top_k": 2}, 100) == {"min_p": 0.1, "top_k": 2}
    assert clean_params({"min_p": 1}, 100) == {"min_p": 1}  # an integer is a float, stored as given
    for bad, why in (({"min_p": "0.1"}, "wrong type"), ({"min_p": True}, "wrong type"), ({"min_p": 2.0}, "outside")):
        with pytest.raises(TaskInvalid) as e:
            clean_params(bad, 100)
        assert e.value.param == "min_p" and why in e.value.message, (bad, e.value.message)


def test_a_field_without_a_kind_is_an_error_not_a_token_id_list(monkeypatch):
    """A name the type table lacks is a programming error, never checked as stop_token_ids."""
    from server.tasks.params import _typed

    with pytest.raises(LookupError, match="min_p"):
        _typed("min_p", 0.1)
    with pytest.raises(TypeError, match="min_p"):
        field_kinds(SamplingParams, ("min_p",))  # FIELDS naming a field SamplingParams lacks fails the import
    assert set(types._JSON_KINDS.values()) == set(params._KINDS)  # every kind has its check


def test_every_field_has_one_json_type_on_both_route_families():
    """The task layer's check (types.FIELD_KINDS, from SamplingParams) accepts a JSON value's type
    exactly where the request bodies' SamplingFields does (values inside every field's bounds)."""
    from pydantic import ValidationError

    from server.api.sampling import SamplingFields

    assert tuple(FIELD_KINDS) == FIELDS and set(FIELDS) <= set(SamplingFields.model_fields)
    for name in FIELDS:
        for value in (1, 0.5, True, "x", ["x"], [1], [True]):
            try:
                SamplingFields(**{name: value})
                api = True
            except ValidationError:
                api = False
            try:
                clean_params({name: value}, 100)
                task = True
            except TaskInvalid:
                task = False
            assert api == task, (name, value, api, task)

# --- Persistence on SQLite, no engine -------------------------------------------------------------
class Parts:
    def __init__(self, path, budget: int = 10**9) -> None:
        self.store, self.writer = Store(str(path)), Writer(16)
        self.cache: StateCache = StateCache(10**6)
        self.table, self.counters = TaskTable(), Counter()
        states = StateWrites(self.store, self.writer, self.cache, self.table, self.counters,
                             signature=FakeShape().signature(), db_budget_bytes=budget,
                             write_behind_bytes=8 * 1024**3, store_dtype=None)
        self.p = Persistence(states)

    async def __aenter__(self):
        await self.store.open()
        await self.p.start()
        self.writer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.writer.close()
        await self.store.close()


def running_task(table: TaskTable, n_tokens: int = 5) -> Task:
    t = Task(id=new_id(TASK), kind=TASK, tokens=array("i", range(1, n_tokens + 1)), instance="local")
    t.status = RUNNING
    table.live[t.id] = t
    return t


async def started(parts: Parts, n_tokens: int = 5) -> Task:
    """A running task whose start row is committed (this instance runs it), as Runs leaves it."""
    t = running_task(parts.table, n_tokens)
    await parts.store.save_rows([to_row(t)])
    return t


async def settle(parts: Parts, t: Task, n: int) -> asyncio.Future:
    """Queue t's settle with a new state that has consumed n tokens, as Runs does."""
    key, st, old = f"{t.id}:s{n}", counted_state(n), t.state_id
    t.state_id, t.state_pos = key, n
    parts.cache.pin(key, st)
    t.pending_writes += 1
    row = {**update_row(t), "status": FINISHED, "finish_reason": "length", "instance": None}
    return await parts.p.queue_settled(SettleJob(t, row, key, st, n, old, Outcome("length", None)))


async def test_a_task_shows_finished_once_its_row_is_committed_and_its_state_follows(tmp_path):
    async with Parts(tmp_path / "p.db") as parts:
        t = await started(parts)
        gate = asyncio.Event()
        await parts.writer.put(gate.wait)  # the writer is busy
        saved = await settle(parts, t, 4)
        await asyncio.sleep(0.02)
        assert t.running and (await parts.store.get_task(t.id)).status == RUNNING
        assert t.state == CACHED and t.response()["state"] == "cached"
        gate.set()
        await saved  # the row is committed: shown finished, its state not written yet
        assert not t.running and t.finish_reason == "length" and t.out.finished
        row = await parts.store.get_task(t.id)
        assert row.status == FINISHED and row.instance is None and row.state_id is None and row.state_pos == 0
        assert t.state_id in parts.cache.pinned_keys()  # pinned until written
        await parts.p.flush()
        row = await parts.store.get_task(t.id)
        assert (row.state_id, row.state_pos) == (t.state_id, 4) == (t.stored_id, t.stored_pos)
        assert t.state == STORED and await parts.store.states.get_state(t.state_id) is not None
        assert parts.cache.pinned_keys() == set() and t.state_id in parts.cache  # unpinned, still cached
        assert t.id not in parts.table.live and parts.table.recent[t.id] is t  # retired
        assert parts.p.db_state_bytes == counted_state(0).nbytes() and parts.counters["state_writes"] == 1


async def test_a_newer_state_supersedes_one_not_yet_written_and_replaces_the_stored_one(tmp_path):
    async with Parts(tmp_path / "n.db") as parts:
        t = await started(parts)
        await (await settle(parts, t, 4))
        await parts.p.flush()
        first = t.stored_id
        t.status, t.instance = RUNNING, "local"  # a continue claims it, as Runs does
        assert await parts.store.claim(t.id, t.version, update_row(t)) is None
        gate = asyncio.Event()
        await parts.writer.put(gate.wait)  # both settle rows commit together, in order
        five, six = await settle(parts, t, 5), await settle(parts, t, 6)
        gate.set()
        await asyncio.gather(five, six)
        assert parts.p.lane.stats()["entries"] == 1  # coalesced: only the newest waits
        await parts.p.flush()
        row = await parts.store.get_task(t.id)
        assert (row.state_id, row.state_pos) == (f"{t.id}:s6", 6)
        assert await parts.store.states.get_state(first) is None  # the old stored state went with it
        assert parts.counters["state_writes"] == 2 and parts.p.db_state_bytes == counted_state(0).nbytes()
        assert parts.cache.pinned_keys() == set()


async def test_a_restart_loads_the_task_and_its_state_once(tmp_path):
    async with Parts(tmp_path / "r.db") as parts:
        t = await started(parts)
        await (await settle(parts, t, 4))
        await parts.p.flush()
    async with Parts(tmp_path / "r.db") as parts:  # a new process: nothing in memory
        loaded = await parts.p.load_task(t.id)
        assert loaded is not t and loaded.state_id == t.state_id and list(loaded.tokens) == list(t.tokens)
        assert await parts.p.load_task(t.id) is loaded  # kept as recently read
        got = await asyncio.gather(*(parts.p.resolve_state(loaded) for _ in range(5)))
        assert parts.counters["db_state_loads"] == 1  # one read and decode for the five
        assert all(s is got[0][0] and pos == 4 and key == t.state_id for s, pos, key in got)
        assert consumed(got[0][0]) == 4 and parts.cache.pinned_keys() == {t.state_id}
        for _ in got:
            parts.p.release(t.state_id)
        assert parts.cache.pinned_keys() == set() and t.state_id in parts.cache


async def test_a_state_of_another_model_shape_is_refused(tmp_path):
    async with Parts(tmp_path / "s.db") as parts:
        t = await started(parts)
        await (await settle(parts, t, 4))
        await parts.p.flush()
    async with Parts(tmp_path / "s.db") as parts:
        parts.p.reads.signature = "another-shape"
        loaded = await parts.p.load_task(t.id)
        with pytest.raises(TaskConflict, match="model shape"):
            await parts.p.resolve_state(loaded)
        assert t.state_id not in parts.cache


async def test_the_database_budget_drops_the_oldest_states(tmp_path):
    one = counted_state(0).nbytes()
    async with Parts(tmp_path / "b.db", budget=int(2.5 * one)) as parts:
        tasks = [await started(parts) for _ in range(4)]
        for i, t in enumerate(tasks):
            await (await settle(parts, t, i + 1))
            await parts.p.flush()
            await parts.store.states.touch_states([t.state_id], when=1000.0 + i)  # a strict age order
        assert await parts.store.states.states_bytes(templates=False) <= 2.5 * one
        assert parts.counters["db_evictions"] == 2 and parts.p.db_state_bytes == 2 * one
        assert [t.stored_id is None for t in tasks] == [True, True, False, False]
        assert [t.state_id is None for t in tasks] == [True, True, False, False]
        assert [t.state_pos for t in tasks[:2]] == [0, 0]  # recomputed from zero next time


async def test_progress_rows_are_written_for_new_output_only(tmp_path):
    async with Parts(tmp_path / "g.db") as parts:
        t = await started(parts)
        committed = asyncio.get_running_loop().create_future()  # the run's start row (Runs: save_started)
        t.run = Run(pos=0, n_input=5, params=SamplingParams(), key=None, started=committed)
        t.out.append("hello", 1)
        t.run.n_out = 1
        parts.p.offer_progress()  # its start row is not committed yet (a claim waiting for a lock): left for later
        await parts.writer.flush()
        assert (await parts.store.get_task(t.id)).text != "hello" and parts.counters["progress_writes"] == 0
        committed.set_result(None)
        parts.p.offer_progress()
        parts.p.offer_progress()  # one job queued serves both
        await parts.writer.flush()
        assert (await parts.store.get_task(t.id)).text == "hello"
        parts.p.offer_progress()  # nothing new since
        await parts.writer.flush()
        assert parts.counters["progress_writes"] == 1 and parts.counters["progress_rows"] == 1


# --- Runs against a scripted engine, persistence in memory --------------------------------------
class MemoryPersistence:
    """RunPersistence in memory: started rows commit at once; settles wait for the test."""

    def __init__(self, cache: StateCache) -> None:
        self.cache, self.started, self.settles, self.progress = cache, [], [], 0

    async def resolve_state(self, t, holder=None):
        st = self.cache.get(t.state_id) if t.state_id else None
        if st is None:
            return None, 0, None
        self.cache.pin(t.state_id, st)
        return st, t.state_pos, t.state_id

    def release(self, key):
        if key is not None:
            self.cache.unpin(key)

    async def save_started(self, t, new):
        self.started.append(t.id)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def queue_settled(self, job):
        fut = asyncio.get_running_loop().create_future()
        self.settles.append((job, fut))
        return fut

    def offer_progress(self):
        self.progress += 1


def make_runs(engine: FakeEngine) -> tuple[Runs, MemoryPersistence, TaskTable, StateCache]:
    cache: StateCache = StateCache(10**6)
    mem, table = MemoryPersistence(cache), TaskTable()
    return Runs(engine, table, mem, cache, Counter(), default_max_tokens=3), mem, table, cache


async def finished(t: Task) -> Task:
    await asyncio.wait_for(t.done.wait(), 5)
    return t


async def test_a_run_feeds_the_history_from_state_pos_and_accounts_its_state():
    eng = FakeEngine()
    runs, _, table, cache = make_runs(eng)
    t = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP, params={"temperature": 0}), [1, 2, 3],
                                        new=True))
    sub = eng.submissions[0]
    assert sub.prompt == [1, 2, 3] and sub.init_state is None and sub.params.max_tokens == 3
    assert sub.params.temperature == 0 and sub.request_id.startswith(t.id)
    assert t.finish_reason == "length" and t.out.text == "<100><101><102>" and list(t.tokens) == [1, 2, 3, 100, 101, 102]
    assert t.state_pos == len(t.tokens) - 1 == consumed(cache.get(t.state_id))  # the last token pending
    assert table.live[t.id] is t and cache.pinned_keys() == set()
    old = t.state_id
    await finished(await runs.start(t, [7], new=False))  # the same task, a new prompt
    sub = eng.submissions[1]
    assert sub.prompt == [102, 7] and consumed(sub.init_state) == 5  # pending token + the prompt only
    assert t.state_pos == len(t.tokens) - 1 == consumed(cache.get(t.state_id)) and old not in cache


@pytest.mark.parametrize("load, status", [((0, 0), PREFILL), ((3, 4), PREFILL), ((4, 4), READY), ((8, 0), READY)])
async def test_a_run_is_ready_only_when_the_sequences_ahead_fill_every_slot(load, status):
    # READY means "waiting for a free slot"; sequences waiting on an engine with free slots
    # (admitted at its next step) do not make the new run wait
    runs, *_ = make_runs(FakeEngine(gate=asyncio.Event(), load=load))  # 8 slots
    t = await runs.start(Task(id=new_id(TMP), kind=TMP), [1, 2], new=True)
    assert t.status == status
    runs.abort(t)
    await finished(t)


async def test_a_run_that_feeds_nothing_is_not_ready_on_an_idle_engine():
    # a prefill-only continue of a prefill-only task has nothing to feed (its state is current):
    # it submits nothing, so it waits for no slot; it read READY (TaskTable.claim's status)
    eng = FakeEngine()
    runs, *_ = make_runs(eng)
    t = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP, params={"max_tokens": 0}), [1, 2], new=True))
    n = len(eng.submissions)
    again = await runs.start(t, None, new=False)
    assert again.status == PREFILL and len(eng.submissions) == n
    assert (await finished(t)).finish_reason == "length" and t.status == FINISHED


async def test_a_stop_token_makes_eos_the_pending_token():
    eng = FakeEngine(finish=STOP)
    runs, _, _, cache = make_runs(eng)
    t = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP), [1, 2], new=True))
    assert t.finish_reason == "stop" and list(t.tokens) == [1, 2, 100, 101, 102, 0]
    assert t.state_pos == len(t.tokens) - 1 == consumed(cache.get(t.state_id))


async def test_stop_and_close_end_runs_as_stopped_and_interrupted():
    eng = FakeEngine(gate=asyncio.Event())
    runs, _, _, cache = make_runs(eng)
    a = await runs.start(Task(id=new_id(TMP), kind=TMP), [1, 2], new=True)
    b = await runs.start(Task(id=new_id(TMP), kind=TMP), [3, 4], new=True)
    with pytest.raises(TaskConflict):
        await runs.start(a, None, new=False)  # running: cannot start twice
    runs.abort(a)
    assert (await finished(a)).finish_reason == "stopped"
    await runs.close()
    assert b.finish_reason == "interrupted" and b.state_pos == 2 == consumed(cache.get(b.state_id))


async def test_a_failed_run_keeps_the_old_state():
    eng = FakeEngine()
    runs, _, _, cache = make_runs(eng)
    t = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP), [1, 2], new=True))
    before = (t.state_id, t.state_pos)
    eng.error = "device lost"
    await finished(await runs.start(t, None, new=False))
    assert t.finish_reason == "error" and t.out.error == "device lost" and (t.state_id, t.state_pos) == before
    assert t.state_id in cache and cache.pinned_keys() == set()


async def test_a_persistent_run_commits_its_row_first_and_finishes_through_its_settle_write():
    eng = FakeEngine()
    runs, mem, _, cache = make_runs(eng)
    t = await runs.start(Task(id=new_id(TASK), kind=TASK), [1, 2], new=True)
    assert mem.started == [t.id]
    for _ in range(200):
        if mem.settles:
            break
        await asyncio.sleep(0.005)
    (job, fut), = mem.settles
    assert t.running and not t.out.finished  # not shown finished before the write commits
    assert job.outcome == Outcome("length", None) and job.row["status"] == FINISHED and job.key == t.state_id
    assert consumed(job.state) == t.state_pos == job.pos and t.state_id in cache.pinned_keys()  # until written
    assert "state_id" not in job.row and job.row["instance"] is None  # the state pointer moves when it is written
    job.task.finish(*job.outcome)  # what Persistence does after the commit
    fut.set_result(None)
    assert (await finished(t)).finish_reason == "length" and t.saved is fut


# --- the TaskManager over the scripted engine and a real SQLite file ------------------------------
def manager(eng: FakeEngine, path, **kw) -> TaskManager:
    cfg = TaskConfig(db=str(path), default_max_tokens=3, tmp_task_ttl=60, **kw)
    return TaskManager(eng, FakeTokenizer(), cfg, FakeShape())


async def test_bad_params_never_reach_the_engine_or_the_store(tmp_path):
    eng = FakeEngine()
    tm = manager(eng, tmp_path / "m.db")
    await tm.start()
    try:
        src = await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)
        n = len(eng.submissions)
        for call in (lambda: tm.create("x", {"temperature": -1}, persistent=True),
                     lambda: tm.create("x", {"stop_token_ids": [5000]}),
                     lambda: tm.fork(src.id, {"top_p": 2}),
                     lambda: tm.continue_(src.id, {"max_tokens": "many"})):
            with pytest.raises(TaskInvalid):
                await call()
        assert len(eng.submissions) == n and (await tm.store.counts())["tasks"] == 1
        assert src.params == {} and not src.running
    finally:
        await tm.close()


async def test_a_continue_after_a_restart_starts_from_the_stored_state(tmp_path):
    eng = FakeEngine()
    tm = manager(eng, tmp_path / "c.db")
    await tm.start()
    t = await tm.wait((await tm.create("hey", {"max_tokens": 2}, persistent=True)).id, timeout=10)
    await tm.flush()
    assert t.state_pos == 4 and tm.db_state_bytes > 0
    await tm.close()
    tm = manager(eng, tmp_path / "c.db")
    await tm.start()
    try:
        c = await tm.wait((await tm.continue_(t.id, {"max_tokens": 2})).id, timeout=10)
        sub = eng.submissions[-1]
        assert sub.prompt == [101] and consumed(sub.init_state) == 4 and tm.counters["db_state_loads"] == 1
        assert c.out.text == "<100><101><100><101>" and c.state_pos == len(c.tokens) - 1 == 6
        assert tm.stats()["tiers"]["database"]["hits"] == 1 and (await tm.list())["database_count"] == 1
    finally:
        await tm.close()


def test_servers_on_port_0_get_names_of_their_own():
    # `<host>:0` for every --port 0 server of a host: a second one taking the first's instance
    # for dead at its start (and marking its running tasks interrupted)
    from server.tasks.config import server_name

    a, b = server_name("", 0), server_name("", 0)
    assert a != b and not a.endswith(":0")
    assert server_name("", 8000) == server_name("", 8000) and server_name("api-1", 0) == "api-1"


def test_a_failed_start_gives_back_the_text_a_continue_took_back():
    """Snapshot.restore after Output.take_back: the output is again exactly what it was (a
    continue that could not start leaves its task as it found it)."""
    from server.tasks.output import Output
    from server.tasks.table import Snapshot

    t = Task(id=new_id(TASK), kind=TASK, out=Output("ab\ufffd", [1, 2, 3]))
    before = Snapshot.of(t, {})
    t.out.take_back(1)
    assert (t.out.text, list(t.out.offsets)) == ("ab", [1, 2, 2])
    t.out.append("c", 1)
    before.restore(t)
    assert (t.out.text, list(t.out.offsets)) == ("ab\ufffd", [1, 2, 3])


async def test_a_tmp_state_the_cache_dropped_reads_rebuild(tmp_path):
    """docs/task-api.md: `state` is `rebuild` once the newest state is gone. A TMP_ state larger
    than the tmp tier's budget is dropped as the run settles (the task still showed running
    then): it read `cached`, in get_result and list, while its next run re-fed the history."""
    eng = FakeEngine()
    tm = manager(eng, tmp_path / "r.db", tmp_state_bytes=1)
    await tm.start()
    try:
        t = await tm.wait((await tm.create("hey", {"max_tokens": 2})).id, timeout=10)
        assert t.state_id is None and t.state == "rebuild" and t.response(tm.cache)["state"] == "rebuild"
        assert [x["state"] for x in (await tm.list())["tasks"] if x["task_id"] == t.id] == ["rebuild"]
        await tm.wait((await tm.continue_(t.id, {"max_tokens": 1})).id, timeout=10)
        assert eng.submissions[-1].init_state is None and len(eng.submissions[-1].prompt) == 5  # the whole history
    finally:
        await tm.close()


async def test_a_fork_that_kept_its_tmp_source_s_state_reads_rebuild_once_it_is_gone(tmp_path):
    """A prefill-only fork without a prompt feeds nothing and keeps its source's state; when the
    cache drops that TMP_ state (the tmp tier holds one state here), the fork says so too."""
    eng = FakeEngine()
    tm = manager(eng, tmp_path / "f.db", tmp_state_bytes=counted_state(0).nbytes())
    await tm.start()
    try:
        src = await tm.wait((await tm.create("src", {"max_tokens": 2})).id, timeout=10)
        fork = await tm.wait((await tm.fork(src.id, {"max_tokens": 0}, tmp=True)).id, timeout=10)
        assert fork.state_id == src.state_id and fork.response(tm.cache)["state"] == "cached"
        await tm.wait((await tm.create("another", {"max_tokens": 2})).id, timeout=10)  # takes the tier
        assert src.state == "rebuild"  # the eviction moved the source back
        assert fork.response(tm.cache)["state"] == "rebuild"
        assert [x["state"] for x in (await tm.list())["tasks"] if x["task_id"] == fork.id] == ["rebuild"]
    finally:
        await tm.close()


async def test_db_tasks_are_the_stored_tasks_of_the_page(tmp_path):
    """docs/task-api.md: `db_tasks` lists the stored tasks on this page; with TMP_ tasks newer
    than every stored one, a first page holds no stored task."""
    eng = FakeEngine()
    tm = manager(eng, tmp_path / "l.db")
    await tm.start()
    try:
        stored = await tm.wait((await tm.create("kept", persistent=True)).id, timeout=10)
        tmps = []
        for i in range(4):
            await asyncio.sleep(0.01)  # distinct created_at, newest first
            tmps.append(await tm.wait((await tm.create(f"tmp {i}")).id, timeout=10))
        first = await tm.list(limit=3)
        assert [x["task_id"] for x in first["tasks"]] == [t.id for t in tmps[::-1][:3]]
        assert first["db_tasks"] == [] and first["database_count"] == 1
        second = await tm.list(limit=3, offset=3)
        assert [x["task_id"] for x in second["tasks"]] == [tmps[0].id, stored.id]
        assert second["db_tasks"] == [stored.id]
    finally:
        await tm.close()


async def test_a_hidden_lead_applies_while_the_output_shows_no_text():
    """A task's `hidden_lead` (a /v1/responses reply) reaches the run's SamplingParams while its
    output holds no other character than whitespace: a new prompt starts a new output (hidden
    again); a continue without one extends text already shown (its stops match from its end)."""
    eng = FakeEngine()
    runs, *_ = make_runs(eng)
    t = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP, params={"hidden_lead": True}), [1], new=True))
    await finished(await runs.start(t, None, new=False))  # the output is "<100><101><102>"
    await finished(await runs.start(t, [7], new=False))
    plain = await finished(await runs.start(Task(id=new_id(TMP), kind=TMP), [1], new=True))
    await finished(await runs.start(plain, [7], new=False))
    assert [s.params.hidden_lead for s in eng.submissions] == [True, False, True, False, False]
    assert clean_params({"hidden_lead": False}, VOCAB) == {"hidden_lead": False}
    with pytest.raises(TaskInvalid) as exc:
        clean_params({"hidden_lead": "yes"}, VOCAB)
    assert exc.value.param == "hidden_lead"
