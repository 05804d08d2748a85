"""Scheduler unit tests: no model, no torch. A fake runner keeps a token list per physical slot
(its "state") and samples a token that is a pure function of that list, so every move, copy-out
and chunk boundary is checked against what a real recurrent model would see."""

from __future__ import annotations

import random
import sys

import pytest

from server.engine.scheduler import CopyOutOp, MoveOp, Scheduler, bucket_for
from server.engine.sequence import Sequence, StopMatcher
from server.engine.types import ABORT, ERROR, LENGTH, STOP, QueueFullError, SamplingParams

VOCAB = {1: "He", 2: "llo", 3: "\n", 4: "\nUs", 5: "er", 6: ":", 7: " wo", 8: "rld", 9: "!"}


class FakeDecoder:
    def __init__(self, vocab=None):
        self.vocab = vocab or {}

    def push(self, ids):
        return "".join(self.vocab.get(i, chr(0x4E00 + i % 200)) for i in ids)

    def flush(self):
        return ""


def make_seq(rid, prompt, max_tokens=5, vocab=None, **kw):
    ret = kw.pop("return_state", False)
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Sequence(rid, list(prompt), params, FakeDecoder(vocab), return_state=ret)


class FakeRunner:
    """Physical slots hold the list of tokens fed so far; 'sampling' hashes that list."""

    def __init__(self, max_batch, sampler=None):
        self.slots: list[list[int] | None] = [None] * max_batch
        self.owner: list[str | None] = [None] * max_batch
        self.states: dict[str, list[int]] = {}
        self.sampler = sampler or (lambda fed: 10 + hash(tuple(fed)) % 1000)

        self.last: list[int] = []  # the previous step's samples (a continuation plan feeds them)
        self.fed: list[int] = []  # what the last step fed (checked against the rows afterwards)

    def run(self, plan):
        for op in plan.ops:
            if isinstance(op, CopyOutOp):
                assert self.owner[op.slot] == op.seq.request_id
                self.states[op.seq.request_id] = list(self.slots[op.slot])
            else:
                moved = [(d, list(self.slots[s]), self.owner[s]) for d, s in op.pairs]
                for d, fed, who in moved:
                    self.slots[d], self.owner[d] = fed, who
        for slot, seq in plan.admits:
            self.slots[slot], self.owner[slot] = [], seq.request_id
        for slot, toks in plan.prefill:
            self.slots[slot].extend(toks)
        out = []
        if plan.cont:  # like the device: the previous step's samples, no host round trip
            assert not plan.decode_tokens and len(self.last) == plan.n_active
        feed = self.last if plan.cont else plan.decode_tokens
        for i, seq in enumerate(plan.rows):
            assert self.owner[i] == seq.request_id, "rows must be the active prefix"
            self.slots[i].append(feed[i])
            out.append(self.sampler(self.slots[i]))
        self.fed, self.last = list(feed), list(out)
        return out


MODE = "plain"


@pytest.fixture(autouse=True, params=["plain", "engine"])
def _mode(request):
    """Every test twice: plan()/apply() as is, and the engine's way (continuation plans, ids-only
    apply with the text emitted after the next step ran)."""
    global MODE
    MODE = request.param
    yield
    MODE = "plain"


def run_all(sched, runner, max_steps=10_000, check=None):
    if MODE == "engine":
        return run_all_engine(sched, runner, max_steps, check)
    events, steps = {}, 0
    while sched.has_work():
        plan = sched.plan()
        for seq, ev in plan.early:
            events.setdefault(seq.request_id, []).append(ev)
        if check:
            check(plan)
        out = sched.apply(plan, runner.run(plan))
        for seq, ev in out.events:
            events.setdefault(seq.request_id, []).append(ev)
        steps += 1
        assert steps < max_steps
    return events


def run_all_engine(sched, runner, max_steps=10_000, check=None):
    """The engine's order: plan (continuations allowed), run, THEN the previous step's deferred
    text (materialize + emit), then the ids-only apply of this step."""
    events, steps, pending = {}, 0, []
    sched.n_cont = 0

    def flush():
        sched.materialize()
        for seq, token in pending:
            events.setdefault(seq.request_id, []).append(seq.emit(token))
        pending.clear()

    while sched.has_work():
        plan = sched.plan(allow_cont=True)
        for seq, ev in plan.early:
            events.setdefault(seq.request_id, []).append(ev)
        if check:
            check(plan)
        tokens = runner.run(plan)
        flush()
        if plan.cont:  # what it fed == what the plan would have fed from the rows
            sched.n_cont += 1
            assert runner.fed == [q.output_ids[-1] for q in plan.rows]
        out = sched.apply(plan, tokens, defer_text=True)
        for seq, ev in out.events:
            events.setdefault(seq.request_id, []).append(ev)
        pending = list(out.deferred)
        steps += 1
        assert steps < max_steps
    flush()
    return events


def test_bucket_for():
    assert [bucket_for(n, 64) for n in (0, 1, 2, 3, 4, 5, 33, 64)] == [0, 1, 2, 4, 4, 8, 64, 64]
    assert bucket_for(5, 6) == 6 and bucket_for(3, 6) == 4


def test_admission_is_fifo_and_slots_are_reused_next_step():
    s = Scheduler(max_batch=2, step_token_budget=64, prefill_chunk=16)
    a, b, c = make_seq("a", [1], max_tokens=1), make_seq("b", [1], max_tokens=3), make_seq("c", [1], max_tokens=1)
    for q in (a, b, c):
        s.add(q)
    plan = s.plan()
    assert [q.request_id for q in plan.rows] == ["a", "b"] and s.num_waiting == 1
    out = s.apply(plan, [20, 21])
    assert [q.request_id for q in out.finished] == ["a"]
    plan = s.plan()  # the freed slot is taken at once: b moved to slot 0, c admitted to slot 1
    assert plan.ops == [MoveOp([(0, 1)])] and plan.admits == [(1, c)]
    assert [q.request_id for q in plan.rows] == ["b", "c"] and b.slot == 0


def test_budget_chunking_and_contiguous_prefix_under_load():
    rng = random.Random(0)
    budget, chunk, mb = 40, 16, 8
    s = Scheduler(max_batch=mb, step_token_budget=budget, prefill_chunk=chunk)
    seqs = [make_seq(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 90))],
                     max_tokens=rng.randrange(0, 12)) for i in range(40)]  # fmt: skip
    for q in seqs:
        s.add(q)

    def check(plan):
        assert plan.n_tokens <= budget
        assert len(plan.rows) <= mb and all(q.slot == i for i, q in enumerate(plan.rows))
        assert plan.bucket == bucket_for(len(plan.rows), mb)
        assert all(1 <= len(t) < chunk for _, t in plan.prefill)
        assert all(0 <= t <= chunk for t in plan.takes)

    events = run_all(s, FakeRunner(mb), check=check)
    for q in seqs:
        assert q.finish_reason == LENGTH and len(q.output_ids) == q.params.max_tokens
        evs = events[q.request_id]
        assert evs[-1].finished and sum(len(e.token_ids) for e in evs) == len(q.output_ids)


def test_burst_of_short_prompts_prefills_in_one_step():
    s = Scheduler(max_batch=16, step_token_budget=64, prefill_chunk=16)
    for i in range(10):
        s.add(make_seq(f"r{i}", [1, 2, 3, 4, 5]))
    plan = s.plan()
    assert len(plan.rows) == 10 and plan.n_tokens == 50 and all(plan.commit) and plan.bucket == 16


def test_decode_rows_come_before_a_long_prefill():
    s = Scheduler(max_batch=4, step_token_budget=8, prefill_chunk=512)
    s.add(make_seq("short", [1], max_tokens=50))
    s.apply(s.plan(), [10])
    s.add(make_seq("long", list(range(1, 100)), max_tokens=1))
    plan = s.plan()
    assert plan.takes == [0, 7] and plan.commit == [True, False] and plan.n_tokens == 8


def test_free_in_the_middle_moves_the_last_slots_in():
    s = Scheduler(max_batch=8, step_token_budget=64, prefill_chunk=16)
    lens = {"a": 1, "b": 5, "c": 1, "d": 5, "e": 5}
    for rid, n in lens.items():
        s.add(make_seq(rid, [1], max_tokens=n, return_state=rid == "c"))
    s.apply(s.plan(), [11, 12, 13, 14, 15])  # a and c finish
    assert [q.request_id for q in s.slots] == ["e", "b", "d"]
    plan = s.plan()
    assert isinstance(plan.ops[0], CopyOutOp) and plan.ops[0].slot == 2
    assert plan.ops[1] == MoveOp([(0, 4), (2, 3)])
    assert [q.slot for q in plan.rows] == [0, 1, 2] and plan.bucket == 4


def test_state_plus_pending_is_prompt_plus_output():
    rng = random.Random(1)
    s = Scheduler(max_batch=4, step_token_budget=12, prefill_chunk=5)
    seqs = [make_seq(f"r{i}", [rng.randrange(1, 9) for _ in range(rng.randrange(1, 30))],
                     max_tokens=rng.randrange(0, 6), return_state=True, stop_token_ids=(17,))
            for i in range(20)]  # fmt: skip
    for q in seqs:
        s.add(q)
    runner = FakeRunner(4, sampler=lambda fed: 10 + sum(fed) % 9)
    run_all(s, runner)
    for q in seqs:
        assert runner.states[q.request_id] + q.pending_tokens() == q.prompt + q.output_ids
        assert q.pending_tokens() == ([] if q.finish_reason == STOP or q.params.max_tokens == 0 else q.output_ids[-1:])


def test_outputs_do_not_depend_on_batching():
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 40))] for _ in range(12)]

    def outputs(mb, budget, chunk, together):
        res = {}
        s = Scheduler(max_batch=mb, step_token_budget=budget, prefill_chunk=chunk)
        batches = [list(range(12))] if together else [[i] for i in range(12)]
        for batch in batches:
            seqs = [make_seq(f"r{i}", prompts[i], max_tokens=4 + i % 5) for i in batch]
            for q in seqs:
                s.add(q)
            run_all(s, FakeRunner(mb))
            res.update({q.request_id: q.output_ids for q in seqs})
        return res

    assert outputs(4, 9, 3, True) == outputs(1, 64, 64, False) == outputs(16, 1000, 7, True)


def test_stop_string_split_across_tokens_never_leaks():
    s = Scheduler(max_batch=2, step_token_budget=16, prefill_chunk=16)
    q = make_seq("q", [1], max_tokens=20, vocab=VOCAB, stop=("\nUser:",))
    s.add(q)
    script = iter([1, 2, 3, 4, 5, 6, 9])  # "He" "llo" "\n" "\nUs" "er" ":" -> stop
    events = run_all(s, FakeRunner(2, sampler=lambda fed: next(script)))["q"]
    texts = [e.text for e in events]
    assert "".join(texts) == q.text == "Hello\n"
    assert texts[:3] == ["He", "llo", ""]  # "\n" held back: it may start "\nUser:"
    assert q.finish_reason == STOP and q.output_ids == [1, 2, 3, 4, 5, 6]
    assert events[-1].finished and events[-1].token_ids == [6]


def test_held_back_text_is_released_when_no_stop_follows():
    s = Scheduler(max_batch=1, step_token_budget=16, prefill_chunk=16)
    q = make_seq("q", [1], max_tokens=3, vocab=VOCAB, stop=("\nUser:",))
    s.add(q)
    script = iter([1, 3, 4])
    events = run_all(s, FakeRunner(1, sampler=lambda fed: next(script)))["q"]
    assert [e.text for e in events] == ["He", "", "\n\nUs"] and q.finish_reason == LENGTH


@pytest.mark.parametrize("stops,chunks,expect", [
    (("abc",), ["xa", "b", "cd"], ("x", True)),
    (("abc", "bd"), ["a", "b", "d"], ("a", True)),
    (("aab",), ["a", "a", "a", "b"], ("a", True)),
    (("END",), ["E", "N", "X"], ("ENX", False)),
    (("😀!",), ["a😀", "😀", "!"], ("a😀", True)),
])  # fmt: skip
def test_stop_matcher(stops, chunks, expect):
    m, out, hit = StopMatcher(stops), "", False
    for c in chunks:
        t, hit = m.feed(c)
        out += t
        if hit:
            break
    out += "" if hit else m.flush()
    assert (out, hit) == expect


def test_eos_and_stop_token_ids_and_ignore_eos():
    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=5), make_seq("b", [1], max_tokens=5, stop_token_ids=(42,))
    c = make_seq("c", [1], max_tokens=2, ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    out = s.apply(s.plan(), [0, 42, 0])
    assert (a.finish_reason, a.output_ids) == (STOP, []) and (b.finish_reason, b.output_ids) == (STOP, [])
    assert c.output_ids == [0] and not c.finished and len(out.finished) == 2


def test_prefill_only_and_empty_prefill_only():
    s = Scheduler(max_batch=2, step_token_budget=4, prefill_chunk=4)
    a, b = make_seq("a", list(range(1, 10)), max_tokens=0), make_seq("b", [], max_tokens=0)
    s.add(a)
    s.add(b)
    plans = []
    while s.has_work():
        plans.append(s.plan())
        s.apply(plans[-1], [7] * plans[-1].n_active)
    assert not any(any(p.commit) for p in plans)
    assert a.finish_reason == LENGTH and a.output_ids == [] and a.pending_tokens() == [] and a.n_fed == 9
    assert b.finish_reason == LENGTH and [q for p in plans for q, _ in p.early] == [b]


def test_abort_waiting_and_running_frees_the_slot():
    s = Scheduler(max_batch=1, step_token_budget=16, prefill_chunk=16)
    a, b, c = make_seq("a", [1], max_tokens=50), make_seq("b", [1]), make_seq("c", [1])
    for q in (a, b, c):
        s.add(q)
    s.apply(s.plan(), [5])
    seq, ev = s.abort("c")
    assert seq is c and ev.finish_reason == ABORT and s.num_waiting == 1
    seq, ev = s.abort("a")
    assert ev.finished and ev.finish_reason == ABORT and s.num_running == 0 and a.output_ids == [5]
    assert s.abort("zzz") is None
    plan = s.plan()
    assert [q.request_id for q in plan.rows] == ["b"]


def test_fail_only_fails_that_sequence():
    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=3), make_seq("b", [1], max_tokens=3)
    s.add(a)
    s.add(b)
    plan = s.plan()
    assert s.fail(a, "boom").finish_reason == ERROR and a.error == "boom"
    s.apply(plan, [5, 6])  # a's row is skipped
    assert a.output_ids == [] and b.output_ids == [6] and b.slot == 0


def test_error_while_processing_a_token_fails_only_that_sequence():
    class Broken(FakeDecoder):
        def push(self, ids):
            raise RuntimeError("decoder broke")

    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    a = Sequence("a", [1], SamplingParams(max_tokens=3), Broken())
    b = make_seq("b", [1], max_tokens=3)
    s.add(a)
    s.add(b)
    run_all(s, FakeRunner(4))
    assert a.finish_reason == ERROR and "decoder broke" in a.error
    assert b.finish_reason == LENGTH and len(b.output_ids) == 3


def test_queue_full():
    s = Scheduler(max_batch=1, step_token_budget=16, prefill_chunk=16, max_queue=2)
    s.add(make_seq("a", [1]))
    s.add(make_seq("b", [1]))
    with pytest.raises(QueueFullError):
        s.add(make_seq("c", [1]))


def test_scheduler_imports_no_torch():
    import subprocess

    code = "import sys, server.engine.scheduler, server.engine; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_continuation_plans_and_lazy_ids_only_apply():
    """The engine's fast path: continuation plans while nothing changes, exact max_tokens and stop
    ids (another row's stop id does not end a row), the same tokens/text/events as plain."""
    def go(mode):
        global MODE
        MODE = mode
        s = Scheduler(max_batch=8, step_token_budget=64, prefill_chunk=4)
        seqs = [make_seq(f"r{i}", list(range(1, 2 + i)), max_tokens=3 + 7 * i, return_state=True,
                         stop_token_ids=(10 + i, 30 + i), vocab=VOCAB, stop=("\u4e3c", "\u4e5a")[i % 3:][:1])
                for i in range(6)]  # fmt: skip  (rows 0 and 3 have a stop string, row 1 another)
        for q in seqs:
            s.add(q)
        runner = FakeRunner(8, sampler=lambda fed: 10 + hash(tuple(fed)) % 97)
        events = run_all(s, runner)
        return s, runner, seqs, events

    s0, r0, plain, ev0 = go("plain")
    s1, r1, fast, ev1 = go("engine")
    assert s1.n_cont > 10
    for a, b in zip(plain, fast):
        assert (a.output_ids, a.text, a.finish_reason, a.pending_tokens()) == (
            b.output_ids, b.text, b.finish_reason, b.pending_tokens())  # fmt: skip
        assert ev0[a.request_id] == ev1[b.request_id]
        assert r1.states[b.request_id] + b.pending_tokens() == b.prompt + b.output_ids
        assert b.finish_reason == STOP or len(b.output_ids) == b.params.max_tokens
    assert {q.finish_reason for q in fast} == {STOP, LENGTH}


def test_continuation_stops_when_a_request_can_be_admitted_or_a_row_ends():
    s = Scheduler(max_batch=2, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=50, ignore_eos=True), make_seq("b", [1], max_tokens=50, ignore_eos=True)
    s.add(a)
    p = s.plan(allow_cont=True)
    assert not p.cont  # an admission
    s.apply(p, [5], defer_text=True)
    p = s.plan(allow_cont=True)
    assert not p.cont and p.decode_tokens == [5]  # the first all-decode plan
    s.apply(p, [6], defer_text=True)
    assert a.output_ids == [5]  # recorded lazily (nothing can end: no stop ids, far from max_tokens)
    p = s.plan(allow_cont=True)
    assert p.cont and p.decode_tokens == [] and p.positions == []
    s.apply(p, [7], defer_text=True)
    s.add(b)  # a free slot and a waiting request: a full plan (which brings a up to date)
    p = s.plan(allow_cont=True)
    assert not p.cont and a.output_ids == [5, 6, 7] and p.decode_tokens == [7, 1] and p.positions == [3, 0]
    s.apply(p, [8, 9], defer_text=True)
    p = s.plan(allow_cont=True)
    assert not p.cont and p.decode_tokens == [8, 9] and p.positions == [4, 1]
    s.apply(p, [10, 11], defer_text=True)
    p = s.plan(allow_cont=True)
    assert p.cont
    p.fill_inputs()  # the host fallback of a continuation plan
    assert p.decode_tokens == [10, 11] and p.positions == [5, 2]
    s.apply(p, [12, 12], defer_text=True)
    s.abort("b")  # ends b (after bringing it up to date): the next plan is a full one
    assert b.output_ids == [9, 11, 12] and b.pending_tokens() == [12]
    p = s.plan(allow_cont=True)
    assert not p.cont and p.decode_tokens == [12] and p.positions == [6]


@pytest.mark.parametrize("stops", [(), ("lo\n",)])
def test_record_then_emit_equals_add_token(stops):
    script = [1, 2, 3, 7, 42, 8, 9, 0, 5]
    for max_tokens in range(1, 10):
        for stop_ids in [(), (42,), (9,)]:
            kw = dict(max_tokens=max_tokens, vocab=VOCAB, stop_token_ids=stop_ids, stop=stops)
            a, b = make_seq("a", [1], **kw), make_seq("b", [1], **kw)
            ea, eb = [], []
            for t in script:
                if a.finished:
                    break
                ea.append(a.add_token(t))
                if b._has_stops:  # stop strings: the engine keeps add_token (text decides)
                    eb.append(b.add_token(t))
                else:
                    b.record(t)
                    eb.append(b.emit(t))
            assert ea == eb and a.text == b.text and a.output_ids == b.output_ids
            assert (a.finish_reason, a.status) == (b.finish_reason, b.status)
