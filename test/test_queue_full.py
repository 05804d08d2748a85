"""`--max-queue` bounds the requests that WAIT FOR A SLOT: a request that a free slot will take
does not count, even before the engine's loop has taken it from its inbox. (It once counted
every request the loop had not taken yet: a burst on an idle server got 429 queue_full with
every slot free.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from util_server import running_server

from server.config import Settings
from server.engine import Engine, QueueFullError, SamplingParams
from server.model import load_model
from server.tokenizer import get_tokenizer

LONG = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("synthetic:tiny")


def held_engine(model, max_batch: int, max_queue: int) -> Engine:
    """An engine whose loop does not run: its steps are taken by hand (Engine.step)."""
    from server.engine.runner import Runner

    e = Engine(model, get_tokenizer(), Settings(max_batch=max_batch, max_queue=max_queue, step_token_budget=64,
                                                prefill_chunk=16, stats_interval=0.0))  # fmt: skip
    e._runner = Runner(model, e.max_batch)
    return e


def test_a_burst_takes_the_free_slots_then_max_queue_more(model):
    """4 free slots, max_queue 2, nothing taken by the loop yet: 6 are accepted (4 will run, 2
    wait), the 7th is refused; the loop's steps change nothing while every slot stays busy."""
    e = held_engine(model, max_batch=4, max_queue=2)
    for i in range(6):
        e.submit([1, 2, 3], LONG, request_id=f"r{i}")
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        e.submit([1], LONG, request_id="r6")
    e.step()  # the loop takes them: 4 run, 2 wait in the scheduler
    assert (e.scheduler.num_running, e.scheduler.num_waiting) == (4, 2)
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        e.submit([1], LONG, request_id="r6")
    e.step()
    with pytest.raises(QueueFullError):
        e.submit([1], LONG, request_id="r6")
    st = e.stats()
    assert (st.running, st.waiting, st.slots) == (4, 2, 4)


def test_with_every_slot_busy_only_max_queue_wait(model):
    """All 4 slots run: 2 more may wait, the 3rd is refused; a slot freed (an abort) takes one
    waiting request, which leaves one place in the queue."""
    e = held_engine(model, max_batch=4, max_queue=2)
    for i in range(4):
        e.submit([1, 2], LONG, request_id=f"run{i}")
    e.step()
    assert e.scheduler.num_running == 4 and e.scheduler.num_waiting == 0
    e.submit([1], LONG, request_id="w0")
    e.submit([1], LONG, request_id="w1")
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        e.submit([1], LONG, request_id="w2")
    assert e.abort("run0")
    e.step()  # run0 leaves, w0 takes its slot, w1 waits
    assert e.scheduler.num_running == 4 and e.scheduler.num_waiting == 1
    e.submit([1], LONG, request_id="w2")
    with pytest.raises(QueueFullError):
        e.submit([1], LONG, request_id="w3")


def test_the_stats_count_as_waiting_only_what_no_free_slot_takes(model):
    """/health and rwkv_requests_waiting: queued requests that free slots will take count as
    running, so `waiting` never exceeds max_queue (and running + waiting is every request the
    engine holds, as the router's load and the task manager's READY status read it)."""
    e = held_engine(model, max_batch=4, max_queue=2)
    for i in range(3):
        e.submit([1], LONG, request_id=f"a{i}")
    st = e.stats()
    assert (st.running, st.waiting) == (3, 0)
    for i in range(3):
        e.submit([1], LONG, request_id=f"b{i}")
    st = e.stats()
    assert (st.running, st.waiting) == (4, 2)


def test_concurrent_creates_on_an_idle_server_are_all_accepted(tmp_path):
    """--max-queue 2, 32 slots (the CPU's default), an idle server: 10 concurrent creates all
    fit in free slots, so none is a 429."""
    with running_server(tmp_path, args=("--max-queue", "2")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").json()["slots"] > 10

            def create(_: int) -> httpx.Response:
                return c.post("/v1/tasks/tmp", json={"prompt": "hi", "max_tokens": 5})

            for _ in range(3):  # a few bursts (each ends at once: tmp tasks answer before they end)
                with ThreadPoolExecutor(10) as pool:
                    codes = [r.status_code for r in pool.map(create, range(10))]
                assert codes == [200] * 10, codes
