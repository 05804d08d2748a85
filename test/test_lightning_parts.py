"""The parts of the rwkv_lightning package without a server: its answer bytes, the OpenAI-style
prompt format, the per-route defaults of its document, and the session registry on a task
manager over a scripted engine (server.api.lightning)."""

from __future__ import annotations

import gc
import weakref

import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer

from server.api.generation.jobs import Job
from server.api.lightning import chat_prompt
from server.api.lightning.errors import LightningError
from server.api.lightning.render import Flushes, native_chunk, native_renderer
from server.api.lightning.schemas import (
    BigBatchBody,
    ChatStyleBody,
    FimBody,
    LightningV1Body,
    LightningV2Body,
    StateBody,
    TranslateBody,
)
from server.api.lightning.sessions import (
    MAX_FULL_NAME,
    TAG,
    NameTooLong,
    SessionNotFound,
    Sessions,
    continued,
    name_of,
    name_problem,
)
from server.api.streaming.source import DONE, SHUTDOWN, event
from server.config import Settings
from server.engine.types import Event
from server.tasks import TaskManager
from server.tasks.records import Task


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "line\nbreak", "中文 ✿ 🙂", ""])
def test_native_chunk_is_the_event_of_lightnings_chunk(text):
    for i in (0, 7, 1234):
        want = event({"object": "chat.completion.chunk", "choices": [{"index": i, "delta": {"content": text}}]})
        assert native_chunk(i, text) == want


def _flushed(f: Flushes, index: int, texts: list[str]) -> list[str | None]:
    """What f sends for one token of each text in turn for choice `index`, the last one ending it."""
    job = Job(index=index, handle=None, prompt_tokens=1)  # type: ignore[arg-type]
    sent = []
    for n, text in enumerate(texts, start=1):
        job.completion_tokens = n
        job.finish_reason = "length" if n == len(texts) else None
        sent.append(f.add(job, [Event(text=text, token_ids=[n], n_tokens=n)]))
    return sent


def test_flushes_send_every_chunk_size_tokens_and_at_the_end():
    f = Flushes(2, chunk_size=3)
    assert _flushed(f, 1, ["a", "b", "c", "d", "e"]) == [None, None, "abc", None, "de"]
    assert f.text == ["", ""]


def test_a_flush_waits_for_text_as_on_lightning():
    # lightning flushes a prompt once chunk_size tokens came since its last flush AND it holds text:
    # tokens whose text is held back (a split UTF-8 character, a possible stop string) flush nothing
    # and do not restart the count (its `chunk_token_counts[i] >= chunk_size and text_buffers[i]`)
    assert _flushed(Flushes(1, chunk_size=2), 0, ["", "", "a", "b", "c"]) == [None, None, "a", None, "bc"]


async def test_a_stream_ended_early_sends_the_text_it_held_first():
    jobs = [Job(index=i, handle=None, prompt_tokens=1) for i in range(3)]  # type: ignore[arg-type]
    r = native_renderer(jobs, chunk_size=10**9)
    for i, text in ((0, "ab"), (2, "c"), (0, "d")):
        jobs[i].completion_tokens += 1
        assert r.render(jobs[i], [Event(text=text, token_ids=[1], n_tokens=1)]) == (b"", False)
    assert await r.error_end("shutdown") == native_chunk(0, "abd") + native_chunk(2, "c") + SHUTDOWN + DONE
    assert await r.error_end("shutdown") == SHUTDOWN + DONE  # taken: never sent twice


def test_lightnings_lenient_values():
    assert [LightningV1Body(chunk_size=n).chunk_size for n in (0, -5, 1, 10**12)] == [1, 1, 1, 10**12]
    assert ChatStyleBody(chunk_size=0).chunk_size == 1 and ChatStyleBody().chunk_size is None
    assert LightningV1Body(stop_tokens=["", "x", ""]).stop_tokens == ["x"]
    assert BigBatchBody(stop_tokens=[""] * 20).sampling(65536).stop == ()


def test_session_names_leave_room_for_node_suffixes():
    assert name_problem("s" * 200) is None and name_problem("s" * 201) is not None
    for node in ("s" * 200 + ":1", "s" * 200 + ":1:23", "s" * 199 + "9:7"):  # names the server makes
        assert name_problem(node) is None, node
    assert name_problem("s" * 201 + ":1") is not None and name_problem("s:" * 150) is not None
    assert name_problem(":1" * 111) is None and name_problem(":1" * 111 + "1") is not None  # 223 > MAX_FULL_NAME
    assert name_problem("a\x00b") == "session_id must not contain the NUL character"


def test_the_field_a_long_prompt_came_from():
    long, short = "x" * 1000, [{"role": "user", "content": "hi"}]
    assert chat_prompt.main_field(ChatStyleBody(messages=[{"role": "user", "content": long}])) == "messages"
    assert chat_prompt.main_field(ChatStyleBody(messages=short, contents=[long])) == "contents"
    assert chat_prompt.main_field(ChatStyleBody(contents=[long])) == "contents"
    assert chat_prompt.main_field(ChatStyleBody(messages=short, system=long)) == "system"
    assert chat_prompt.main_field(ChatStyleBody(messages=[*short, {"role": "tool", "content": long}])) == "messages"


def test_the_documented_defaults_per_route():
    v1 = LightningV1Body()
    assert (v1.model, v1.max_tokens, v1.stop_tokens, v1.temperature, v1.top_k, v1.top_p, v1.alpha_presence,
            v1.alpha_frequency, v1.alpha_decay, v1.stream, v1.chunk_size, v1.password) == (
        "rwkv7", 8192, ["\nUser:"], 1.0, 50, 0.6, 2.0, 0.2, 0.996, False, 4, None)
    v2 = LightningV2Body()
    assert (v2.top_k, v2.top_p, v2.alpha_presence, v2.alpha_frequency, v2.alpha_decay) == (500, 0.5, 1.0, 0.1, 0.99)
    assert FimBody().fields() == StateBody().fields() == v1.fields()
    chat = ChatStyleBody()
    assert (chat.max_tokens, chat.top_k, chat.top_p, chat.alpha_presence, chat.alpha_frequency, chat.alpha_decay,
            chat.enable_think, chat.use_prefix_cache, chat.chunk_size) == (4096, 20, 0.6, 1.0, 0.1, 0.996, False,
                                                                           True, None)
    big = BigBatchBody().sampling(65536)
    assert (big.max_tokens, big.temperature, big.top_k, big.top_p, big.presence_penalty,
            big.repetition_penalty, big.stop) == (8192, 1.0, 0, 1.0, 0.0, 0.0, ("\nUser:",))
    tr = TranslateBody(target_lang="en", text_list=["x"])
    assert (tr.source_lang, tr.max_tokens) == ("auto", 2048)
    p = v1.sampling(65536)  # lightning's names onto ours
    assert (p.presence_penalty, p.repetition_penalty, p.penalty_decay, p.top_k) == (2.0, 0.2, 0.996, 50)


def test_chat_style_prompt_format():
    body = ChatStyleBody(system="Be brief.\n\n  ", contents=["From contents"], messages=[
        {"role": "developer", "content": "Speak English."},
        {"role": "user", "content": "Hi\n\n\nthere  "},
        {"role": "tool", "content": "ignored"},
        {"role": "Assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url"}, " you"]},
        {"role": "user", "content": "   "},
    ])
    prefix, rest = chat_prompt.build(body)
    assert prefix == "System: Be brief.\nSpeak English.\n\n"
    assert rest == "User: Hi\nthere\n\nAssistant: Hello you\n\nUser: From contents\n\nAssistant: <think>\n</think>\n"
    _, rest = chat_prompt.build(ChatStyleBody(messages=[{"role": "user", "content": "Q"}], enable_think=True))
    assert rest == "User: Q\n\nAssistant: <think"
    assert chat_prompt.build(ChatStyleBody(system="S")) == ("System: S\n\n", "Assistant: <think>\n</think>\n")
    with pytest.raises(LightningError) as e:
        chat_prompt.build(ChatStyleBody(messages=[{"role": "user", "content": " \n"}]))
    assert e.value.status == 400 and e.value.body() == {"error": "Empty prompt"}


def test_session_names_and_the_blank_line_rule():
    assert name_of(Task(id="TASK_1", kind="task", tag=TAG + "chat:7")) == "chat:7"
    assert name_of(Task(id="TASK_1", kind="task", tag="response")) is None
    assert name_of(Task(id="TASK_1", kind="task")) is None
    assert continued("Hi") == "\n\nHi" and continued("\n\nHi") == "\n\nHi" and continued("\nHi") == "\n\n\nHi"


@pytest.fixture
async def tm(tmp_path):
    m = TaskManager(FakeEngine(), FakeTokenizer(), Settings(db=str(tmp_path / "t.db"), device="cpu"), FakeShape())
    await m.start()
    yield m
    await m.close()


FIELDS = {"max_tokens": 2, "stop": ["\nUser:"]}


async def test_a_task_manager_with_sessions_is_freed_once_closed(tmp_path):
    """The registry (a WeakKeyDictionary by task manager) holds its manager weakly: a closed
    manager, its engine and their states go with the last reference (they stayed for the whole
    process, one set per test, before)."""
    m = TaskManager(FakeEngine(), FakeTokenizer(), Settings(db=str(tmp_path / "t.db"), device="cpu"), FakeShape())
    await m.start()
    await m.wait((await Sessions.of(m).chat("k1", "a", "hello", FIELDS)).id)
    await m.close()
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


async def test_sessions_are_found_by_their_tag_from_any_registry(tm):
    s = Sessions.of(tm)
    assert Sessions.of(tm) is s
    a = await s.chat("k1", "a", "hello", FIELDS)
    t1, i1 = await s.branch("k1", "b", 0, "root", FIELDS)
    await tm.wait(t1.id)
    t2, i2 = await s.branch("k1", "b", 1, "more", FIELDS)
    await tm.wait(a.id), await tm.wait(t2.id)
    await tm.wait((await s.branch("k2", "b", 0, "theirs", FIELDS))[0].id)
    assert (i1, i2) == (1, 2) and t2.parent_id == t1.id  # a branch is a fork of its node
    assert a.params["stop"] == FIELDS["stop"]  # the parameters are the client's: no mark in them
    fresh = Sessions(tm)  # what a restarted server (or another replica) finds in the store
    assert [(n, t.id) for n, t in await fresh.listing("k1")] == [("a", a.id), ("b:1", t1.id), ("b:2", t2.id)]
    assert [n for n, _ in await fresh.listing("k2")] == ["b:1"]
    assert (await fresh.find("k1", "b:2")).id == t2.id and await fresh.find("k2", "a") is None
    again = await fresh.chat("k1", "a", "more", FIELDS)  # the same task goes on
    assert again.id == a.id
    await tm.wait(a.id)


async def test_a_fork_or_a_stop_of_its_own_does_not_move_a_session(tm):
    """Before the tag column a session was a stop string in its parameters: a /v1/tasks fork of
    a session task inherited it (and, newer, took the name over); a continue with its own `stop`
    dropped it. Neither may change which task a session is."""
    s = Sessions.of(tm)
    a = await s.chat(None, "a", "hello", FIELDS)
    await tm.wait(a.id)
    fork = await tm.fork(a.id, {"max_tokens": 1})
    await tm.wait(fork.id)
    await tm.wait((await tm.continue_(a.id, {"stop": ["x"], "max_tokens": 1})).id)
    assert fork.tag is None and [(n, t.id) for n, t in await Sessions(tm).listing(None)] == [("a", a.id)]


async def test_node_numbers_are_not_reused_and_gone_tasks_leave(tm):
    s = Sessions.of(tm)
    for idx in (0, 1):
        t, _ = await s.branch(None, "n", idx, "p", FIELDS)
        await tm.wait(t.id)
    assert await s.delete(None, "n:2", prefix=False)
    t, new = await s.branch(None, "n", 1, "p", FIELDS)
    assert new == 3  # lightning: one more than any node the session has had
    await tm.wait(t.id)
    await tm.delete(t.id)  # deleted through the task API
    with pytest.raises(SessionNotFound):
        await s.branch(None, "n", 3, "p", FIELDS)
    assert [name for name, _ in await s.listing(None)] == ["n:1"]


async def test_a_node_or_session_another_replica_made_meanwhile_is_never_made_twice(tmp_path):
    """Two servers on one database: b's read of the session raced a's write (b read before a
    committed). The database refuses b's second task of a name: b's branch takes the next node
    number, b's first /state call goes on with the session a made."""
    path = str(tmp_path / "r.db")
    a, b = (TaskManager(FakeEngine(), FakeTokenizer(), Settings(db=path, device="cpu", instance_name=n), FakeShape())
            for n in ("a", "b"))
    await a.start()
    await b.start()
    try:
        sa_, sb = Sessions(a), Sessions(b)
        await a.wait((await sa_.branch(None, "t", 0, "root", FIELDS))[0].id)
        real = sb._next_index
        stale = iter([1])  # b read the numbers before a's node 1 was there

        async def racing(*args):
            n = next(stale, None)
            return n if n is not None else await real(*args)

        sb._next_index = racing
        t, new = await sb.branch(None, "t", 0, "root too", FIELDS)
        assert new == 2 and t.tag == TAG + "t:2"
        await b.wait(t.id)
        s = await sa_.chat(None, "s", "hello", FIELDS)
        await a.wait(s.id)
        found, sb.find = sb.find, None

        async def missed_once(owner, name):  # b's first look missed the session a just made
            sb.find = found
            return None

        sb.find = missed_once
        again = await sb.chat(None, "s", "more", FIELDS)
        assert again.id == s.id
        await b.wait(s.id)
        names = [n for n, _ in await Sessions(a).listing(None)]
        assert sorted(names) == ["s", "t:1", "t:2"]
    finally:
        await a.close()
        await b.close()


async def test_a_deleted_sessions_task_is_marked(tm):
    s = Sessions.of(tm)
    a = await s.chat(None, "gone", "hello", {"max_tokens": 2})
    await tm.wait(a.id)
    assert not s.deleted(a)
    assert await s.delete(None, "gone", prefix=False)
    assert s.deleted(a)


async def test_a_node_too_long_to_name_is_not_made(tm):
    s = Sessions.of(tm)
    deep = "n" * (MAX_FULL_NAME - 2)  # room for ":<one digit>" only
    for _ in range(9):
        await tm.wait((await s.branch(None, deep, 0, "p", FIELDS))[0].id)
    with pytest.raises(NameTooLong):
        await s.branch(None, deep, 0, "p", FIELDS)  # node 10 would have a name of MAX_FULL_NAME + 1
