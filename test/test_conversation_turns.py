"""A client's next turn on a conversation, sent at once after the last one ended or was left, is
never refused as conversation_locked (one response at a time: server.api.responses.joins and
conversation): a streamed response whose client breaks off, a non-streamed one whose client
times out (each stopped: their runs settle at the next engine step, and are waited for), and a
background join whose write failed (the next reader joins it from the stored task). Real server
and the official SDK; the failed write at the task-manager level (scripted engine)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from task_fakes import FakeEngine, FakeShape, FakeTokenizer
from util_server import sdk, server_fixture

from server.api.responses import joins
from server.tasks import TaskConfig, TaskManager, TaskUnavailable

LONG = 200_000  # max_output_tokens no test waits for: only a stop ends such a run
ASK = {"model": "m", "temperature": 0}

server = server_fixture(env={"RWKV_API_KEYS": "k1"})


def roles(client, cid: str) -> list[str]:
    return [i.role for i in client.conversations.items.list(cid, order="asc", limit=100).data]


def test_a_stream_broken_off_then_the_next_turn_at_once(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    for _ in range(6):
        with client.responses.create(**ASK, input="y", conversation=conv.id, max_output_tokens=LONG,
                                     stream=True) as s:
            deltas = 0
            for ev in s:
                if ev.type == "response.created":
                    left = ev.response.id
                deltas += ev.type == "response.output_text.delta"
                if deltas == 3:
                    break
        nxt = client.responses.create(**ASK, input="next", conversation=conv.id, max_output_tokens=3)
        assert nxt.status in ("completed", "incomplete")
        assert client.responses.retrieve(left).status == "cancelled"  # joined nothing
    assert roles(client, conv.id) == ["user", "assistant"] * 6  # the next turns alone


def test_a_non_streamed_turn_timed_out_then_the_next_at_once(server):
    client, impatient = sdk(server, key="k1"), sdk(server, key="k1", timeout=1.0)
    conv = client.conversations.create()
    for _ in range(3):
        with pytest.raises(openai.APITimeoutError):
            impatient.with_options(max_retries=0).responses.create(**ASK, input="y", conversation=conv.id,
                                                                   max_output_tokens=LONG)
        nxt = client.responses.create(**ASK, input="next", conversation=conv.id, max_output_tokens=3)
        assert nxt.status in ("completed", "incomplete")
    assert roles(client, conv.id) == ["user", "assistant"] * 3


async def test_a_join_whose_write_failed_is_done_by_the_next_reader(tmp_path, monkeypatch):
    eng = FakeEngine(gate=asyncio.Event())
    tm = TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(tmp_path / "j.db"), default_max_tokens=3), FakeShape())
    await tm.start()
    try:
        conv = await tm.conversations.create(None, {}, [])
        t = await tm.create("a response", persistent=True, tag="response")
        run = await tm.conversations.begin_run(conv, t.id, t.version, tm.instance)
        joins.join_when_done(tm, conv.id, t, run)
        real = tm.conversations.finish_run
        failed = []

        async def fails_once(*a, **kw):
            if not failed:
                failed.append(1)
                await asyncio.sleep(0.3)  # (a write waiting on a lock: settle comes meanwhile)
                raise TaskUnavailable("the task database is unreachable; retry later")
            return await real(*a, **kw)

        monkeypatch.setattr(tm.conversations, "finish_run", fails_once)
        eng.gate.set()
        await tm.wait(t.id, timeout=10)
        c = await joins.settle(tm, conv.id, None)  # waits for the job, which fails; then joins itself
        assert failed and await tm.conversations.runs(conv.id) == []
        assert c.last_seq == 1 and c.head_task == t.id  # the response's message joined
    finally:
        await tm.close()
