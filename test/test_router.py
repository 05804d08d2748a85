"""One engine per device behind one server (server.engine.router, `--devices`): where the router
places work, what it does when an engine dies, and two real CPU engines in one server (the CPU
slice of the multi-GPU issue: the same code runs one engine per GPU)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from server.config import Settings
from server.engine.router import EngineRouter
from server.engine.types import EngineDeadError, EngineStats, GrammarSpec, QueueFullError, SamplingParams
from server.engine.types import Result as EngineResult
from util_server import inprocess_server

GREEDY = dict(temperature=0.0, presence_penalty=0.0, repetition_penalty=0.0)


@dataclass
class Eng:
    """An engine that records what reaches it; its load and liveness are set by the test."""

    max_batch: int = 8
    running: int = 0
    waiting: int = 0
    alive: bool = True
    full: bool = False
    got: list[str] = field(default_factory=list)
    grammars: list[GrammarSpec] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    @property
    def is_alive(self) -> bool:
        return self.alive

    def submit(self, prompt, params=None, *, init_state=None, request_id=None, return_state=False,
               end_before_state=False, history=0):  # fmt: skip
        if not self.alive:
            raise EngineDeadError("dead")
        if self.full:
            raise QueueFullError("full")
        self.got.append(request_id)
        self.waiting += 1  # as a real engine counts a submission its loop has not taken yet
        return request_id

    def abort(self, request_id: str) -> bool:
        if request_id in self.got:
            self.aborted.append(request_id)
            return True
        return False

    def compile_grammar(self, spec: GrammarSpec) -> None:
        self.grammars.append(spec)

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, waiting=self.waiting, slots=self.max_batch, steps=3,
                           generation_tokens_total=10, decode_tok_s=100.0)  # fmt: skip

    def shutdown(self, timeout: float = 30.0) -> None:
        self.alive = False


def test_new_work_goes_to_the_least_loaded_engine_and_a_burst_spreads():
    a, b, c = Eng(running=6), Eng(running=2), Eng(max_batch=16, running=4)  # loads 0.75, 0.25, 0.25
    r = EngineRouter([a, b, c], ["cuda:0", "cuda:1", "cuda:2"])
    assert r.max_batch == 32
    r.submit([1], request_id="first")
    assert b.got == ["first"]  # a tie (0.25) goes to the first in --devices order
    for i in range(12):
        r.submit([1], request_id=f"r{i}")
    loads = [(e.running + e.waiting) / e.max_batch for e in (a, b, c)]
    assert max(loads) - min(loads) <= 0.25, loads  # each submission counted at once: the burst spread
    assert len(a.got) == 1 and len(b.got) == 4 and len(c.got) == 8


def test_a_full_queue_or_a_dead_engine_passes_the_work_on():
    a, b = Eng(full=True), Eng(running=7)
    r = EngineRouter([a, b], ["cuda:0", "cuda:1"])
    r.submit([1], request_id="x")
    assert b.got == ["x"]
    b.full = True
    with pytest.raises(QueueFullError):
        r.submit([1], request_id="y")
    a.full, a.alive = False, False  # died: skipped, and submit's own EngineDeadError is not the answer
    with pytest.raises(QueueFullError):
        r.submit([1], request_id="z")
    b.alive = False
    assert not r.is_alive
    with pytest.raises(EngineDeadError):
        r.submit([1], request_id="w")


def test_a_dead_engine_takes_no_work_and_the_sums_count_the_live_ones(caplog):
    a, b = Eng(), Eng(running=3)
    r = EngineRouter([a, b], ["cuda:0", "cuda:1"])
    a.alive = False
    for i in range(3):
        r.submit([1], request_id=f"r{i}")
    assert a.got == [] and len(b.got) == 3 and r.is_alive
    assert sum("the engine on cuda:0 stopped" in m for m in caplog.messages) == 1  # logged once
    st = r.stats()
    assert (st.slots, st.running, st.waiting) == (8, 3, 3)  # capacity: the live engine's
    assert st.generation_tokens_total == 20 and st.steps == 6  # counters: every engine's
    assert (st.engines, st.engines_alive, st.extra) == (2, 1, {})
    assert [(d, alive) for d, alive, _ in r.engines()] == [("cuda:0", False), ("cuda:1", True)]


def test_abort_reaches_the_holder_and_grammars_reach_every_live_engine():
    a, b = Eng(), Eng(running=8)
    r = EngineRouter([a, b], ["cpu", "cpu"])
    r.submit([1], request_id="held-by-a")
    assert r.abort("held-by-a") and a.aborted == ["held-by-a"] and b.aborted == []
    assert not r.abort("unknown")
    b.alive = False
    spec = GrammarSpec(kind="regex", source="a+")
    r.compile_grammar(spec)
    assert a.grammars == [spec] and b.grammars == []


def test_the_devices_setting():
    assert Settings(devices="cpu,cpu").resolved_devices() == ["cpu", "cpu"]
    assert Settings(devices=" cuda , cuda:1 ").resolved_devices() == ["cuda:0", "cuda:1"]
    assert Settings(devices="", device="cpu").resolved_devices() == ["cpu"]
    for bad, why in (("cuda:0,cuda:0", "named twice"), ("cpu,cuda:1", "mixes"), ("tpu", "not cpu")):
        with pytest.raises(ValueError, match=why):
            Settings(devices=bad).resolved_devices()
    from server.checks import settings_problem

    assert settings_problem(Settings(devices="cpu,cpu")) is None
    assert "named twice" in (settings_problem(Settings(devices="cuda:1,cuda:1")) or "")


# --- two real engines ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(parts):
    """Two started CPU engines on the same tiny model behind a router."""
    from server.engine import Engine

    model, tok, _ = parts
    engines = [Engine(model, tok, Settings(device="cpu", max_batch=4, stats_interval=0, cuda_graphs=False)).start()
               for _ in range(2)]  # fmt: skip
    router = EngineRouter(engines, ["cpu", "cpu"])
    yield router, engines
    router.shutdown()


def test_either_engine_gives_the_same_tokens_and_takes_the_others_states(two):
    router, engines = two
    params = SamplingParams(max_tokens=12, seed=5)
    prompt = [11, 22, 33, 44, 55]
    alone = [e.submit(prompt, params, return_state=True).result(60) for e in engines]
    assert alone[0].token_ids == alone[1].token_ids and alone[0].state is not None
    # the state engine 0 finished with, continued on engine 1, equals continuing it on engine 0
    more = SamplingParams(max_tokens=6, seed=9)
    cont = [e.submit([7, 8], more, init_state=alone[0].state).result(60).token_ids for e in engines]
    assert cont[0] == cont[1]
    handles = [router.submit(prompt, params) for _ in range(8)]  # 8 on 2 x 4 slots: both engines run
    assert all(h.result(60).token_ids == alone[0].token_ids for h in handles)
    assert all(e.stats().generation_tokens_total >= 12 * 4 for e in engines)


def test_a_dying_engine_fails_its_own_requests_and_the_server_goes_on(parts):
    from server.engine import Engine

    model, tok, _ = parts
    engines = [Engine(model, tok, Settings(device="cpu", max_batch=2, stats_interval=0, cuda_graphs=False)).start()
               for _ in range(2)]  # fmt: skip
    router = EngineRouter(engines, ["cpu", "cpu"])
    try:
        long = SamplingParams(max_tokens=100_000, ignore_eos=True, **GREEDY)
        handles = [router.submit([1, 2, 3], long) for _ in range(2)]  # one per engine
        assert [e.stats().running + e.stats().waiting for e in engines] == [1, 1]
        engines[1].shutdown(5.0)  # what a GPU fault does to its engine's loop
        results: dict[int, EngineResult | Exception] = {}
        for i, h in enumerate(handles):
            if i == 1:
                with pytest.raises(EngineDeadError):
                    h.result(30)
            else:
                h.abort()
                results[i] = h.result(30)
        assert results[0].finish_reason == "abort"
        assert router.is_alive and router.stats().engines_alive == 1
        r = router.submit([4, 5], SamplingParams(max_tokens=3, **GREEDY)).result(30)
        assert r.finish_reason == "length" and len(r.token_ids) == 3
    finally:
        router.shutdown()


def test_a_device_fault_takes_the_engine_out_at_its_first_failed_step(parts):
    """A CUDA error torch reports as such (torch.AcceleratorError: an illegal access, a lost GPU)
    leaves the device unusable: the engine's loop dies at once instead of failing two more steps'
    requests, so the router sends the very next request elsewhere."""
    import torch

    from server.engine import Engine

    model, tok, _ = parts
    engines = [Engine(model, tok, Settings(device="cpu", max_batch=2, stats_interval=0, cuda_graphs=False)).start()
               for _ in range(2)]  # fmt: skip
    router = EngineRouter(engines, ["cpu", "cpu"])
    try:
        runner = engines[0].runner

        def fault(*args, **kwargs):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

        runner.launch = fault  # the next decode step of engine 0 faults
        h = router.submit([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))  # engine 0: the first of equals
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            h.result(30)
        assert not engines[0].is_alive and engines[1].is_alive
        r = router.submit([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY)).result(30)
        assert r.finish_reason == "length" and engines[1].stats().generation_tokens_total == 4
    finally:
        router.shutdown()


# --- one server, two engines -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real uvicorn server in this process with `devices=cpu,cpu` (so a test can stop one engine)."""
    db = tmp_path_factory.mktemp("router") / "tasks.db"
    with inprocess_server(Settings(devices="cpu,cpu", db=str(db), stats_interval=0, max_batch=4)) as (url, app):
        yield url, app


def wait_finished(c: httpx.Client, task_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not c.get(f"/v1/tasks/{task_id}/get_result").json()["finished"]:
        assert time.monotonic() < deadline, f"{task_id} did not finish"
        time.sleep(0.05)


def device_metric(c: httpx.Client, name: str) -> list[float]:
    from server.api.metrics import parse_metrics

    m = parse_metrics(c.get("/metrics").text)
    return [m[f'{name}{{device="cpu",engine="{i}"}}'] for i in range(2)]


def test_one_server_spreads_completions_and_template_forks_over_both_engines(server):
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as c:
        h = c.get("/health").json()
        assert h["engines"] == h["engines_alive"] == 2 and h["slots"] == 8
        from server.api.metrics import parse_metrics

        m = parse_metrics(c.get("/metrics").text)
        assert m["rwkv_engine_engines"] == m["rwkv_engine_engines_alive"] == 2
        gen0 = device_metric(c, "rwkv_device_generation_tokens_total")
        body = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as c2:  # 8 at once on 2 x 4 slots
            threads = [threading.Thread(target=c2.post, args=("/v1/completions",), kwargs={"json": body})
                       for _ in range(8)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        gen1 = device_metric(c, "rwkv_device_generation_tokens_total")
        assert all(b - a >= 24 for a, b in zip(gen0, gen1)), (gen0, gen1)
        # a template prefilled once, forked on both engines (its state is in host memory)
        prefill0 = sum(device_metric(c, "rwkv_device_prompt_tokens_total"))
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens
        src = c.post("/v1/tasks/create", json={"prompt": long_prompt, "max_tokens": 0}).json()["task_id"]
        wait_finished(c, src)
        tpl = c.post(f"/v1/tasks/{src}/as_template", json={}).json()["task_id"]
        prefill1 = sum(device_metric(c, "rwkv_device_prompt_tokens_total"))
        gen2 = device_metric(c, "rwkv_device_generation_tokens_total")
        forks = [c.post(f"/v1/tasks/{tpl}/fork?tmp=true", json={"prompt": " And", "max_tokens": 16,
                                                                  "ignore_eos": True}).json()["task_id"]
                 for _ in range(8)]  # fmt: skip
        for t in forks:
            wait_finished(c, t)
        prefill2 = sum(device_metric(c, "rwkv_device_prompt_tokens_total"))
        gen3 = device_metric(c, "rwkv_device_generation_tokens_total")
    template_tokens = prefill1 - prefill0
    assert template_tokens >= 150
    assert prefill2 - prefill1 <= 8 * 4, "a fork prefilled the template again"
    assert all(b - a >= 16 for a, b in zip(gen2, gen3)), (gen2, gen3)


def test_an_engine_that_dies_leaves_the_server_serving(server):
    url, app = server
    router = app.state.services.engine
    assert isinstance(router, EngineRouter)
    router._engines[1].shutdown(5.0)  # what a GPU fault does to its engine's loop
    with httpx.Client(base_url=url, timeout=60) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["engines_alive"] == 1 and h.json()["slots"] == 4
        assert device_metric(c, "rwkv_device_engine_alive") == [1.0, 0.0]
        for _ in range(4):
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
