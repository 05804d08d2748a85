"""A run that leaves its task's state current keeps that state in memory: a continue without a
prompt of an output EOS ended (it reads the pending EOS and stops at once), a run that fails, a
prefill-only run with nothing to feed, a run stopped while it waits for a slot (the engine hands
back a copy of its starting state: it fed nothing). None of them makes a new state, so the next
run starts from the cached one, with no database read (counter `db_state_loads`). A state a run
truly replaced still leaves memory (nothing kept beyond the task's current state: the cache's
bytes are its)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from task_fakes import FakeEngine, FakeHandle, FakeShape, FakeTokenizer, consumed, counted_state
from util_models import walk_checkpoint

from server.config import Settings
from server.engine.types import SamplingParams
from server.tasks import TaskConfig, TaskManager
from server.tasks.records import READY
from server.tokenizer import get_tokenizer

GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
ONE = counted_state(0).nbytes()


def only_current(tm: TaskManager, *tasks) -> None:
    """The cache holds the tasks' current states and nothing else, none pinned."""
    assert tm.cache.keys() == {t.state_id for t in tasks}
    assert tm.cache.pinned_keys() == set()


# --- the real engine: a model whose greedy output is "hi", then EOS, and EOS after every EOS --------
@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    from server.engine import Engine
    from server.model import load_model

    tok = get_tokenizer()
    hi = tok.token_table.index(b"hi")
    path = walk_checkpoint(tmp_path_factory.mktemp("walk") / "walk.pth", [hi, 0])
    model = load_model(path, device="cpu", dtype=torch.float32, state_dtype=torch.float32)
    eng = Engine(model, tok, Settings(device="cpu", max_batch=8, stats_interval=0, cuda_graphs=False))
    eng.start()
    yield model, tok, eng
    eng.shutdown()


@pytest.fixture
async def tm_walk(walk, tmp_path):
    model, tok, eng = walk
    s = Settings(db=str(tmp_path / "walk.db"), device="cpu", stats_interval=0, default_max_tokens=20)
    m = TaskManager(eng, tok, s, model.shape)
    await m.start()
    yield m
    await m.close()


async def test_a_continue_that_stops_at_once_keeps_the_state_in_memory(tm_walk):
    tm = tm_walk
    t = await tm.wait((await tm.create("x", GREEDY, persistent=True)).id, timeout=60)
    assert (t.out.text, t.finish_reason) == ("hi", "stop") and t.tokens[-1] == 0  # EOS pending
    await tm.flush()  # stored, and cached (unpinned: in the tasks' LRU)
    kept = (list(t.tokens), t.state_id, t.state_pos)
    assert t.state_id in tm.cache and t.state == "stored"
    # no prompt: it reads the pending EOS, meets EOS at once, and keeps its state (EOS still pending)
    await tm.wait((await tm.continue_(t.id)).id, timeout=60)
    await tm.flush()
    assert (t.out.text, t.finish_reason, t.tokens[-1]) == ("hi", "stop", 0)  # the output as it was
    assert (list(t.tokens), t.state_id, t.state_pos) == kept
    assert t.state_id in tm.cache  # it is still current: it stays in memory
    only_current(tm, t)
    loads = tm.counters["db_state_loads"]
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 1}, "x")).id, timeout=60)
    assert t.out.text == "hi" and t.prompt_tokens == 2  # the pending EOS and "x": no rebuild
    assert tm.counters["db_state_loads"] == loads  # from memory, not read from the database again
    await tm.flush()
    only_current(tm, t)  # the state it replaced left memory


async def test_a_fork_that_stops_at_once_keeps_its_sources_state_in_memory(tm_walk):
    tm = tm_walk
    src = await tm.wait((await tm.create("x", GREEDY, persistent=True)).id, timeout=60)
    await tm.flush()
    f = await tm.wait((await tm.fork(src.id)).id, timeout=60)
    await tm.flush()
    assert (f.finish_reason, f.completion_tokens, f.state_id) == ("stop", 0, src.state_id)
    only_current(tm, src)
    loads = tm.counters["db_state_loads"]
    await tm.wait((await tm.continue_(f.id, {"max_tokens": 1}, "x")).id, timeout=60)
    assert f.out.text == "hi" and f.prompt_tokens == 2 and tm.counters["db_state_loads"] == loads
    await tm.flush()
    only_current(tm, src, f)


# --- the scripted engine: runs that fail, prefill-only runs with nothing to feed -------------------
async def manager(eng: FakeEngine, path) -> TaskManager:
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3), FakeShape())
    await tm.start()
    return tm


async def test_a_run_that_fails_keeps_the_state_in_memory(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "e.db")
    try:
        t = await tm.wait((await tm.create("p", persistent=True)).id, timeout=10)
        await tm.flush()
        kept = (t.state_id, t.state_pos)
        eng.error = "boom"
        await tm.wait((await tm.continue_(t.id)).id, timeout=10)
        eng.error = None
        await tm.flush()
        assert t.finish_reason == "error" and (t.state_id, t.state_pos) == kept
        only_current(tm, t)
        await tm.wait((await tm.continue_(t.id)).id, timeout=10)
        sub = eng.submissions[-1]
        assert sub.init_state is not None and consumed(sub.init_state) == kept[1]  # from the kept state
        assert tm.counters["db_state_loads"] == 0  # ...in memory
        await tm.flush()
        assert t.finish_reason == "length" and t.state_id != kept[0]
        only_current(tm, t)  # the state it replaced left memory
        assert tm.stats()["tiers"]["tasks_lru"]["bytes"] == ONE
    finally:
        await tm.close()


async def test_a_prefill_only_run_with_nothing_to_feed_keeps_the_state_in_memory(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "z.db")
    try:
        t = await tm.wait((await tm.create("p", persistent=True)).id, timeout=10)
        await tm.flush()
        kept = (t.state_id, t.state_pos)
        n = len(eng.submissions)
        await tm.wait((await tm.continue_(t.id, {"max_tokens": 0})).id, timeout=10)  # its state is current
        await tm.flush()
        assert len(eng.submissions) == n and (t.state_id, t.state_pos) == kept  # nothing was fed
        only_current(tm, t)
        await tm.wait((await tm.continue_(t.id, {"max_tokens": 2})).id, timeout=10)
        assert eng.submissions[-1].init_state is not None and tm.counters["db_state_loads"] == 0
        await tm.flush()
        only_current(tm, t)
    finally:
        await tm.close()


async def test_a_tmp_task_that_fails_keeps_its_state_and_a_replaced_one_goes(tmp_path):
    eng = FakeEngine()
    tm = await manager(eng, tmp_path / "t.db")
    try:
        t = await tm.wait((await tm.create("p")).id, timeout=10)
        kept = t.state_id
        eng.error = "boom"
        await tm.wait((await tm.continue_(t.id)).id, timeout=10)
        eng.error = None
        assert t.finish_reason == "error" and t.state_id == kept  # (its history has the tokens it streamed)
        only_current(tm, t)
        await tm.wait((await tm.continue_(t.id)).id, timeout=10)
        assert eng.submissions[-1].init_state is not None and t.state_id != kept
        only_current(tm, t)
        assert tm.stats()["tiers"]["tmp"]["bytes"] == ONE
    finally:
        await tm.close()


# --- a run that feeds nothing (stopped while it waits for a slot) ------------------------------
# The engine's contract: a sequence aborted before it was fed returns a copy of its starting
# state (all its input pending): covered == 0, the same state. The task keeps the one it has:
# no new key, no write of that copy, its state_pos as it was, and that state stays in memory.
class Full:
    """Every slot of the engine taken by a sequence that runs until it is aborted."""

    def __init__(self, eng) -> None:
        self.eng, self.handles = eng, []

    async def __aenter__(self) -> Full:
        sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        self.handles = [self.eng.submit([1, 2], sp) for _ in range(self.eng.max_batch)]
        for _ in range(6000):
            if self.eng.stats().running == self.eng.max_batch:
                return self
            await asyncio.sleep(0.005)
        raise AssertionError(f"the engine runs {self.eng.stats().running} sequences")

    async def __aexit__(self, *exc) -> None:
        for h in self.handles:
            h.abort()
        for h in self.handles:
            await h.wait()


async def stopped_waiting(tm: TaskManager, eng, start) -> Any:
    """The task `start()` starts, stopped while it waits for a slot (status READY)."""
    async with Full(eng):
        t = await start()
        assert t.status == READY  # it waits for a slot: the engine fed it nothing
        await tm.stop(t.id)
        await tm.wait(t.id, timeout=60)
    assert (t.finish_reason, t.prompt_tokens > 0, t.completion_tokens) == ("stopped", True, 0)
    await tm.flush()
    return t


async def test_a_run_stopped_while_it_waits_for_a_slot_keeps_the_state(tm_walk, walk):
    tm, eng = tm_walk, walk[2]
    t = await tm.wait((await tm.create("x", GREEDY, persistent=True)).id, timeout=60)
    await tm.flush()
    kept, writes, n = (t.state_id, t.state_pos), tm.counters["state_writes"], len(t.tokens)
    await stopped_waiting(tm, eng, lambda: tm.continue_(t.id, {"max_tokens": 4}, "x"))
    assert tm.counters["state_writes"] == writes  # no copy of the same state written
    assert (t.state_id, t.state_pos) == kept and len(t.tokens) == n + 1  # the prompt joined the history
    assert t.stored_id == kept[0]  # the row names it still
    only_current(tm, t)
    loads = tm.counters["db_state_loads"]
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 1}, "x")).id, timeout=60)
    # from the kept state, in memory: the pending EOS, the stopped run's "x" and this one's
    assert (t.out.text, t.prompt_tokens, tm.counters["db_state_loads"]) == ("hi", 3, loads)
    await tm.flush()
    only_current(tm, t)


async def test_a_fork_stopped_while_it_waits_for_a_slot_names_its_sources_state(tm_walk, walk):
    tm, eng = tm_walk, walk[2]
    src = await tm.wait((await tm.create("x", GREEDY, persistent=True)).id, timeout=60)
    await tm.flush()
    writes = tm.counters["state_writes"]
    f = await stopped_waiting(tm, eng, lambda: tm.fork(src.id, {"max_tokens": 4}, "x"))
    # as a fork that stops at once: its state is its source's (shared, and stored)
    assert (f.state_id, f.state_pos, f.stored_id) == (src.state_id, src.state_pos, src.stored_id)
    assert tm.counters["state_writes"] == writes
    only_current(tm, src)
    loads = tm.counters["db_state_loads"]
    await tm.wait((await tm.continue_(f.id, {"max_tokens": 1}, "x")).id, timeout=60)
    assert (f.out.text, f.prompt_tokens, tm.counters["db_state_loads"]) == ("hi", 3, loads)
    await tm.flush()
    only_current(tm, src, f)


async def test_a_new_task_stopped_while_it_waits_for_a_slot_has_no_state(tm_walk, walk):
    tm, eng = tm_walk, walk[2]
    writes = tm.counters["state_writes"]
    t = await stopped_waiting(tm, eng, lambda: tm.create("x", {**GREEDY, "max_tokens": 4}, persistent=True))
    # nothing fed: no state to keep (not a copy of the zero state, written under a key)
    assert (t.state_id, t.state_pos, t.stored_id) == (None, 0, None)
    assert tm.counters["state_writes"] == writes
    only_current(tm)
    await tm.wait((await tm.continue_(t.id, {"max_tokens": 1})).id, timeout=60)
    assert (t.out.text, t.prompt_tokens) == ("hi", 1)  # fed from zero
    await tm.flush()
    only_current(tm, t)


# --- the scripted engine: a run aborted while it waits feeds `fed` of its tokens ---------------
class QueuedHandle(FakeHandle):
    def _finish(self) -> None:
        super()._finish()
        res = self._result
        if self.aborted and not self.tokens and res is not None:  # aborted before its first token
            fed = min(self.engine.fed, len(self.sub.prompt))
            base = consumed(self.sub.init_state) if self.sub.init_state is not None else 0
            res.pending_tokens, res.state = self.sub.prompt[fed:], counted_state(base + fed)


@dataclass
class QueuedEngine(FakeEngine):
    fed: int = 0
    """Tokens of its input a run aborted before its first token had fed (the engine's contract:
    the rest are pending; 0: it waited for a slot, its state is a copy of its starting one)."""

    def submit(self, prompt, params=None, **kw) -> FakeHandle:
        super().submit(prompt, params, **kw)
        self.handles[-1] = QueuedHandle(self, self.submissions[-1])
        return self.handles[-1]


async def finished_task(tm: TaskManager, tmp: bool):
    """A finished task (TMP or persistent) made from the prompt "p", its state written."""
    t = await tm.wait((await tm.create("p", persistent=not tmp)).id, timeout=10)
    await tm.flush()
    return t


async def stopped_before_its_first_token(tm: TaskManager, eng: QueuedEngine, t, fed: int) -> None:
    eng.gate, eng.fed = asyncio.Event(), fed  # runs wait until stopped
    await tm.continue_(t.id, {"max_tokens": 3}, "ab")
    await tm.stop(t.id)
    await tm.wait(t.id, timeout=10)
    eng.gate, eng.fed = None, 0
    await tm.flush()
    assert t.finish_reason == "stopped" and t.completion_tokens == 0


@pytest.fixture(params=[False, True], ids=["persistent", "tmp"])
async def queued(tmp_path, request):
    """(engine, manager, a finished task, whether it is TMP) on a QueuedEngine, closed after."""
    eng = QueuedEngine()
    tm = await manager(eng, tmp_path / "q.db")
    try:
        yield eng, tm, await finished_task(tm, request.param), request.param
    finally:
        await tm.close()


async def test_a_run_that_fed_nothing_keeps_the_state(queued):
    eng, tm, t, _ = queued
    kept, writes = (t.state_id, t.state_pos), tm.counters["state_writes"]
    await stopped_before_its_first_token(tm, eng, t, 0)
    assert (t.state_id, t.state_pos) == kept and tm.counters["state_writes"] == writes
    only_current(tm, t)
    await tm.wait((await tm.continue_(t.id)).id, timeout=10)
    sub = eng.submissions[-1]
    assert sub.init_state is not None and consumed(sub.init_state) == kept[1] and len(sub.prompt) == 3
    assert tm.counters["db_state_loads"] == 0
    await tm.flush()
    only_current(tm, t)


async def test_a_run_that_fed_one_token_saves_its_state(queued):
    eng, tm, t, tmp = queued
    old, pos, writes = t.state_id, t.state_pos, tm.counters["state_writes"]
    await stopped_before_its_first_token(tm, eng, t, 1)
    assert t.state_id != old and t.state_pos == pos + 1
    assert consumed(tm.cache.get(t.state_id)) == t.state_pos
    assert tm.counters["state_writes"] == writes + (0 if tmp else 1)
    only_current(tm, t)
