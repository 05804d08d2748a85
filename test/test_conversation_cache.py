"""The OpenAI routes' conversation cache (server.api.openai.conversation): exact token-prefix
entries, partitions, the byte budget, concurrent use, repairs of re-tokenized replies, and a
10-turn chat through the official OpenAI SDK against servers with the cache on and off."""

from __future__ import annotations

import asyncio
import time

import httpx
import torch
from openai import OpenAI
from util_server import running_server

from server.api.metrics import parse_metrics
from server.api.openai.chat_format import build_prompt
from server.api.openai.conversation import ConversationCache
from server.engine import SamplingParams
from server.model import load_model
from server.model.state import State
from server.model.synthetic import PRESETS
from server.tokenizer import get_tokenizer

TOL = 1e-4
GREEDY = SamplingParams(max_tokens=12, temperature=0, presence_penalty=0, repetition_penalty=0, ignore_eos=True)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _state(fill: float) -> State:
    st = State.zeros(PRESETS["tiny"], 1)
    st.wkv.fill_(fill)
    return st


# --- the index: longest prefix, partitions, budget ------------------------------------------------
async def test_longest_kept_prefix_within_its_partition():
    c = ConversationCache(10 * _state(0).nbytes())
    a, b = c.partition("key-a"), c.partition("key-b")
    c.put(a, [1, 2, 3], _state(1))
    c.put(a, [1, 2, 3, 4, 5], _state(2))
    c.put(a, [1, 2, 9], _state(3))
    st, n = await c.lookup(a, [1, 2, 3, 4, 5, 6, 7])
    assert n == 5 and st.wkv[0, 0, 0, 0, 0] == 2
    st, n = await c.lookup(a, [1, 2, 3, 4, 5])  # the last token is always fed: at most len - 1
    assert n == 3 and st.wkv[0, 0, 0, 0, 0] == 1
    assert (await c.lookup(a, [1, 2, 9, 9]))[1] == 3 and (await c.lookup(a, [2, 2, 3, 4]))[1] == 0
    assert (await c.lookup(b, [1, 2, 3, 4, 5, 6]))[1] == 0  # another key's entries are not seen
    assert (await c.lookup(c.partition("key-a", "_tpl:1"), [1, 2, 3, 4]))[1] == 0  # another base
    shared = ConversationCache(1 << 20, shared=True)
    assert shared.partition("key-a") == shared.partition("key-b")
    assert c.counters["hits"] == 3 and c.counters["tokens_saved"] == 11
    # a state shorter than what the request would use (a chat's shared prefix state goes further):
    # none returned, and no hit counted (QA: counted, then dropped for the prefix's state)
    assert await c.lookup(a, [1, 2, 3, 4, 5, 6, 7], at_least=6) == (None, 0)
    assert c.counters["hits"] == 3 and c.counters["tokens_saved"] == 11 and c.counters["misses"] == 4


async def test_byte_budget_evicts_least_recently_used():
    one = _state(0).nbytes()
    c = ConversationCache(2 * one + 10)
    p = c.partition(None)
    c.put(p, [1, 1], _state(1))
    c.put(p, [2, 2], _state(2))
    assert (await c.lookup(p, [1, 1, 0]))[1] == 2  # [1, 1] is now the most recently used
    c.put(p, [3, 3], _state(3))
    assert (await c.lookup(p, [2, 2, 0]))[1] == 0 and (await c.lookup(p, [1, 1, 0]))[1] == 2
    assert c.stats()["entries"] == 2 and c.stats()["bytes"] <= 2 * one + 10


# --- through the engine: exactness, concurrency, repairs -------------------------------------------
async def _run(eng, conv, part, stream, expect=None, params=GREEDY):
    """One tracked request from the longest kept prefix; (result, tokens served from the cache)."""
    state, n = await conv.lookup(part, stream)
    h = eng.submit(stream[n:], params, init_state=state, return_state=True)
    conv.track(eng, part, stream, [h], expect)
    return await h.wait(), n


async def _settled(conv):
    await asyncio.gather(*conv._tasks)


async def test_states_through_the_cache_give_full_prefill_logits(parts):
    model, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    t1 = tok.encode("User: How are you today?\n\nAssistant:")
    res, _ = await _run(eng, conv, part, t1)
    await _settled(conv)
    t2 = t1 + res.token_ids + tok.encode("\n\nUser: And tomorrow?\n\nAssistant:")
    state, n = await conv.lookup(part, t2)
    assert n == len(t1) + len(res.token_ids) - 1  # all but the pending last token
    cached = model.forward([t2[n:]], state.clone())
    full = model.forward([t2], model.zero_state(1))
    assert rel_err(cached, full) < TOL


async def test_two_requests_extending_one_prefix_at_once(parts):
    _, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    head = tok.encode("System: You answer in one word.\n\nUser: Hi\n\nAssistant:")
    await _run(eng, conv, part, head, params=SamplingParams(max_tokens=0))
    await _settled(conv)
    kept, n = conv.best(part, head + [5], len(head))
    assert n == len(head)
    before = kept.checksum()
    tails = [tok.encode(" one"), tok.encode(" two words")]
    both = await asyncio.gather(*(_run(eng, conv, part, head + t) for t in tails))
    assert [n for _, n in both] == [len(head), len(head)]
    assert kept.checksum() == before  # a starting state is copied, never written
    for (res, _), t in zip(both, tails):
        alone = eng.submit(head + t, GREEDY).result(60)
        assert res.token_ids == alone.token_ids


async def _mismatched(eng, conv, part, tok):
    """A request whose expected next prompt does not extend what it fed (as when a client re-sends
    a reply whose text tokenizes differently from the ids generated); (t1, expected, t2)."""
    t1 = tok.encode("User: Name a colour.\n\nAssistant:")
    expected = t1 + tok.encode(" A colour nobody generated\n\n")

    async def expect(_res):
        return expected

    await _run(eng, conv, part, t1, expect)
    return t1, expected, expected + tok.encode("User: Another?\n\nAssistant:")


async def test_a_reply_that_retokenizes_differently_is_repaired_in_idle_time(parts):
    model, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    _, expected, t2 = await _mismatched(eng, conv, part, tok)
    await _settled(conv)  # the user reads the reply: the engine is idle
    assert conv.counters["mismatches"] == 1 and conv.counters["repairs"] == 1
    state, n = await conv.lookup(part, t2)
    assert n == len(expected) and conv.counters["waits"] == 0
    assert rel_err(model.forward([t2[n:]], state.clone()), model.forward([t2], model.zero_state(1))) < TOL


async def test_a_continuation_at_once_is_not_held_up_by_a_repair(parts):
    """A client that sends the next turn at once: it waits for the request's end state, not for
    a repair of its reply (it prefills the reply itself: one engine round trip fewer)."""
    _, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    _, expected, t2 = await _mismatched(eng, conv, part, tok)
    _, n = await conv.lookup(part, t2)
    assert conv.counters["waits"] == 1 and n < len(expected)
    await _settled(conv)
    assert conv.counters["repairs"] <= 1 and conv.best(part, t2, len(t2))[1] < len(expected)


async def test_a_burst_of_repairs_runs_a_few_at_a_time(parts, monkeypatch):
    """Many mismatched replies settling together: every one is repaired, never more than
    REPAIR_CONCURRENCY at once (else the engine would be flooded the moment it went idle)."""
    from server.api.openai import conversation

    _, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    running, peak = 0, 0
    real = conv.prefill

    async def counted(*a, **k):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.05)  # hold the slot long enough for the others to pile up
            return await real(*a, **k)
        finally:
            running -= 1

    monkeypatch.setattr(conv, "prefill", counted)
    n = 3 * conversation.REPAIR_CONCURRENCY
    t1 = tok.encode("User: Name a colour.\n\nAssistant:")

    async def one(i):
        expected = t1 + tok.encode(f" colour number {i}\n\n")

        async def expect(_res):
            return expected

        await _run(eng, conv, part, t1 + tok.encode(f" {i}"), expect, params=SamplingParams(max_tokens=2))

    await asyncio.gather(*(one(i) for i in range(n)))
    await _settled(conv)
    assert conv.counters["mismatches"] == n and conv.counters["repairs"] == n
    assert 1 < peak <= conversation.REPAIR_CONCURRENCY


async def test_a_continuation_never_waits_behind_other_requests_repairs(parts, monkeypatch):
    """Every repair slot is held by a repair waiting for an idle engine that never comes (a busy
    server), and one more mismatched request settles behind them. Its next turn must not wait
    for a slot (the 4 in use may hold it for REPAIR_IDLE_S each): the queued repair is dropped at
    once and the turn prefills the reply itself."""
    from server.api.openai import conversation

    async def busy(engine, s):  # the engine never goes idle: a repair waits until it is dropped
        while not s.awaited:
            await asyncio.sleep(0.01)
        return False

    monkeypatch.setattr(conversation, "engine_idle", busy)
    _, tok, eng = parts
    conv = ConversationCache(1 << 30, wait_s=5.0)
    part = conv.partition(None)
    t1 = tok.encode("User: Name a colour.\n\nAssistant:")

    async def mismatched(i):
        stream = t1 + tok.encode(f" {i}")
        expected = stream + tok.encode(f" colour number {i}\n\n")

        async def expect(_res):
            return expected

        await _run(eng, conv, part, stream, expect, params=SamplingParams(max_tokens=2))
        return expected

    for i in range(conversation.REPAIR_CONCURRENCY):  # each takes a slot and waits for idle
        await mismatched(i)
    last = await mismatched(99)
    for _ in range(200):  # until every settle reached its slot or the queue
        if conv.counters["mismatches"] == conversation.REPAIR_CONCURRENCY + 1:
            break
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    _, n = await conv.lookup(part, last + tok.encode("User: Another?\n\nAssistant:"))
    assert time.perf_counter() - t0 < 1.0 and conv.counters["waits"] == 1
    for ss in conv._settling.get(part, []):  # let the held repairs go
        ss.awaited = True
        ss.kick.set()
    await _settled(conv)
    assert conv._repair_slots.free == conversation.REPAIR_CONCURRENCY and conv.counters["repairs"] == 0

async def test_a_queued_repair_holds_no_state_and_leaves_the_queue_in_time(parts, monkeypatch):
    """A busy engine keeps repairs waiting: one queued behind the slots must not keep its request's
    final state alive (QA: the queue grew with the mismatches, a state each, outside every budget),
    and it leaves the queue after REPAIR_IDLE_S."""
    import gc
    import weakref

    from server.api.openai import conversation, settling

    async def busy(engine, s):  # the engine never goes idle
        while not s.awaited:
            await asyncio.sleep(0.01)
        return False

    monkeypatch.setattr(conversation, "engine_idle", busy)
    monkeypatch.setattr(settling, "REPAIR_IDLE_S", 1.0)
    _, tok, eng = parts
    conv = ConversationCache(1 << 30, wait_s=5.0)
    part = conv.partition(None)
    t1 = tok.encode("User: Name a colour.\n\nAssistant:")
    refs = []

    async def mismatched(i):
        stream = t1 + tok.encode(f" {i}")
        expected = stream + tok.encode(f" colour number {i}\n\n")

        async def expect(_res):
            return expected

        res, _ = await _run(eng, conv, part, stream, expect, params=SamplingParams(max_tokens=2))
        refs.append(weakref.ref(res.state.wkv))

    for i in range(conversation.REPAIR_CONCURRENCY + 1):  # the slots' holders, then one queued
        await mismatched(i)
    for _ in range(200):
        if conv.counters["mismatches"] == conversation.REPAIR_CONCURRENCY + 1:
            break
        await asyncio.sleep(0.01)
    queued = conv._repair_slots._queue
    assert len(queued) == 1 and conv._repair_slots.free == 0
    gc.collect()
    assert all(r() is None for r in refs), "a waiting or queued repair keeps its request's state"
    await asyncio.sleep(1.3)  # past REPAIR_IDLE_S: the queued one gave up
    assert len(queued) == 0
    for ss in conv._settling.get(part, []):  # let the held repairs go
        ss.awaited = True
        ss.kick.set()
    await _settled(conv)
    assert conv._repair_slots.free == conversation.REPAIR_CONCURRENCY and conv.counters["repairs"] == 0


class LateResult:
    """A finished request's handle whose last event went out but whose Result, with its state,
    is still on its way (its copy to the host queued behind others) until release()."""

    def __init__(self, handle):
        self.handle, self.request_id, self.released = handle, handle.request_id, False

    ended = True

    @property
    def done(self):
        return self.released

    def peek_result(self):
        return self.handle.peek_result() if self.released else None

    def release(self):
        self.released = True


async def test_a_continuation_sent_before_the_state_arrived_waits_for_it(parts):
    """The client saw the reply's end and sent the next turn while the reply's state was still
    being copied off the device: the lookup waits for that state instead of missing it."""
    _, tok, eng = parts
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    t1 = tok.encode("User: Name a colour.\n\nAssistant:")
    h = eng.submit(t1, GREEDY, return_state=True)
    res = await h.wait()
    late = LateResult(h)
    conv.track(eng, part, t1, [late], None)
    t2 = t1 + res.token_ids + tok.encode("\n\nUser: Another?\n\nAssistant:")
    asyncio.get_running_loop().call_later(0.2, late.release)
    _, n = await conv.lookup(part, t2)
    assert conv.counters["waits"] == 1 and n == len(t1) + len(res.token_ids) - 1


class CountingEngine:
    """The engine, counting submissions."""

    def __init__(self, engine):
        self.engine, self.submits = engine, 0

    def submit(self, *args, **kw):
        self.submits += 1
        return self.engine.submit(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def test_prompt_ends_are_prefilled_once_and_kept(parts):
    """The split of a long prompt: identical prompts at once share one prefill; the state is
    kept, and is a full prefill's within TOL."""
    model, tok, eng = parts
    counting = CountingEngine(eng)
    conv = ConversationCache(1 << 30)
    part = conv.partition(None)
    prompt = tok.encode("User: " + "a long question about rivers and bridges " * 12 + "\n\nAssistant:")
    states = await asyncio.gather(*(conv.prefill(counting, part, prompt[:-1], None, 0) for _ in range(3)))
    assert counting.submits == 1 and states[0] is states[1] is states[2]
    state, n = await conv.lookup(part, prompt)
    assert n == len(prompt) - 1 and state is states[0]
    logits = model.forward([prompt[-1:]], state.clone())
    assert rel_err(logits, model.forward([prompt], model.zero_state(1))) < TOL


# --- the 10-turn chat through the OpenAI SDK --------------------------------------------------------
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which one is larger?", "How far apart are they?",
             "What language is spoken there?", "Name a famous dish.", "Is it spicy?", "What wine goes with it?",
             "When is the best season to visit?", "Thank you!"]
CHAT = {"max_tokens": 24, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0}
MARGIN = 1e-4


def _chat(url: str, stream_last: bool = False) -> tuple[list[str], list[tuple[int, int, int]]]:
    """10 turns re-sending the history; (replies, (prompt, completion, cached) per turn)."""
    client = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": SYSTEM}]
    replies, usage = [], []
    for i, q in enumerate(QUESTIONS):
        msgs.append({"role": "user", "content": q})
        if stream_last and i == len(QUESTIONS) - 1:
            chunks = list(client.chat.completions.create(model="m", messages=msgs, stream=True,
                                                         stream_options={"include_usage": True}, **CHAT))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            u = chunks[-1].usage
        else:
            r = client.chat.completions.create(model="m", messages=msgs, **CHAT)
            text, u = r.choices[0].message.content, r.usage
        replies.append(text)
        usage.append((u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens))
        msgs.append({"role": "assistant", "content": text})
    return replies, usage


def _margins(replies: list[str], usage) -> list[float]:
    """The smallest relative top-two logit gap of each turn's greedy reply, from a full prefill
    in-process (the model the servers load: synthetic:tiny)."""
    model, tok = load_model("synthetic:tiny"), get_tokenizer()
    msgs = [("system", SYSTEM)]
    out = []
    for q, reply, (_, n_out, _) in zip(QUESTIONS, replies, usage):
        msgs.append(("user", q))
        p = build_prompt(msgs)
        state = model.zero_state(1)
        logits = model.forward([tok.encode(p.prefix) + tok.encode(p.rest)], state)[0]
        gaps = []
        for _ in range(n_out):
            top = torch.topk(logits, 2).values
            gaps.append(((top[0] - top[1]) / top.abs().max()).item())
            logits = model.decode(torch.tensor([int(logits.argmax())]), state)[0]
        out.append(min(gaps, default=1.0))
        msgs.append(("assistant", reply))
    return out


def test_ten_turn_chat_reuses_the_history_and_answers_as_without_the_cache(tmp_path):
    with running_server(tmp_path / "off", env={"RWKV_CONVERSATION_CACHE_BYTES": "0"}) as off:
        ref, ref_usage = _chat(off.url)
        off_metrics = parse_metrics(httpx.get(off.url + "/metrics").text)
    # the cache off: its series exist, at zero (a dashboard needs no special case)
    assert off_metrics["rwkv_conversation_cache_hits_total"] == 0 == off_metrics["rwkv_conversation_cache_bytes"]
    with running_server(tmp_path / "on") as on:
        replies, usage = _chat(on.url, stream_last=True)
        metrics = parse_metrics(httpx.get(on.url + "/metrics").text)
    margins = _margins(ref, ref_usage)
    wide = [i for i, m in enumerate(margins) if m > MARGIN]
    assert len(wide) >= 8, f"too few turns with wide greedy margins: {margins}"
    for i in wide:
        assert replies[i] == ref[i], f"turn {i + 1}: {replies[i]!r} != {ref[i]!r}"
    assert [u[:2] for u in usage] == [u[:2] for u in ref_usage]
    n_system = len(get_tokenizer().encode(f"System: {SYSTEM}\n\n"))  # the shared prefix cache, on in both
    assert [u[2] for u in ref_usage] == [0] + [n_system] * (len(QUESTIONS) - 1) and usage[0][2] == 0
    # the first turn is short and holds no reply: not kept (min_tokens), so turn 2 starts from
    # the shared system prefix; turn 2 holds a reply, so from then on every turn is kept
    assert usage[1][2] == n_system
    for i in range(2, len(usage)):
        prev = usage[i - 1][0] + usage[i - 1][1]
        assert usage[i][2] >= 0.9 * prev, f"turn {i + 1}: cached {usage[i][2]} of {prev}"
    turns = len(QUESTIONS) - 2
    assert metrics["rwkv_conversation_cache_hits_total"] >= turns
    assert metrics["rwkv_conversation_cache_tokens_saved_total"] >= sum(u[2] for u in usage) - usage[0][2] - 16
    kept = metrics["rwkv_conversation_cache_kept_total"]
    print(f"\n10-turn chat: {kept:.0f} replies kept as generated, "
          f"{metrics['rwkv_conversation_cache_repairs_total']:.0f} repair prefills "
          f"({metrics['rwkv_conversation_cache_repair_tokens_total']:.0f} tokens); cached per turn "
          f"{[u[2] for u in usage]}; greedy margins min {min(margins):.2e}")


def _think(url: str, requests: int) -> None:
    """Wait as a user reading the replies would: until the server settled `requests` tracked
    one-choice requests and ran their repairs (the /metrics counters)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        mismatches = m.get("rwkv_conversation_cache_mismatches_total", 0)
        settled = m.get("rwkv_conversation_cache_kept_total", 0) + mismatches
        if settled >= requests and m.get("rwkv_conversation_cache_repairs_total", 0) >= mismatches:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not settle the requests")


def test_each_api_key_has_its_own_conversations(tmp_path):
    env = {"RWKV_API_KEYS": "k1,k2", "RWKV_CONVERSATION_CACHE_MIN_TOKENS": "0"}  # short exchanges kept too
    with running_server(tmp_path, env=env) as srv:
        def turn(key: str, history: list[dict]) -> tuple[int, str]:
            r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"messages": history, **CHAT}, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["message"]["content"]

        first = [{"role": "user", "content": "Hello there"}]
        cached, reply = turn("k1", first)
        assert cached == 0
        _think(srv.url, 1)
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me more"}]
        assert turn("k2", second)[0] == 0  # k1's conversation is not k2's
        _think(srv.url, 2)
        assert turn("k1", second)[0] >= 0.9 * len(get_tokenizer().encode(f"User: Hello there\n\nAssistant: {reply}"))

        def complete(prompts: list[str]) -> dict:
            r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer k1"}, timeout=60,
                           json={"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        long = ["The bridge over the river " * 20, "A different story about mountains " * 20]
        first = complete(long)
        assert len(first["choices"]) == 4 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = complete([p + "and then" for p in long])  # each prompt extends a kept prompt end
        n_long = sum(len(get_tokenizer().encode(p)) for p in long)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_long - 4


def test_only_exchanges_worth_keeping_keep_their_states(tmp_path):
    """min_tokens (default 512): a one-off short completion or first chat turn keeps nothing (no
    state copied out, nothing settled); a long one, and a chat that holds an earlier reply, are
    kept, and the next turn starts from the kept state."""
    def counters(url: str) -> tuple[float, float]:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        return m.get("rwkv_conversation_cache_kept_total", 0), m.get("rwkv_conversation_cache_mismatches_total", 0)

    with running_server(tmp_path) as srv:
        post = lambda path, body: httpx.post(srv.url + path, json={**body, **CHAT}, timeout=60).json()  # noqa: E731
        short = post("/v1/completions", {"prompt": "Once upon a time"})
        first = [{"role": "user", "content": "Hello there"}]
        reply = post("/v1/chat/completions", {"messages": first})["choices"][0]["message"]["content"]
        time.sleep(1.0)  # a settle would have polled the ends by now
        assert counters(srv.url) == (0, 0) and short["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ongoing = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me more"}]
        body = post("/v1/chat/completions", {"messages": ongoing})
        _think(srv.url, 1)  # kept as generated or repaired: settled either way
        again = [*ongoing, {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And then?"}]
        n_prev = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert post("/v1/chat/completions", {"messages": again})["usage"]["prompt_tokens_details"]["cached_tokens"] \
            >= 0.9 * n_prev
        _think(srv.url, 2)
        long_prompt = "The bridge over the river " * 100  # 500+ tokens with max_tokens 24: kept
        post("/v1/completions", {"prompt": long_prompt})
        _think(srv.url, 3)


# --- an agent's tool-calling turns -------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": CITY}}]


def test_an_agents_tool_turns_reuse_the_history_with_its_calls(tmp_path):
    """Each turn of a tool loop (the client re-sends the assistant's tool_calls and the tool's
    result) starts from the state at the end of the previous reply, kept as generated or
    repaired in idle time: forced calls and a final "none" turn too (the tools stay described)."""
    env = {"RWKV_CONVERSATION_CACHE_MIN_TOKENS": "0"}
    with running_server(tmp_path / "on", env=env) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris, Rome, Oslo?"}]
        usage = []
        for turn, choice in enumerate(["required", "auto", "required", "required", "none"]):
            r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice=choice, seed=turn,
                                               max_tokens=40, parallel_tool_calls=False)
            u, m = r.usage, r.choices[0].message
            usage.append((u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens))
            msgs.append(m.model_dump(exclude_none=True))
            for call in m.tool_calls or ():
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
            if not m.tool_calls:
                msgs.append({"role": "user", "content": "Thanks. And tomorrow?"})
            _think(srv.url, turn + 1)
        metrics = parse_metrics(httpx.get(srv.url + "/metrics").text)
    # from turn 2 on only the new messages are prefilled: a tool result turn and "Assistant:" is
    # ~24 tokens, a user turn fewer (the reply itself is cached: as the client re-sends it, the
    # calls' JSON written canonically, which can be fewer tokens than were generated)
    for i in range(1, len(usage)):
        assert usage[i][0] - usage[i][2] <= 32, f"turn {i + 1}: {usage[i][2]} of {usage[i][0]} cached: {usage}"
    assert metrics["rwkv_conversation_cache_hits_total"] >= len(usage) - 1


# --- a structured reply re-sent as history -----------------------------------------------------------
DIGIT = {"type": "json_schema", "json_schema": {"name": "digit", "strict": True,
                                                "schema": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_a_formatted_reply_resent_as_history_is_kept_as_generated(tmp_path):
    """A reply constrained by response_format (alone, and with tools "auto": a call or the
    formatted reply) starts with the gap after "Assistant:", as a free reply's first token does
    (server.api.openai.agents.chat_ready), so the message the client re-sends re-tokenizes as
    generated: the state at its end is kept as it is (no mismatch, no repair) and the next turn
    starts from it. (A digit: one token " 6" on the tiny model, as the tokenizer writes it; without
    the gap the model wrote ":" "6" where the history tokenizes to ":" " 6".)"""
    env = {"RWKV_CONVERSATION_CACHE_MIN_TOKENS": "0"}
    with running_server(tmp_path, env=env) as srv:
        def counters() -> dict[str, float]:
            m = parse_metrics(httpx.get(srv.url + "/metrics").text)
            return {k: m.get(f"rwkv_conversation_cache_{k}_total", 0) for k in ("kept", "mismatches", "repairs")}

        for i, extra in enumerate([{}, {"tools": TOOLS}]):
            msgs = [{"role": "user", "content": f"Pick a digit ({i})."}]
            body = {"response_format": DIGIT, "max_tokens": 8, "temperature": 0, **extra}
            first = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, **body}, timeout=60).json()
            reply = first["choices"][0]["message"]
            assert reply["content"].isdigit() and first["choices"][0]["finish_reason"] == "stop", first  # no gap shown
            _think(srv.url, 2 * i + 1)
            assert counters() == {"kept": 2 * i + 1, "mismatches": 0, "repairs": 0}
            msgs += [reply, {"role": "user", "content": "Another one."}]
            second = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, **body}, timeout=60).json()
            u, cached = first["usage"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == u["prompt_tokens"] + u["completion_tokens"]
            _think(srv.url, 2 * i + 2)
