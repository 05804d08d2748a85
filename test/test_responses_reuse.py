"""A stateless client's history reused (server.api.responses.reuse) against a real server with the
official SDK: a create that sends the whole history as input forks the earlier response whose
tokens it begins with (only the new turn is prefilled; the answer is the chain's, token for
token), stored or not; not another API key's, not one deleted, and not when the reply
re-tokenizes otherwise than it was generated (then the whole history is prefilled, as before).

The test model's greedy replies are random tokens: a reply whose first token has no leading
space re-renders with one after "Assistant:", so it never matches ("Hi" below); the two other
first turns re-render as generated."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest
from task_fakes import FakeEngine, FakeShape
from util_server import running_server, sdk, server_fixture

from server.api.metrics import parse_metrics
from server.api.responses import reuse
from server.api.responses.reuse import LOAD_NEWEST, Recent
from server.tasks import TaskConfig, TaskManager

GREEDY = {"model": "m", "temperature": 0, "max_output_tokens": 8}
MATCHES = ["Hello there.", "What is the time?"]
AFTER_COMPACTION = "Tell me more."  # (its reply, after the compaction, re-renders as generated)


server = server_fixture(env={"RWKV_API_KEYS": "k1,k2"})


def items(output) -> list[dict]:
    return [o.model_dump(exclude_none=True, warnings=False) for o in output]


def second_turn(client, first, text: str = "And then?", **fields):
    """The first response, then the next turn sent whole (its input, its output, a new message)."""
    r1 = client.responses.create(input=first, **GREEDY, **fields)
    history = [{"role": "user", "content": first}, *items(r1.output), {"role": "user", "content": text}]
    return r1, client.responses.create(input=history, **GREEDY, **fields)


@pytest.mark.parametrize("first", MATCHES)
@pytest.mark.parametrize("store", [True, False], ids=["stored", "not-stored"])
def test_the_whole_history_forks_the_earlier_response(server, first, store):
    client = sdk(server, key="k1")
    r1, r2 = second_turn(client, first, store=store)
    held = r1.usage.input_tokens + r1.usage.output_tokens  # (its last token is fed by the next run)
    assert r2.usage.input_tokens_details.cached_tokens == held - 1
    assert r2.previous_response_id is None  # (none was sent)
    if store:
        chain = client.responses.create(input="And then?", previous_response_id=r1.id, **GREEDY)
        assert r2.output_text == chain.output_text and r2.usage.input_tokens == chain.usage.input_tokens
        listed = client.responses.input_items.list(r2.id, order="asc").data
        assert [i.type for i in listed] == ["message", "message", "message"]  # the whole input, as sent


def test_a_reply_that_re_tokenizes_otherwise_is_prefilled_whole(server):
    client = sdk(server, key="k1")
    r1, r2 = second_turn(client, "Hi")
    assert r2.usage.input_tokens_details.cached_tokens == 0
    assert r2.status == "incomplete" and r2.output_text  # (answered, from the zero state)


def test_not_another_keys_response_nor_a_deleted_one(tmp_path):
    with running_server(tmp_path, env={"RWKV_API_KEYS": "k1,k2"}) as srv:  # (no other response of this history)
        _other_key_and_deleted(srv)


def _other_key_and_deleted(server):
    a, b = sdk(server, key="k1"), sdk(server, key="k2")
    r1 = a.responses.create(input=MATCHES[0], **GREEDY)
    history = [{"role": "user", "content": MATCHES[0]}, *items(r1.output), {"role": "user", "content": "Next."}]
    assert b.responses.create(input=history, **GREEDY).usage.input_tokens_details.cached_tokens == 0
    a.responses.delete(r1.id)
    assert a.responses.create(input=history, **GREEDY).usage.input_tokens_details.cached_tokens == 0


def test_a_chain_of_stateless_turns_prefills_each_turn_once(server):
    """Three turns sent whole: each forks the one before (its cached tokens: all of it)."""
    client = sdk(server, key="k1")
    history: list[dict] = []
    prev = None
    for text in (MATCHES[1], "And then?", "Go on."):
        history.append({"role": "user", "content": text})
        r = client.responses.create(input=history, **GREEDY)
        if prev is not None and r.usage.input_tokens_details.cached_tokens:
            assert r.usage.input_tokens_details.cached_tokens == prev.usage.input_tokens + prev.usage.output_tokens - 1
        history.extend(items(r.output))
        prev = r
    assert r.usage.input_tokens_details.cached_tokens > 0


def test_after_a_compaction_item_the_response_that_resumed_it_is_continued(server):
    """The items after a compaction item sent whole: the response that resumed the compaction
    with the same items is forked (the auto-compacting stateless client of context_management)."""
    client = sdk(server, key="k1")
    cp = client.responses.compact(model="m", input="Hello there.")
    history = [*items(cp.output)[1:], {"role": "user", "content": AFTER_COMPACTION}]  # (the compaction item, then)
    r1 = client.responses.create(input=history, **GREEDY)
    history += [*items(r1.output), {"role": "user", "content": "And then?"}]
    r2 = client.responses.create(input=history, **GREEDY)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    chain = client.responses.create(input="And then?", previous_response_id=r1.id, **GREEDY)
    assert r2.output_text == chain.output_text and r2.previous_response_id is None


def prefilled(server) -> float:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)["rwkv_prompt_tokens_total"]


def test_a_compaction_of_a_history_sent_whole_forks_the_response_it_extends(server):
    """context_management past its threshold on a history sent whole: the compaction forks the
    earlier response the history begins with (only the new turn is prefilled), and the answer is
    the chain's."""
    client = sdk(server, key="k1")
    r1 = client.responses.create(input=MATCHES[1], **GREEDY)
    history = [{"role": "user", "content": MATCHES[1]}, *items(r1.output), {"role": "user", "content": "More?"}]
    before = prefilled(server)
    r2 = client.responses.create(input=history, context_management=[{"type": "compaction", "compact_threshold": 5}],
                                 **GREEDY)  # fmt: skip
    fed = prefilled(server) - before
    assert [o.type for o in r2.output][0] == "compaction"
    held = r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert fed <= r2.usage.input_tokens - held + 1  # the new turn (and the pending token), not the history
    chain = client.responses.create(input="More?", previous_response_id=r1.id, **GREEDY)
    assert r2.output_text == chain.output_text and r2.usage.input_tokens == chain.usage.input_tokens


class ByteTokenizer:
    """One token a byte (so any cut between bytes is a token boundary)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def decode_bytes(self, ids) -> bytes:
        return bytes(ids)


async def _responses(tm: TaskManager, texts: list[str], owner: str | None = None) -> list[str]:
    """Stored responses that took in `texts` and generated nothing (ended), their ids in order."""
    ids = []
    for text in texts:
        made = await tm.create(text, {"max_tokens": 0}, persistent=True, owner=owner, tag="response")
        ids.append((await tm.wait(made.id, timeout=10)).id)
    return ids


def _turn(i: int) -> str:
    return f"User: conversation {i}\n\nAssistant:"


@pytest.fixture
async def tm(tmp_path):
    tm = TaskManager(FakeEngine(), ByteTokenizer(), TaskConfig(db=str(tmp_path / "r.db")), FakeShape())
    await tm.start()
    yield tm
    await tm.close()


async def _out_of_memory(tm: TaskManager, task_id: str) -> None:
    """As on a busy server: other tasks pushed it out of the task table."""
    for _ in range(100):  # (its writes done, it leaves the live tasks)
        if task_id not in tm.table.live:
            break
        await asyncio.sleep(0.05)
    tm.table.recent.clear()
    assert tm.table.find(task_id) is None


NEXT = " yes\n\nUser: more\n\nAssistant:"


async def test_a_key_with_many_conversations_finds_each_ones_response(tm):
    """One API key for all of an application's users: its conversations' turns interleave, and
    each turn sent whole forks its own conversation's previous response, not the newest ones'."""
    recent = Recent()
    ids = await _responses(tm, [_turn(i) for i in range(200)], owner="app")
    for tid in ids:
        recent.add("app", tid)
    for i in (0, 57, 199):
        found = await recent.find(tm, tm.inputs.tokenizer, "app", None, _turn(i) + NEXT)
        assert found is not None and found.task.id == ids[i] and found.rest == NEXT
    assert await recent.find(tm, tm.inputs.tokenizer, "other", None, _turn(3) + NEXT) is None  # (another key's)
    assert await recent.find(tm, tm.inputs.tokenizer, "app", None, _turn(200) + NEXT) is None


async def test_the_longest_history_is_forked_and_bounds_forget_the_oldest(tm, monkeypatch):
    monkeypatch.setattr(reuse, "MAX_PER_KEY", 3)
    monkeypatch.setattr(reuse, "MAX_ENTRIES", 5)
    recent, tok = Recent(), tm.inputs.tokenizer
    a, ab, c, d = await _responses(tm, [_turn(0), _turn(0) + NEXT, _turn(2), _turn(3)], owner="k1")
    for tid in (a, ab, c, d):  # (k1: a pushed out by the fourth)
        recent.add("k1", tid)
    found = await recent.find(tm, tok, "k1", None, _turn(0) + NEXT + " again\n\nUser: x\n\nAssistant:")
    assert found is not None and found.task.id == ab  # (not a: the longest)
    assert await recent.find(tm, tok, "k1", None, _turn(0) + " no\n\nUser: y\n\nAssistant:") is None  # (a: forgotten)
    others = await _responses(tm, [_turn(4), _turn(5), _turn(6)], owner="k2")
    for tid in others:  # (5 in all: k1, the least recently used, gives its oldest one)
        recent.add("k2", tid)
    assert await recent.find(tm, tok, "k1", None, _turn(0) + NEXT + " b\n\nUser: z\n\nAssistant:") is None
    found = await recent.find(tm, tok, "k1", None, _turn(3) + NEXT)
    assert found is not None and found.task.id == d
    assert await recent.find(tm, tok, "k0", None, _turn(4) + NEXT) is None  # (a key with nothing)
    recent.add("k2", others[-1])
    recent.add("k1", d)  # (k0, empty, is now the least recently used key)
    (e,) = await _responses(tm, [_turn(7)], owner="k1")
    recent.add("k1", e)  # (past the bound again: k0 goes, then k2's oldest)
    found = await recent.find(tm, tok, "k1", None, _turn(7) + NEXT)
    assert found is not None and found.task.id == e
    assert await recent.find(tm, tok, "k2", None, _turn(4) + NEXT) is None


async def test_an_indexed_response_is_read_back_once_out_of_memory(tm):
    """A busy server's task table pushes a client's previous response out before its next turn:
    once indexed (the key's first lookup after it ended), it is read back when its digest
    matches, however many responses came after it."""
    recent, tok = Recent(), tm.inputs.tokenizer
    (tid,) = await _responses(tm, [_turn(0)])
    recent.add(None, tid)
    assert await recent.find(tm, tok, None, None, _turn(9) + NEXT) is None  # (indexes it)
    for other in await _responses(tm, [_turn(i) for i in range(1, 6)]):
        recent.add(None, other)
    await _out_of_memory(tm, tid)
    found = await recent.find(tm, tok, None, None, _turn(0) + NEXT)
    assert found is not None and found.task.id == tid and found.rest == NEXT


async def test_the_newest_responses_are_read_back_once_out_of_memory(tm):
    """One that left memory before any lookup indexed it: the key's newest (reuse.LOAD_NEWEST)
    are read back from the database; older ones are not looked for."""
    recent, tok = Recent(), tm.inputs.tokenizer
    (tid,) = await _responses(tm, ["User: hi\n\nAssistant:"])
    await _out_of_memory(tm, tid)
    text = "User: hi\n\nAssistant: yes\n\nUser: more\n\nAssistant:"
    recent.add(None, tid)
    found = await recent.find(tm, tok, None, None, text)
    assert found is not None and found.task.id == tid and found.rest == NEXT
    await _out_of_memory(tm, tid)  # (the read back put it in the table again)
    older = Recent()
    older.add(None, tid)
    for other in range(LOAD_NEWEST):
        older.add(None, f"TASK_{other:032x}")  # (newer responses, gone)
    assert await older.find(tm, tok, None, None, text) is None


async def test_after_a_restart_any_recent_response_is_found_by_its_stored_digest(tmp_path):
    """After a restart a key's responses are indexed from their rows' digests (tasks.digest),
    not only its LOAD_NEWEST newest read back: the oldest of many is forked, another key's is
    not, and a row whose digest is not its tokens' (here: another row's) is checked against its
    tokens before anything forks it."""
    db = str(tmp_path / "r.db")
    first = TaskManager(FakeEngine(), ByteTokenizer(), TaskConfig(db=db), FakeShape())
    await first.start()
    ids = await _responses(first, [_turn(i) for i in range(LOAD_NEWEST + 6)], owner="app")
    (other,) = await _responses(first, [_turn(90)], owner="k2")
    await first.close()
    with sqlite3.connect(db) as conn:  # (ids[3]'s row claims ids[1]'s history: indexed after it, it wins)
        conn.execute("UPDATE tasks SET digest = (SELECT digest FROM tasks WHERE id = ?) WHERE id = ?", (ids[1], ids[3]))
    tm = TaskManager(FakeEngine(), ByteTokenizer(), TaskConfig(db=db), FakeShape())
    await tm.start()
    try:
        assert [row[0] for row in await tm.digests("app", "response", 100)] == ids[::-1]
        recent, tok = Recent(), tm.inputs.tokenizer
        found = await recent.find(tm, tok, "app", None, _turn(0) + NEXT)
        assert found is not None and found.task.id == ids[0] and found.rest == NEXT
        assert await recent.find(tm, tok, "app", None, _turn(90) + NEXT) is None  # (k2's)
        found = await Recent().find(tm, tok, "k2", None, _turn(90) + NEXT)
        assert found is not None and found.task.id == other
        assert await recent.find(tm, tok, "app", None, _turn(1) + NEXT) is None  # (not ids[3])
    finally:
        await tm.close()


def test_after_a_restart_the_newest_response_is_read_back(tmp_path):
    with running_server(tmp_path) as srv:
        r1 = sdk(srv).responses.create(input=MATCHES[0], **GREEDY)
        history = [{"role": "user", "content": MATCHES[0]}, *items(r1.output), {"role": "user", "content": "And?"}]
        srv.restart()
        r2 = sdk(srv).responses.create(input=history, **GREEDY)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1


def test_prefix_digests_are_each_prefixs_sha256():
    """One incremental pass gives what hashing each prefix alone gives (seed first)."""
    import hashlib
    from array import array

    from server.tasks.token_digest import prefix_digests

    tokens = [5, 70000, 0, 3, 65535, 9]
    got = prefix_digests(tokens, [4, 1, 6, 0], b"part\0")
    assert list(got) == [0, 1, 4, 6]
    for n, d in got.items():
        assert d == hashlib.sha256(b"part\0" + array("i", tokens[:n]).tobytes()).digest()
    # a whole history's (tasks.digest): a Task's array hashed in place, any sequence alike
    from server.tasks.token_digest import history_digest

    assert history_digest(array("i", tokens)) == history_digest(tokens) == prefix_digests(tokens, [6])[6]
