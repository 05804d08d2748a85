"""Scheduler and engine-step tests: no model, no torch.

The scheduler alone is checked on its plain data (plans, outputs, Finished records). The whole
step is checked through the real `Engine.step` with a fake runner that keeps a token list per
physical slot (its "state") and samples a token that is a pure function of that list, so every
move, copy-out and chunk boundary is checked against what a real recurrent model would see.
Engine-level tests run twice: as on the CPU (full plans, text at once) and as on CUDA
(continuation plans, text and deliveries after the next launch)."""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.config import Settings
from server.engine import Engine
from server.engine.plan import (
    SAMPLED,
    Admission,
    CopyOutOp,
    MoveOp,
    StepPlan,
    bucket_for,
    bucket_sizes,
)
from server.engine.scheduler import Scheduler
from server.engine.sequence import EngineSeq
from server.engine.text import StopMatcher, StopRequestText, open_text
from server.engine.types import (
    ABORT,
    ERROR,
    LENGTH,
    NONFINITE_MESSAGE,
    NONFINITE_TOKEN,
    STOP,
    QueueFullError,
    SamplingParams,
    TokenLogprob,
)

VOCAB = {1: "He", 2: "llo", 3: "\n", 4: "\nUs", 5: "er", 6: ":", 7: " wo", 8: "rld", 9: "!"}


def _piece(i: int) -> str:
    return VOCAB.get(i, chr(0x4E00 + i % 200)) if i else ""


class FakeTokenizer:
    """What the engine's detokenizer reads: one byte string per id."""

    vocab_size = 4096
    token_table = tuple(_piece(i).encode() for i in range(vocab_size))

    def decode_bytes(self, ids):
        return b"".join(self.token_table[i] for i in ids)


class FakeRunner:
    """Physical slots hold the list of tokens fed so far; 'sampling' hashes that list."""

    def __init__(self, max_batch, sampler=None):
        self.slots: list[list[int] | None] = [None] * max_batch
        self.owner: list[str | None] = [None] * max_batch
        self.sampler = sampler or (lambda fed: 10 + hash(tuple(fed)) % 1000)
        self.model_time = self.sample_time = 0.0
        self.plans: list[StepPlan] = []
        self.copies: list[tuple[str, list[int]]] = []
        self.last: list[int] = []  # the previous step's samples (a continuation plan feeds them)
        self.on_plan = None  # a test's check of each plan

    def prepare(self, plan):
        self.plans.append(plan)
        if self.on_plan:
            self.on_plan(plan)
        for op in plan.ops:
            if isinstance(op, CopyOutOp):
                assert self.owner[op.slot] == op.request_id
                self.copies.append((op.request_id, list(self.slots[op.slot])))
            else:
                moved = [(d, list(self.slots[s]), self.owner[s]) for d, s in op.pairs]
                for d, fed, who in moved:
                    self.slots[d], self.owner[d] = fed, who
        for a in plan.admits:
            self.slots[a.slot], self.owner[a.slot] = list(a.init_state or []), a.request_id
        return []

    def prefill(self, plan):
        for slot, toks in plan.prefill:
            self.slots[slot].extend(toks)

    def launch(self, plan):
        if not plan.request_ids:
            return None
        if plan.cont:  # like the device: the previous step's samples, no host round trip
            assert not plan.decode_tokens and len(self.last) == plan.n_active
        feed = self.last if plan.cont else plan.decode_tokens
        out = []
        for i, rid in enumerate(plan.request_ids):
            assert self.owner[i] == rid, "rows must be the active prefix"
            self.slots[i].append(feed[i])
            out.append(self.sampler(self.slots[i]))
        self.last = out
        return out

    def finish(self, job):
        return job

    def logprobs(self, job):
        """A value per plan.logprobs entry that names its token: -(row + 1) / 10 and k fake
        alternatives."""
        plan = self.plans[-1]
        return [TokenLogprob(t if t != SAMPLED else job[row], -(row + 1) / 10, ((0, -1.0),) * k)
                for row, k, t in plan.logprobs]  # fmt: skip

    def poll_copies(self, wait=False):
        out, self.copies = self.copies, []
        return out

    @property
    def copies_pending(self):
        return bool(self.copies)

    def close(self):
        pass

    def bind_thread(self):
        pass

    def detached_state(self, init_state):
        return list(init_state or [])

    def check_state(self, state):
        pass


@pytest.fixture(params=["cpu", "cuda"])
def mode(request):
    return request.param


def make_engine(mode, max_batch=8, budget=64, chunk=16, sampler=None):
    model = SimpleNamespace(device="cpu", shape=SimpleNamespace(vocab_size=FakeTokenizer.vocab_size))
    settings = Settings(max_batch=max_batch, step_token_budget=budget, prefill_chunk=chunk, stats_interval=0.0)
    e = Engine(model, FakeTokenizer(), settings, runner=FakeRunner(max_batch, sampler))
    e.scheduler.continuation = e.defer_delivery = mode == "cuda"
    return e


def run_all(engine, max_steps=10_000):
    """Turn the engine's loop by hand until nothing is left; every step's rows must be the
    output processor's rows (it follows the plan's slot moves)."""
    steps = 0
    while engine.run_once():
        steps += 1
        assert steps < max_steps
        last = engine.runner.plans[-1] if engine.runner.plans else None
        if last is not None and not last.cont:
            assert [st.request_id for st in engine.output._rows] == last.request_ids
    return steps


def submit(engine, rid, prompt, max_tokens=5, **kw):
    ret = kw.pop("return_state", False)
    init = kw.pop("init_state", None)
    early = kw.pop("end_before_state", False)
    return engine.submit(list(prompt), SamplingParams(max_tokens=max_tokens, **kw), request_id=rid,
                         return_state=ret, init_state=init, end_before_state=early)  # fmt: skip


def make_seq(rid, prompt, max_tokens=5, **kw):
    ret = kw.pop("return_state", False)
    return EngineSeq(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), return_state=ret)


def ended(sched):
    return {f.request_id: f for f in sched.take_finished()}


# --- the scheduler's plain data -------------------------------------------------------------
def test_bucket_for():
    assert [bucket_for(n, 64) for n in (0, 1, 2, 3, 4, 5, 33, 64)] == [0, 1, 2, 4, 4, 8, 64, 64]
    assert bucket_for(5, 6) == 6 and bucket_for(3, 6) == 4
    assert bucket_sizes(6) == [1, 2, 4, 6] and bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(1) == [1]


def test_admission_is_fifo_and_slots_are_reused_next_step():
    s = Scheduler(max_batch=2, step_token_budget=64, prefill_chunk=16)
    a, b, c = make_seq("a", [1], max_tokens=1), make_seq("b", [1], max_tokens=3), make_seq("c", [1], max_tokens=1)
    for q in (a, b, c):
        s.add(q)
    plan = s.plan()
    assert plan.request_ids == ["a", "b"] and s.num_waiting == 1
    s.apply(plan, [20, 21])
    assert list(ended(s)) == ["a"]
    plan = s.plan()  # the freed slot is taken at once: b moved to slot 0, c admitted to slot 1
    assert plan.ops == [MoveOp([(0, 1)])] and plan.admits == [Admission(1, "c", c.params, c.seed)]
    assert plan.request_ids == ["b", "c"] and b.slot == 0


def test_plans_are_plain_data():
    """Plans carry ids, numbers, token lists and parameters: never a live sequence."""
    s = Scheduler(max_batch=4, step_token_budget=8, prefill_chunk=4)
    for i in range(6):
        s.add(make_seq(f"r{i}", [1, 2, 3, 4, 5, 6][: i + 1], max_tokens=2, return_state=i % 2 == 0))
    plain = (str, int, float, bool, type(None), SamplingParams)

    def check(v):
        if isinstance(v, (list, tuple)):
            return all(check(x) for x in v)
        if is_dataclass(v) and not isinstance(v, SamplingParams):
            return all(check(getattr(v, f.name)) for f in fields(v))
        return isinstance(v, plain)

    for _ in range(12):
        plan = s.plan()
        assert check(plan), plan
        if plan.request_ids:
            s.apply(plan, [7] * plan.n_active)
        assert all(check(f) for f in s.take_finished())


def test_burst_of_short_prompts_prefills_in_one_step():
    s = Scheduler(max_batch=16, step_token_budget=64, prefill_chunk=16)
    for i in range(10):
        s.add(make_seq(f"r{i}", [1, 2, 3, 4, 5]))
    plan = s.plan()
    assert plan.n_active == 10 and plan.n_tokens == 50 and all(plan.commit) and plan.bucket == 16


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
    assert plan.ops == [CopyOutOp(2, "c"), MoveOp([(0, 4), (2, 3)])]
    assert plan.request_ids == ["e", "b", "d"] and plan.bucket == 4


def test_eos_and_stop_token_ids_and_ignore_eos():
    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=5), make_seq("b", [1], max_tokens=5, stop_token_ids=(42,))
    c = make_seq("c", [1], max_tokens=2, ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    out = s.apply(s.plan(), [0, 42, 0])
    fin = ended(s)
    assert (fin["a"].reason, fin["a"].token, fin["a"].token_ids, fin["a"].pending_tokens) == (STOP, None, [], [])
    assert (fin["b"].reason, fin["b"].token_ids) == (STOP, []) and "c" not in fin
    assert c.output_ids == [0] and out.emitted == [2] and out.decode_tokens == 3


@pytest.mark.parametrize("at_step", [0, 2])  # the first step's row path, a later step's O(1) path
def test_a_nonfinite_row_fails_alone(at_step):
    """The sampler's NONFINITE_TOKEN (the model overflowed on that row) ends that request with
    an error and its message; the other rows go on, and its slot is freed."""
    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    for rid in "abc":
        s.add(make_seq(rid, [1], max_tokens=6))
    for step in range(at_step + 1):
        plan = s.plan()
        toks = [5, 6, 7] if step < at_step else [5, NONFINITE_TOKEN, 7]
        out = s.apply(plan, toks)
    fin = ended(s)
    assert list(fin) == ["b"] and fin["b"].reason == ERROR and fin["b"].error == NONFINITE_MESSAGE
    assert fin["b"].token_ids == [6] * at_step and NONFINITE_TOKEN not in fin["b"].token_ids
    assert out.emitted == [0, 2] and s.plan().request_ids == ["a", "c"]


def test_max_tokens_ends_with_the_token_and_its_pending():
    s = Scheduler(max_batch=2, step_token_budget=16, prefill_chunk=16)
    s.add(make_seq("a", [1, 2], max_tokens=2, return_state=True))
    s.apply(s.plan(), [5])
    s.apply(s.plan(), [6])
    f = ended(s)["a"]
    assert (f.reason, f.token, f.token_ids, f.pending_tokens, f.state) == (LENGTH, 6, [5, 6], [6], "slot")
    assert s.plan().ops == [CopyOutOp(0, "a")]


def test_prefill_only_and_empty_prefill_only():
    s = Scheduler(max_batch=2, step_token_budget=4, prefill_chunk=4)
    a, b = make_seq("a", list(range(1, 10)), max_tokens=0), make_seq("b", [], max_tokens=0, return_state=True)
    b.init_state = "B's start"
    s.add(a)
    s.add(b)
    plans, fin = [], {}
    while s.has_work():
        plans.append(s.plan())
        fin.update(ended(s))
        if plans[-1].request_ids:
            s.apply(plans[-1], [7] * plans[-1].n_active)
        fin.update(ended(s))
    assert "b" in fin and len(plans) >= 3 and "b" not in plans[0].request_ids  # ended when planned
    assert (fin["b"].reason, fin["b"].state, fin["b"].init_state) == (LENGTH, "start", "B's start")
    assert not any(any(p.commit) for p in plans)
    assert fin["a"].reason == LENGTH and fin["a"].token_ids == [] and fin["a"].pending_tokens == [] and a.n_fed == 9


def test_abort_waiting_and_running_frees_the_slot():
    s = Scheduler(max_batch=1, step_token_budget=16, prefill_chunk=16)
    a, b, c = make_seq("a", [1], max_tokens=50), make_seq("b", [1]), make_seq("c", [1, 2])
    for q in (a, b, c):
        s.add(q)
    s.apply(s.plan(), [5])
    assert s.abort("c") and s.num_waiting == 1
    assert (ended(s)["c"].reason, c.pending_tokens()) == (ABORT, [1, 2])
    assert s.abort("a") and s.num_running == 0
    f = ended(s)["a"]
    assert (f.reason, f.token, f.token_ids, f.pending_tokens) == (ABORT, None, [5], [5])
    assert not s.abort("zzz") and not s.abort("a")
    assert s.plan().request_ids == ["b"]


def test_fail_only_fails_that_sequence():
    s = Scheduler(max_batch=4, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=3), make_seq("b", [1], max_tokens=3)
    s.add(a)
    s.add(b)
    plan = s.plan()
    assert s.fail(["a"], "boom")
    f = ended(s)["a"]
    assert (f.reason, f.error, f.pending_tokens) == (ERROR, "boom", [])
    out = s.apply(plan, [5, 6])  # a's row is skipped
    assert a.output_ids == [] and b.output_ids == [6] and b.slot == 0 and out.emitted == [1]


def test_queue_full():
    s = Scheduler(max_batch=1, step_token_budget=16, prefill_chunk=16, max_queue=2)
    s.add(make_seq("a", [1]))
    s.add(make_seq("b", [1]))
    with pytest.raises(QueueFullError):
        s.add(make_seq("c", [1]))


def test_continuation_stops_when_a_request_can_be_admitted_or_a_row_ends():
    s = Scheduler(max_batch=2, step_token_budget=16, prefill_chunk=16)
    a, b = make_seq("a", [1], max_tokens=50, ignore_eos=True), make_seq("b", [1], max_tokens=50, ignore_eos=True)
    s.add(a)
    p = s.plan()
    assert not p.cont  # an admission
    s.apply(p, [5])
    p = s.plan()
    assert not p.cont and p.decode_tokens == [5]  # the first all-decode plan
    out = s.apply(p, [6])
    assert a.output_ids == [5] and out.emitted is None  # recorded lazily: nothing could end a row
    p = s.plan()
    assert p.cont and p.decode_tokens == [] and p.positions == [] and p.request_ids == ["a"]
    s.apply(p, [7])
    s.add(b)  # a free slot and a waiting request: a full plan (which brings a up to date)
    p = s.plan()
    assert not p.cont and a.output_ids == [5, 6, 7] and p.decode_tokens == [7, 1] and p.positions == [3, 0]
    s.apply(p, [8, 9])
    p = s.plan()
    assert not p.cont and p.decode_tokens == [8, 9] and p.positions == [4, 1]
    s.apply(p, [10, 11])
    p = s.plan()
    assert p.cont
    s.apply(p, [12, 12])
    s.materialize()  # what the engine does while the device runs the next step
    assert a.output_ids[-2:] == [10, 12] and b.output_ids == [9, 11, 12]
    assert s.abort("b") and b.pending_tokens() == [12]  # the next plan is a full one
    p = s.plan()
    assert not p.cont and p.decode_tokens == [12] and p.positions == [6]
    with pytest.raises(ValueError):
        s.apply(StepPlan(), [1])  # tokens of a plan that is not the last one


@pytest.mark.parametrize("stops,chunks,expect", [
    (("abc",), ["xa", "b", "cd"], ("x", True)),
    (("abc", "bd"), ["a", "b", "d"], ("a", True)),
    (("aab",), ["a", "a", "a", "b"], ("a", True)),
    (("END",), ["E", "N", "X"], ("ENX", False)),
    (("😀!",), ["a😀", "😀", "!"], ("a😀", True)),
])  # fmt: skip
def test_stop_matcher(stops, chunks, expect):
    assert _matched(StopMatcher(stops), chunks) == expect


def _matched(m: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    """(the text m lets out of chunks fed one by one, then flushed; whether a stop string hit)"""
    out, hit = "", False
    for c in chunks:
        t, hit = m.feed(c)
        out += t
        if hit:
            return out, hit
    return out + m.flush(), hit


@pytest.mark.parametrize("stops,shown,chunks,expect", [
    (("abc",), "xab", ["c", "d"], ("", True)),  # begun in the shown text: this run shows none of it
    (("abc",), "xa", ["b", "c"], ("", True)),
    (("abc",), "xa", ["bd", "e"], ("bde", False)),  # no match: only this run's text comes out
    (("abc",), "xa", ["b"], ("b", False)),  # what is held at the end: the shown part stays out
    (("ab", "bx"), "a", ["c"], ("c", False)),
    (("ab",), "zz", ["a", "b"], ("", True)),  # nothing shown could start it: a plain match
    (("a😀b",), "a😀", ["b"], ("", True)),
])  # fmt: skip
def test_stop_matcher_over_shown_text(stops, shown, chunks, expect):
    """A continued output's last characters (TextLead.text) are matched with the new text but
    never emitted again."""
    assert _matched(StopMatcher(stops, shown), chunks) == expect


# --- hidden_lead: a chat reply's leading whitespace is hidden, no stop string matches in it ---
@pytest.mark.parametrize("stops,chunks,expect", [
    (("\n",), ["\n\n", "Hello\n", "x"], ("\n\nHello", True)),  # QA's case: was ("", True)
    (("\n",), ["\n", "\n", "Hi"], ("\n\nHi", False)),
    (("\n\n",), ["\n\n\n", "a\n\nb"], ("\n\n\na", True)),
    ((" ",), ["\t\t  ", " word", " more"], ("\t\t   word", True)),
    ((" Hello",), [" Hello world"], (" Hello world", False)),  # begins in the gap: shown "Hello world"
    (("ab",), ["  a", "b"], ("  ", True)),  # a partial match right after the gap is held back
    (("x",), ["\xa0\u3000 ", "yx"], ("\xa0\u3000 y", True)),  # the gap is what str.lstrip strips
    (("\n",), [" \n "], (" \n ", False)),  # a reply of whitespace only: nothing is shown, nothing stops
])  # fmt: skip
def test_no_stop_string_matches_in_the_hidden_leading_whitespace(stops, chunks, expect):
    assert _matched(StopMatcher(stops, hidden_lead=True), chunks) == expect


@pytest.mark.parametrize("stops,chunks,expect", [
    (("\n",), ["\n\n", "Hello\n"], ("", True)),
    ((" Hello",), [" Hello world"], ("", True)),
])  # fmt: skip
def test_without_hidden_lead_the_raw_text_is_matched(stops, chunks, expect):
    """Completions and tasks: nothing is hidden, a stop string may match at the very start."""
    assert _matched(StopMatcher(stops), chunks) == expect


def test_shown_text_still_begins_a_stop_string_without_hidden_lead():
    assert _matched(StopMatcher(("abc",), "xab"), ["c", "d"]) == ("", True)
    assert _matched(StopMatcher(("abc",), "xab", hidden_lead=True), ["c", "d"]) == ("cd", False)


class _Pieces:
    """A decoder whose token i is PIECES[i]."""

    PIECES = {1: "\n\n", 2: "Hi", 3: " there", 4: "\n", 5: "x"}

    def push_one(self, token: int) -> str:
        return self.PIECES[token]

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("hidden,expect", [(True, "\n\nHi there"), (False, "")])
def test_open_text_reads_hidden_lead(hidden, expect):
    """The RequestText of a request with hidden_lead matches past the gap."""
    st = open_text("r", None, _Pieces(), SamplingParams(stop=("\n",), hidden_lead=hidden))
    assert isinstance(st, StopRequestText)
    out = []
    for t in (1, 2, 3, 4, 5):
        if st.match(t):
            break
        out.append(st.emit(t).text)
    assert "".join(out) == expect


def test_a_lead_primes_the_decoder_with_an_unfinished_character():
    """The first bytes of a character in the lead's tokens complete with this request's tokens."""
    from server.engine.types import TextLead
    from server.tokenizer import IncrementalDecoder, get_tokenizer

    ids = list(get_tokenizer().encode("🦜"))
    assert len(ids) == 3  # the world vocabulary splits this emoji over three tokens
    st = open_text("r", None, IncrementalDecoder(), SamplingParams(lead=TextLead(tuple(ids[:2]), "")))
    assert st.emit(ids[2]).text == "🦜"
    fresh = open_text("r", None, IncrementalDecoder(), SamplingParams())
    assert fresh.emit(ids[2]).text == "\ufffd"


class _Dec:
    def push_one(self, token):
        return _piece(token)

    def flush(self):
        return ""


@pytest.mark.parametrize("stops", [(), ("lo\n",), ("zz",)])
@pytest.mark.parametrize("how", ["length", "abort", "stop_id"])
def test_request_text_events_add_up_to_the_text(stops, how):
    """A RequestText's events (and its last event's tail) add up to its text; a stop string's match
    ends the text where the stop string starts."""
    from server.engine.plan import Finished

    st = open_text("r", None, _Dec(), SamplingParams(stop=stops))
    evs, ids = [], [1, 2, 3, 7, 8]
    for t in ids[:-1]:
        if stops and st.match(t):
            end = Finished("r", STOP, t, [], [t], 1, 0.0, 0.0)
            break
        evs.append(st.emit(t))
    else:
        last = ids[-1]
        if how == "length":
            hit = bool(stops) and st.match(last)
            end = Finished("r", STOP if hit else LENGTH, last, ids, [last], 1, 0.0, 0.0)
        else:
            end = Finished("r", ABORT if how == "abort" else STOP, None, ids[:-1], [], 1, 0.0, 0.0)
    evs.append(st.close(end))
    text = "".join(e.text for e in evs)
    assert text == st.text and evs[-1].finished and not any(e.finished for e in evs[:-1])
    full = "".join(_piece(t) for t in (ids if end.token == ids[-1] else ids[:-1]))
    assert text == (full[: full.find("lo\n")] if stops == ("lo\n",) else full)


# --- the engine's step (Engine.step with a fake runner) -------------------------------------
def test_budget_chunking_and_contiguous_prefix_under_load(mode):
    rng = random.Random(0)
    budget, chunk, mb = 40, 16, 8
    e = make_engine(mode, max_batch=mb, budget=budget, chunk=chunk)

    def check(plan):
        assert plan.n_tokens <= budget and plan.n_active <= mb
        assert plan.bucket == bucket_for(plan.n_active, mb)
        assert all(1 <= len(t) < chunk for _, t in plan.prefill)
        assert all(0 <= t <= chunk for t in plan.takes)

    e.runner.on_plan = check
    hs = [submit(e, f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 90))], rng.randrange(0, 12))
          for i in range(40)]  # fmt: skip
    run_all(e)
    for h in hs:
        r, evs = h.result(), list(h)
        assert r.finish_reason == LENGTH and len(r.token_ids) == r.completion_tokens
        assert evs[-1].finished and [t for ev in evs for t in ev.token_ids] == r.token_ids
        assert "".join(ev.text for ev in evs) == r.text == "".join(map(_piece, r.token_ids))


def test_state_plus_pending_is_prompt_plus_output(mode):
    rng = random.Random(1)
    e = make_engine(mode, max_batch=4, budget=12, chunk=5, sampler=lambda fed: 10 + sum(fed) % 9)
    reqs = [([rng.randrange(1, 9) for _ in range(rng.randrange(1, 30))], rng.randrange(0, 6)) for _ in range(20)]
    hs = [submit(e, f"r{i}", p, n, return_state=True, stop_token_ids=(17,)) for i, (p, n) in enumerate(reqs)]
    start = submit(e, "start", [3, 4], 3, return_state=True, init_state=[1, 2])
    assert e.abort("start")  # aborted while waiting: its starting state, its whole prompt pending
    run_all(e)
    for h, (p, n) in zip(hs, reqs):
        r = h.result()
        assert r.state + r.pending_tokens == p + r.token_ids
        assert r.pending_tokens == ([] if r.finish_reason == STOP or n == 0 else r.token_ids[-1:])
    r = start.result()
    assert (r.finish_reason, r.state, r.pending_tokens, r.token_ids) == (ABORT, [1, 2], [3, 4], [])
    assert {h.result().finish_reason for h in hs} == {STOP, LENGTH}


def test_finishing_event_before_the_state_copy_when_asked(mode):
    """end_before_state: the last event goes out while the copy of the request's state is still
    running (a wave's copies queue up); the Result, with the state, follows alone. Without it
    the last event waits with the Result (a task is settled when its stream ends)."""
    e = make_engine(mode)
    copy_done = e.runner.poll_copies
    e.runner.poll_copies = lambda wait=False: []  # the device-to-host copies have not finished
    early = submit(e, "a", [1, 2, 3], 2, return_state=True, end_before_state=True)
    late = submit(e, "b", [1, 2, 4], 2, return_state=True)
    for _ in range(30):
        e.run_once()
    evs = early.take_ready()
    assert evs and evs[-1].finished and evs[-1].finish_reason == LENGTH and early.ended
    assert not early.done and early.peek_result() is None
    assert not any(ev.finished for ev in late.take_ready() or []) and not late.ended
    e.runner.poll_copies = copy_done
    run_all(e)
    r = early.result(1)
    assert early.take_ready() == [] and r.state + r.pending_tokens == [1, 2, 3] + r.token_ids
    assert late.take_ready()[-1].finished and late.result(1).state is not None


def test_outputs_do_not_depend_on_batching(mode):
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 40))] for _ in range(12)]

    def outputs(mb, budget, chunk, together):
        e, res = make_engine(mode, mb, budget, chunk), {}
        batches = [list(range(12))] if together else [[i] for i in range(12)]
        for batch in batches:
            hs = [submit(e, f"r{i}", prompts[i], 4 + i % 5) for i in batch]
            run_all(e)
            res.update({h.request_id: h.result().token_ids for h in hs})
        return res

    assert outputs(4, 9, 3, True) == outputs(1, 64, 64, False) == outputs(16, 1000, 7, True)


def test_stop_string_split_across_tokens_never_leaks(mode):
    script = iter([1, 2, 3, 4, 5, 6, 9])  # "He" "llo" "\n" "\nUs" "er" ":" -> stop
    e = make_engine(mode, max_batch=2, budget=16, chunk=16, sampler=lambda fed: next(script))
    h = submit(e, "q", [1], 20, stop=("\nUser:",), return_state=True)
    run_all(e)
    evs, r = list(h), h.result()
    texts = [ev.text for ev in evs]
    assert "".join(texts) == r.text == "Hello\n"
    assert texts[:3] == ["He", "llo", ""]  # "\n" held back: it may start "\nUser:"
    assert r.finish_reason == STOP and r.token_ids == [1, 2, 3, 4, 5, 6] and r.pending_tokens == [6]
    assert evs[-1].finished and evs[-1].token_ids == [6] and r.state == [1, 1, 2, 3, 4, 5]


def test_held_back_text_is_released_when_no_stop_follows(mode):
    script = iter([1, 3, 4])
    e = make_engine(mode, max_batch=1, budget=16, chunk=16, sampler=lambda fed: next(script))
    h = submit(e, "q", [1], 3, stop=("\nUser:",))
    run_all(e)
    assert [ev.text for ev in h] == ["He", "", "\n\nUs"] and h.result().finish_reason == LENGTH


def test_a_stop_string_on_a_fast_step_frees_the_slot_before_the_next_plan(mode):
    """Rows with stop strings are decided on their text before the next plan, also when the
    ids alone cannot end any row (the scheduler's O(1) apply)."""
    e = make_engine(mode, max_batch=4, budget=16, chunk=16, sampler=lambda fed: 7 if len(fed) < 6 else 8)
    h = submit(e, "q", [1], 50, stop=(" world",), return_state=True)  # " wo" "rld" at the 6th token
    others = [submit(e, f"o{i}", [2], 8) for i in range(3)]
    run_all(e)
    r = h.result()
    assert r.finish_reason == STOP and r.text == " wo" * 4 and r.token_ids[-2:] == [7, 8]
    assert r.state + r.pending_tokens == [1] + r.token_ids
    assert all(o.result().finish_reason == LENGTH for o in others)
    if mode == "cuda":
        assert any(p.cont for p in e.runner.plans)


def test_error_while_processing_a_token_fails_only_that_sequence(mode):
    class Broken(_Dec):
        def push_one(self, token):
            raise RuntimeError("decoder broke")

    e = make_engine(mode, max_batch=4, budget=16, chunk=16)
    real = e.output.new_decoder
    e.output.new_decoder = Broken
    a = submit(e, "a", [1], 3)
    e.output.new_decoder = real
    b = submit(e, "b", [1], 3)
    run_all(e)
    assert a.result().finish_reason == ERROR and "decoder broke" in a.result().error
    assert b.result().finish_reason == LENGTH and len(b.result().token_ids) == 3


def test_continuation_plans_and_lazy_apply_equal_full_plans():
    """The engine's fast path (continuation plans, O(1) apply, text after the next launch) gives
    the same tokens, text, events, states and pending tokens as full plans with text at once;
    exact max_tokens and stop ids (another row's stop id does not end a row)."""

    def go(mode):
        e = make_engine(mode, max_batch=8, budget=64, chunk=4, sampler=lambda fed: 10 + hash(tuple(fed)) % 97)
        hs = [submit(e, f"r{i}", list(range(1, 2 + i)), 3 + 7 * i, return_state=True, stop_token_ids=(10 + i, 30 + i),
                     stop=("\u4e3c", "\u4e5a")[i % 3:][:1])
              for i in range(6)]  # fmt: skip  (rows 0 and 3 have a stop string, row 1 another)
        run_all(e)
        return e, [(h.result(), list(h)) for h in hs]

    e0, plain = go("cpu")
    e1, fast = go("cuda")
    assert sum(p.cont for p in e1.runner.plans) > 10 and not any(p.cont for p in e0.runner.plans)
    for (a, ea), (b, eb) in zip(plain, fast):
        assert (a.token_ids, a.text, a.finish_reason, a.pending_tokens, a.state) == (
            b.token_ids, b.text, b.finish_reason, b.pending_tokens, b.state)  # fmt: skip
        assert ea == eb
        i = int(b.request_id[1:])
        assert b.state + b.pending_tokens == list(range(1, 2 + i)) + b.token_ids
        assert b.finish_reason == STOP or len(b.token_ids) == 3 + 7 * i
    assert {r.finish_reason for r, _ in fast} == {STOP, LENGTH}


def test_plans_list_the_logprob_rows_and_prompt_logprobs_feed_one_token_per_step():
    s = Scheduler(max_batch=4, step_token_budget=64, prefill_chunk=16)
    s.add(make_seq("a", [1, 2, 3], max_tokens=10, logprobs=2))
    s.add(make_seq("b", [4, 5, 6, 7], max_tokens=2, prompt_logprobs=1))
    s.add(make_seq("c", [8], max_tokens=10))
    p = s.plan()
    assert p.takes == [3, 1, 1] and p.logprobs == [(0, 2, SAMPLED), (1, 1, 5)]  # b: scores 5 next
    s.apply(p, [9, 9, 9])
    p = s.plan()
    assert p.takes == [0, 1, 0] and p.logprobs == [(0, 2, SAMPLED), (1, 1, 6)]
    s.apply(p, [9, 9, 9])
    p = s.plan()
    assert p.takes == [0, 1, 0] and p.logprobs == [(0, 2, SAMPLED), (1, 1, 7)]
    s.apply(p, [9, 9, 9])
    p = s.plan()  # b's prompt ends: its row now samples (no logprobs asked for those)
    assert p.takes == [0, 1, 0] and p.commit == [True, True, True] and p.logprobs == [(0, 2, SAMPLED)]
    s.apply(p, [9, 9, 9])
    plans = []
    for _ in range(4):  # b ends (max_tokens 2), c moves into its row, then nothing changes
        plans.append(s.plan())
        s.apply(plans[-1], [9] * plans[-1].n_active)
    assert plans[-2].cont and plans[-1].cont and plans[-1].logprobs is plans[-2].logprobs == [(0, 2, SAMPLED)]


def test_logprobs_reach_events_and_results_in_both_modes():
    def go(mode):
        e = make_engine(mode, max_batch=4, budget=64, chunk=4)
        hs = [submit(e, "a", [1, 2, 3], 6, logprobs=1), submit(e, "b", [4, 5, 6, 7, 8], 4, prompt_logprobs=0),
              submit(e, "c", [9], 5), submit(e, "d", [3, 3], 5, logprobs=0, prompt_logprobs=2)]  # fmt: skip
        run_all(e)
        return [(h.result(), list(h)) for h in hs]

    for (a, ea), (b, eb) in zip(go("cpu"), go("cuda")):
        assert (a.token_ids, a.logprobs, a.prompt_logprobs) == (b.token_ids, b.logprobs, b.prompt_logprobs)
        assert ea == eb
    (ra, eva), (rb, evb), (rc, evc), (rd, evd) = go("cuda")
    assert [v.token for v in ra.logprobs] == ra.token_ids and all(len(v.top) == 1 for v in ra.logprobs)
    assert [v for ev in eva for v in ev.logprobs] == ra.logprobs and rb.logprobs is None
    assert [v.token for v in rb.prompt_logprobs] == [5, 6, 7, 8] and evb[0].prompt_logprobs == rb.prompt_logprobs
    assert rc.logprobs is None and rc.prompt_logprobs is None and all(ev.logprobs is None for ev in evc)
    assert [v.token for v in rd.prompt_logprobs] == [3] and [v.token for v in rd.logprobs] == rd.token_ids


# --- the package's shape ----------------------------------------------------------------------
ENGINE = Path(__file__).resolve().parents[1] / "server" / "engine"
TORCH_FREE = ["types", "protocol", "plan", "sequence", "scheduler", "text", "output", "handle", "stats", "engine",
              "grammar", "constraints"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_engine_modules_import_no_torch(module):
    code = f"import sys, server.engine.{module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ENGINE.parents[1])


def test_the_runner_is_where_torch_comes_in():  # the check above can fail: this module does import it
    code = "import sys, server.engine.runner; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ENGINE.parents[1])


def test_no_import_cycle_in_the_engine():
    graph = {}
    for path in ENGINE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.add(node.module or "")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("server.engine."):
                deps.add(node.module.removeprefix("server.engine."))
        graph[path.stem] = deps - {""}
    done: set[str] = set()

    def visit(m, path):
        assert m not in path, f"import cycle: {' -> '.join(path + [m])}"
        if m in done or m not in graph:
            return
        for d in graph[m]:
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])
    assert graph["handle"] <= {"types"}  # a handle knows its engine only by the callables it is given
    assert [m for m, deps in graph.items() if "engine" in deps] == ["__init__"]
