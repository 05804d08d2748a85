"""A run that leaves its task's state current keeps that state in memory: a continue without a
prompt of an output EOS ended (it reads the pending EOS and stops at once), a run that fails, a
prefill-only run with nothing to feed. None of them makes a new state, so the next run starts from
the cached one, with no database read (counter `db_state_loads`). A state a run truly replaced
still leaves memory (nothing kept beyond the task's current state: the cache's bytes are its)."""

from __future__ import annotations

import pytest
import torch
from task_fakes import FakeEngine, FakeShape, FakeTokenizer, consumed, counted_state
from util_models import walk_checkpoint

from server.config import Settings
from server.tasks import TaskConfig, TaskManager
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
