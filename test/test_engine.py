"""Engine tests on the tiny synthetic model (CPU): batching equals running alone, seeded
sampling, stop strings, abort, state continuation, failures, async iteration, dead loop."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from server.config import Settings
from server.engine import Engine, EngineDeadError, PromptTooLongError, QueueFullError, SamplingParams
from server.model import State, load_model
from server.tokenizer import get_tokenizer

GREEDY = dict(temperature=0.0, presence_penalty=0.0, repetition_penalty=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("synthetic:tiny")


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def make_engine(model, tok, start=True, **kw):
    s = dict(max_batch=8, step_token_budget=48, prefill_chunk=16, stats_interval=0.0)
    s.update(kw)
    e = Engine(model, tok, Settings(**s))
    return e.start() if start else e


@pytest.fixture
def engine(model, tok):
    e = make_engine(model, tok)
    yield e
    e.shutdown()


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 65530) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def test_64_concurrent_requests_equal_running_alone(engine):
    ps = prompts(64)
    params = [SamplingParams(max_tokens=i % 9, **GREEDY) for i in range(64)]
    handles = [engine.submit(p, q) for p, q in zip(ps, params)]
    together = [h.result(120) for h in handles]
    for r, q in zip(together, params):
        assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == q.max_tokens
    for i in range(0, 64, 5):  # alone, one after another
        alone = engine.submit(ps[i], params[i]).result(60)
        assert alone.token_ids == together[i].token_ids and alone.text == together[i].text
    st = engine.stats()
    assert st.running == 0 and st.waiting == 0 and st.generation_tokens_total >= sum(q.max_tokens for q in params)


def test_events_add_up_to_the_result(engine):
    h = engine.submit("Hello there", SamplingParams(max_tokens=12, **GREEDY))
    events = list(h)
    res = h.result(10)
    assert "".join(e.text for e in events) == res.text
    assert sum((e.token_ids for e in events), []) == res.token_ids
    assert [e.n_tokens for e in events] == list(range(1, 13))
    assert events[-1].finished and events[-1].finish_reason == "length" and not any(e.finished for e in events[:-1])
    assert res.prompt_tokens == len(get_tokenizer().encode("Hello there"))
    assert res.usage["total_tokens"] == res.prompt_tokens + 12


def test_seeded_sampling_is_reproducible_alone_or_with_others(engine):
    ps = prompts(12, seed=1)
    params = [SamplingParams(max_tokens=6, seed=100 + i, ignore_eos=True) for i in range(12)]
    together = [h.result(60) for h in [engine.submit(p, q) for p, q in zip(ps, params)]]
    for i in (0, 5, 11):
        assert engine.submit(ps[i], params[i]).result(60).token_ids == together[i].token_ids
    other = engine.submit(ps[0], SamplingParams(max_tokens=6, seed=999, ignore_eos=True)).result(60)
    assert other.token_ids != together[0].token_ids


def test_stop_string_across_tokens_does_not_leak(engine, tok):
    base = engine.submit("Once upon a time", SamplingParams(max_tokens=12, **GREEDY)).result(30)
    pieces = [tok.decode([t]) for t in base.token_ids]
    cut = len(pieces[0]) + len(pieces[1])  # a stop string spanning tokens 2 and 3
    full = "".join(pieces)
    stop = full[cut - 1 : cut + 2]
    assume = full.find(stop)
    h = engine.submit("Once upon a time", SamplingParams(max_tokens=12, stop=(stop,), **GREEDY))
    events = list(h)
    res = h.result(10)
    assert res.finish_reason == "stop" and res.text == full[:assume] == "".join(e.text for e in events)
    assert stop not in res.text and len(res.token_ids) < 12


def test_abort_frees_the_slot(model, tok):
    e = make_engine(model, tok, max_batch=1)
    try:
        h = e.submit([5, 6, 7], SamplingParams(max_tokens=100_000, **GREEDY), request_id="long")
        waiting = e.submit([8], SamplingParams(max_tokens=3, **GREEDY))
        next(iter(h))
        assert e.abort("long") and not e.abort("nope")
        res = h.result(10)
        assert res.finish_reason == "abort" and res.completion_tokens >= 1
        assert waiting.result(10).completion_tokens == 3 and e.stats().running == 0
    finally:
        e.shutdown()


def test_a_handle_says_when_its_sequence_got_a_slot(model, tok):
    """RequestHandle.admitted: False while the sequence waits for a slot, True once a step gave it
    one (the task layer shows a waiting run as READY / a response as queued until then)."""
    e = make_engine(model, tok, max_batch=1)
    try:
        h = e.submit([5, 6, 7], SamplingParams(max_tokens=100_000, **GREEDY), request_id="long")
        waiting = e.submit([8, 9], SamplingParams(max_tokens=3, **GREEDY))
        next(iter(h))
        time.sleep(0.2)  # (steps run meanwhile: the one slot stays the first's)
        assert h.admitted and not waiting.admitted
        e.abort("long")
        assert waiting.result(10).completion_tokens == 3 and waiting.admitted
    finally:
        e.shutdown()


def test_prefill_a_then_b_equals_prefill_a_plus_b(engine):
    a, b = prompts(2, seed=3)
    s_a = engine.submit(a, SamplingParams(max_tokens=0), return_state=True).result(30)
    assert s_a.pending_tokens == [] and s_a.finish_reason == "length" and s_a.state.batch_size == 1
    s_ab = engine.submit(b, SamplingParams(max_tokens=0), init_state=s_a.state, return_state=True).result(30)
    s_ab2 = engine.submit(a + b, SamplingParams(max_tokens=0), return_state=True).result(30)
    for x, y in zip(s_ab.state.tensors(), s_ab2.state.tensors()):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)
    gen1 = engine.submit(b, SamplingParams(max_tokens=8, **GREEDY), init_state=s_a.state).result(30)
    gen2 = engine.submit(a + b, SamplingParams(max_tokens=8, **GREEDY)).result(30)
    assert gen1.token_ids == gen2.token_ids


def test_continue_after_stop_equals_never_stopping(engine):
    p = prompts(1, seed=4)[0]
    first = engine.submit(p, SamplingParams(max_tokens=5, **GREEDY), return_state=True).result(30)
    assert first.pending_tokens == first.token_ids[-1:]
    more = engine.submit(first.pending_tokens, SamplingParams(max_tokens=5, **GREEDY), init_state=first.state)
    more = more.result(30)
    whole = engine.submit(p, SamplingParams(max_tokens=10, **GREEDY)).result(30)
    assert first.token_ids + more.token_ids == whole.token_ids


def test_a_failing_request_fails_only_itself(engine, model, monkeypatch):
    bad_state = model.zero_state(1)
    meta = State(*(torch.empty_like(t, device="meta") for t in bad_state.tensors()))  # cannot be copied
    real = engine.output.new_decoder

    class Broken:
        def push_one(self, token):
            raise RuntimeError("decoder broke")

        def flush(self):
            return ""

    ps = prompts(6, seed=5)
    params = SamplingParams(max_tokens=5, **GREEDY)
    ref = [engine.submit(p, params).result(30).token_ids for p in ps]
    monkeypatch.setattr(engine.output, "new_decoder", Broken)
    broken = engine.submit(ps[0], params)
    monkeypatch.setattr(engine.output, "new_decoder", real)
    handles = [engine.submit(p, params) for p in ps]
    bad = engine.submit(ps[1], params, init_state=meta)
    assert broken.result(30).finish_reason == "error" and "decoder broke" in broken.result().error
    assert bad.result(30).finish_reason == "error" and "starting state" in bad.result().error
    assert [h.result(30).token_ids for h in handles] == ref
    with pytest.raises(ValueError):
        engine.submit(ps[0], params, init_state=model.zero_state(2))
    assert engine.is_alive


async def test_async_iteration_one_wakeup_per_step(engine):
    loop = asyncio.get_running_loop()
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*a, **kw):
        nonlocal calls
        calls += 1
        return real(*a, **kw)

    loop.call_soon_threadsafe = counting
    try:
        steps0 = engine.stats().steps
        handles = [engine.submit(p, SamplingParams(max_tokens=10, **GREEDY)) for p in prompts(8, seed=6)]

        async def consume(h):
            return [ev async for ev in h], await h.wait()

        outs = await asyncio.gather(*(consume(h) for h in handles))
    finally:
        loop.call_soon_threadsafe = real
    for events, res in outs:
        assert "".join(e.text for e in events) == res.text and events[-1].finished and res.completion_tokens == 10
    assert 0 < calls <= engine.stats().steps - steps0 + 2  # not per token (80 tokens were generated)


def test_max_tokens_zero_with_empty_prompt_and_abort_while_waiting(model, tok):
    e = Engine(model, tok, Settings(max_batch=2, stats_interval=0.0))  # not started: requests wait
    init = model.zero_state(1)
    init.wkv.fill_(0.5)
    h1 = e.submit([], SamplingParams(max_tokens=0), init_state=init, return_state=True)
    h2 = e.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id="w", return_state=True)
    assert e.abort("w")
    e.start()
    try:
        r1, r2 = h1.result(10), h2.result(10)
        assert r1.finish_reason == "length" and torch.equal(r1.state.wkv, init.wkv) and r1.state.wkv is not init.wkv
        assert r2.finish_reason == "abort" and r2.pending_tokens == [1, 2, 3] and r2.state.wkv.abs().sum() == 0
    finally:
        e.shutdown()


def test_submit_errors(model, tok):
    e = Engine(model, tok, Settings(max_batch=2, max_queue=2, max_prompt_tokens=5, stats_interval=0.0))
    for i in range(4):  # 2 take the free slots, 2 wait
        e.submit([1], SamplingParams(max_tokens=1), request_id=f"x{i}")
    with pytest.raises(QueueFullError):
        e.submit([1], SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError):
        e.submit(list(range(1, 10)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError):
        e.submit([], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError):
        e.submit([70000], SamplingParams(max_tokens=1))
    e.start()
    e.shutdown()
    with pytest.raises(EngineDeadError):
        e.submit([1], SamplingParams(max_tokens=1))


def test_a_refused_submit_queues_nothing(model, tok):
    """Engine.submit through its Inbox: a request id in use, a full queue (the requests the
    loop holds count, and those it took but has not published yet), an unknown abort and a closed
    inbox are refused, and a refusal leaves nothing queued and nothing live."""
    e = Engine(model, tok, Settings(max_batch=1, max_queue=2, stats_interval=0.0))
    e.submit([1], SamplingParams(max_tokens=1), request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        e.submit([2], SamplingParams(max_tokens=1), request_id="a")
    assert (e.stats().running, e.stats().waiting) == (1, 0)  # the free slot will take it
    e._drain_inbox()  # the loop takes it: it now waits in the scheduler
    e.submit([1], SamplingParams(max_tokens=1), request_id="b")
    assert (e.stats().running, e.stats().waiting) == (1, 1)
    e._inbox.take()  # taken, not published yet: still counted
    e.submit([1], SamplingParams(max_tokens=1), request_id="c")
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        e.submit([1], SamplingParams(max_tokens=1), request_id="d")
    assert not e.abort("d") and e.abort("b") and e._inbox.has_items()
    items = e._inbox.take()
    assert [i if isinstance(i, str) else i[0].request_id for i in items] == ["c", "b"]
    handles = e._inbox.close()
    assert sorted(h.request_id for h in handles) == ["a", "b", "c"]
    with pytest.raises(EngineDeadError):
        e._inbox.put(items[0], handles[0])
    assert e._inbox.take() == [] and e._inbox.load() == (0, 0) and not e._inbox.has_items()


def test_an_idle_engine_runs_no_steps(model, tok):
    """With nothing queued and nothing running the loop sleeps: no steps are counted (an inbox
    that always looked non-empty once made the loop step without work)."""
    e = make_engine(model, tok)
    try:
        e.submit([1, 2], SamplingParams(max_tokens=2, **GREEDY)).result(10)
        time.sleep(0.2)
        steps = e.stats().steps
        time.sleep(0.3)
        assert e.stats().steps == steps
    finally:
        e.shutdown()


def test_dead_loop_is_reported_not_hung(model, tok, monkeypatch):
    e = make_engine(model, tok)
    try:
        assert e.submit([1, 2], SamplingParams(max_tokens=2, **GREEDY)).result(10).completion_tokens == 2

        def broken(plan):
            raise RuntimeError("device lost")

        monkeypatch.setattr(e.runner, "launch", broken)
        handles = [e.submit([1, 2], SamplingParams(max_tokens=50, **GREEDY)) for _ in range(4)]
        outcomes = set()
        for h in handles:
            try:
                outcomes.add(h.result(10).finish_reason)
            except EngineDeadError:
                outcomes.add("dead")
        assert outcomes <= {"error", "dead"}
        follow = None
        for _ in range(5):
            try:
                follow = e.submit([3], SamplingParams(max_tokens=50, **GREEDY))
                follow.result(10)
            except EngineDeadError:
                break
        else:
            pytest.fail("the engine never reported itself dead")
        assert not e.is_alive
    finally:
        e.shutdown()


def test_stats_are_numbers_and_logged(model, tok, caplog):
    e = make_engine(model, tok, stats_interval=0.05)
    try:
        with caplog.at_level("INFO", logger="server.engine"):
            e.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=20, **GREEDY), timeout=30)
            st = e.stats()  # (a step is counted before its events go out: the results' tokens are in)
            assert st.steps >= 20 and st.generation_tokens_total == 80 and st.prompt_tokens_total == 12
            # the rates are the last closed window's: read while the engine works (a window that
            # closed while it was idle, e.g. 0.05 s after the run above, has no steps and rates 0)
            h = e.submit([1, 2, 3], SamplingParams(max_tokens=100_000, **GREEDY))
            deadline = time.monotonic() + 30
            for _ in h:
                busy = e.stats()
                if busy.extra["window_steps"] > 0:
                    break
                assert time.monotonic() < deadline, busy
            h.abort()
            assert h.result(30).finish_reason == "abort"  # (the engine thread logged that window before)
        assert busy.decode_tok_s > 0 and busy.step_ms > 0 and busy.slots == 8 and "overhead_ms" in busy.extra
        assert any("engine: running=" in r.getMessage() for r in caplog.records)
    finally:
        e.shutdown()


@pytest.mark.parametrize("deferred", [False, True])
def test_a_steps_tokens_are_counted_before_its_events_are_delivered(model, tok, deferred):
    """What stats() (read by /metrics and /health) says when a client gets its answer: a one-token
    answer (prefilled, sampled and ended in one step) is counted, prompt and output, before its
    event is delivered. The handle's listener runs on the engine thread right after each
    delivery, so it sees the figures as they were then. On the CPU a step delivers its own events
    at its end; with `defer_delivery` (CUDA) the next step does."""
    e = make_engine(model, tok, start=False)
    e.defer_delivery = deferred
    seen: list[tuple[int, int, int]] = []

    def listener() -> None:
        st = e.stats()
        seen.append((st.prompt_tokens_total, st.generation_tokens_total, len(h.take_ready() or ())))

    h = e.submit([1, 2, 3], SamplingParams(max_tokens=1, **GREEDY))
    h.set_listener(listener)
    e.start()
    try:
        assert h.result(10).completion_tokens == 1
        assert seen and seen[0][:2] == (3, 1) and seen[0][2] >= 1, seen  # the token's event, counted
    finally:
        e.shutdown()


def test_deferred_delivery_and_graph_style_overflow_rows(model, tok, monkeypatch):
    """The CUDA configuration on the CPU: events delivered after the next launch, and the sampler
    returning -1 for rows outside its candidates (as inside a CUDA graph), finished by the runner."""
    from server.engine import sampler as sampler_mod

    ps = prompts(10, seed=7)
    params = [SamplingParams(max_tokens=5, seed=i, top_p=[1.0, 0.3][i % 2], ignore_eos=True) for i in range(10)]
    # All requests are queued before the loop starts, so both runs batch them identically (a
    # top_p=1 row on flat logits can flip a near-tie when CPU matmuls see another batch shape).
    e = make_engine(model, tok, start=False)
    try:
        hs = [e.submit(p, q) for p, q in zip(ps, params)]
        e.start()
        want = [h.result(60) for h in hs]
    finally:
        e.shutdown()
    plain = sampler_mod.SamplerSlots.sample
    calls = {"resolve": 0}
    real_resolve = sampler_mod.SamplerSlots.resolve

    def resolve(self, *a):
        calls["resolve"] += 1
        return real_resolve(self, *a)

    monkeypatch.setattr(sampler_mod.SamplerSlots, "sample", lambda self, *a, **k: plain(self, *a, resolve=False))
    monkeypatch.setattr(sampler_mod.SamplerSlots, "resolve", resolve)
    e = make_engine(model, tok, start=False)
    e.defer_delivery = True
    try:
        handles = [e.submit(p, q) for p, q in zip(ps, params)]
        e.start()
        got = [h.result(60) for h in handles]
        events = list(handles[0])
    finally:
        e.shutdown()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert calls["resolve"] > 0 and sum((ev.token_ids for ev in events), []) == got[0].token_ids


def test_ids_first_fast_path_equals_the_plain_path(model, tok):
    """The engine's critical path handles ids only (stop token ids, max_tokens, continuation
    plans fed from the previous step's ids); text, stop strings' events and results come after the
    next launch (defer_delivery, the CUDA setting). Same tokens, text, events, states, pending."""
    ps = prompts(12, seed=3)
    base = [SamplingParams(max_tokens=4 + 5 * (i % 4), **GREEDY) for i in range(12)]
    e = make_engine(model, tok)
    try:
        ref = [h.result(60) for h in [e.submit(p, q) for p, q in zip(ps, base)]]
    finally:
        e.shutdown()
    params = []
    for i, (q, r) in enumerate(zip(base, ref)):
        kw = dict(q.__dict__)
        if i % 3 == 1 and len(r.token_ids) > 2:  # a stop token id met mid-way (and by other rows)
            kw["stop_token_ids"] = (r.token_ids[2],)
        if i % 3 == 2 and len(r.text) > 4:  # a stop string (checked on text before the launch)
            kw["stop"] = (r.text[2:4],)
        params.append(SamplingParams(**kw))

    def run(defer):
        e = make_engine(model, tok)
        e.defer_delivery = defer
        try:
            hs = [e.submit(p, q, return_state=True) for p, q in zip(ps, params)]
            res = [h.result(60) for h in hs]
            evs = [list(h) for h in hs]
            aborted = e.submit(ps[0], SamplingParams(max_tokens=10_000, **GREEDY), return_state=True)
            next(iter(aborted))
            time.sleep(0.05)
            aborted.abort()
            ra = aborted.result(30)
        finally:
            e.shutdown()
        return res, evs, ra

    (r0, ev0, a0), (r1, ev1, a1) = run(False), run(True)
    for x, y, ex, ey, p in zip(r0, r1, ev0, ev1, ps):
        assert (x.token_ids, x.text, x.finish_reason, x.pending_tokens) == (
            y.token_ids, y.text, y.finish_reason, y.pending_tokens)  # fmt: skip
        # (bitwise equality is not expected: CPU matmuls round differently with the batch's shape)
        assert all(torch.allclose(s, t, atol=1e-5) for s, t in zip(x.state.tensors(), y.state.tensors()))
        for r, evs in ((x, ex), (y, ey)):
            assert "".join(ev.text for ev in evs) == r.text and sum((ev.token_ids for ev in evs), []) == r.token_ids
            assert evs[-1].finished and all(not ev.finished for ev in evs[:-1])
    assert {r.finish_reason for r in r1} == {"stop", "length"}
    for ra in (a0, a1):  # aborted mid-stream: state + pending == prompt + output
        assert ra.finish_reason == "abort" and ra.pending_tokens == ra.token_ids[-1:]
        cont = make_engine(model, tok)
        try:
            alone = cont.submit(ps[0] + ra.token_ids[:-1], SamplingParams(max_tokens=0), return_state=True).result(30)
        finally:
            cont.shutdown()
        assert all(torch.allclose(s, t, atol=1e-5) for s, t in zip(alone.state.tensors(), ra.state.tensors()))


def test_result_timeout_counts_time_not_wake_ups(engine):
    """result(timeout) waits `timeout` seconds of real time: each event delivered wakes the
    waiter, and a wake-up must not count as a whole poll interval (30 events once made
    result(20) time out after a fraction of a second)."""
    h = engine.submit("Hello there", SamplingParams(max_tokens=60, **GREEDY))
    t0 = time.monotonic()
    res = h.result(20)
    assert res.completion_tokens == 60 and time.monotonic() - t0 < 20
