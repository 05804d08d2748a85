"""Background responses (`background: true`) against a real server, with the official SDK: the
create answers at once while the run goes on; a streamed one's client may leave and resume; only
a background response can be cancelled (a second cancel, or one after the end, answers it as it
stands); store: false is refused; in a conversation its items join when it ends; a kill keeps what
it had generated (docs/agents.md, "Background responses")."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from util_server import running_server, sdk, wait_committed

LONG = 200_000  # max_output_tokens no test waits for: only a cancel (or the server's stop) ends it
# greedy, on an input whose answer on the test model has no "\n\n" (the chat stop) for long
ASK = {"model": "m", "input": "y", "temperature": 0, "max_output_tokens": LONG}
KEY = {"Authorization": "Bearer k1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("resp-bg"), env={"RWKV_API_KEYS": "k1,k2"}) as srv:
        yield srv


def running(server) -> int:
    return httpx.get(server.url + "/health").json()["running"]


def until(what, cond, timeout: float = 20.0):
    """what() once cond(it) holds (polled)."""
    deadline = time.monotonic() + timeout
    while not cond(got := what()):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got


def task_ids(server, key: str = "k1") -> list[str]:
    r = httpx.get(server.url + "/v1/tasks/list", headers={"Authorization": f"Bearer {key}"})
    return sorted(t["task_id"] for t in r.json()["tasks"])


def test_the_create_answers_at_once_and_the_run_goes_on_until_cancelled(server):
    client = sdk(server, key="k1", timeout=10)  # (a create that waited for LONG tokens would time out)
    until(lambda: running(server), lambda n: n == 0)
    r = client.responses.create(**ASK, background=True)
    assert r.status == "in_progress" and r.background is True and r.usage is None and r.output == []
    assert running(server) == 1
    first = until(lambda: client.responses.retrieve(r.id), lambda x: len(x.output_text) > 0)
    later = until(lambda: client.responses.retrieve(r.id), lambda x: len(x.output_text) > len(first.output_text))
    assert later.status == "in_progress" and later.output_text.startswith(first.output_text)
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled" and c.background is True and c.id == r.id
    assert c.output_text.startswith(later.output_text) and 0 < c.usage.output_tokens < LONG
    until(lambda: running(server), lambda n: n == 0, timeout=5)
    again = client.responses.cancel(r.id)  # ended: answered as it stands
    assert (again.status, again.output_text, again.usage.output_tokens) == ("cancelled", c.output_text,
                                                                            c.usage.output_tokens)
    got = client.responses.retrieve(r.id)
    assert got.status == "cancelled" and got.output_text == c.output_text and got.background is True


def test_one_that_ends_by_itself_is_read_back_and_a_cancel_changes_nothing(server):
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="y", temperature=0, max_output_tokens=12, background=True)
    assert r.background is True
    done = until(lambda: client.responses.retrieve(r.id), lambda x: x.status != "in_progress")
    assert done.status == "incomplete" and done.usage.output_tokens == 12 and done.output_text
    c = client.responses.cancel(r.id)
    assert (c.status, c.output_text, c.usage.output_tokens) == ("incomplete", done.output_text, 12)
    fg = client.responses.create(model="m", input="y", temperature=0, max_output_tokens=12)
    assert fg.background is False and fg.output_text == done.output_text  # the same run, only not tied


def test_a_streamed_one_runs_on_when_its_client_leaves_and_can_be_resumed(server):
    client = sdk(server, key="k1")
    until(lambda: running(server), lambda n: n == 0)
    read = ""
    with client.responses.create(**ASK, background=True, stream=True) as s:
        for ev in s:
            if ev.type == "response.created":
                rid = ev.response.id
                assert ev.response.background is True
            read += getattr(ev, "delta", "") if ev.type == "response.output_text.delta" else ""
            last = ev.sequence_number
            if ev.sequence_number == 20:
                break
    # the client is gone and the output grows past what it read: the run went on without it
    on = until(lambda: client.responses.retrieve(rid), lambda x: len(x.output_text) > len(read) + 20)
    assert on.status == "in_progress" and on.output_text.startswith(read)
    rest = httpx.Client(headers=KEY, timeout=30)
    with rest.stream("GET", f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": last}) as g:
        data = (json.loads(line[6:]) for line in g.iter_lines() if line.startswith("data: "))
        assert next(data)["sequence_number"] == last + 1  # the stream goes on after the event read last
        client.responses.cancel(rid)
        rest_events = list(data)
    end = rest_events[-1]
    assert end["type"] == "response.incomplete" and end["response"]["status"] == "cancelled", end
    assert [e["sequence_number"] for e in rest_events] == list(range(last + 2, end["sequence_number"] + 1))
    assert client.responses.retrieve(rid).status == "cancelled"


def test_only_a_background_response_can_be_cancelled_and_only_by_its_key(server):
    client, other = sdk(server, key="k1"), sdk(server, key="k2")
    until(lambda: running(server), lambda n: n == 0)
    with client.responses.create(**ASK, stream=True) as fg:  # a foreground response, running
        rid = next(iter(fg)).response.id
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.cancel(rid)
        assert (e.value.code, e.value.param) == ("invalid_request", "response_id")
        assert "background: true" in e.value.message
        assert [ev.type for _, ev in zip(range(20), fg)][-1] == "response.output_text.delta"  # it runs on
        assert client.responses.retrieve(rid).status == "in_progress"
    until(lambda: running(server), lambda n: n == 0)  # (stopped by its client leaving, as any foreground one)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 32)
    bg = client.responses.create(**ASK, background=True)
    with pytest.raises(openai.NotFoundError):  # another key's: not found, and it runs on
        other.responses.cancel(bg.id)
    assert client.responses.retrieve(bg.id).status == "in_progress"
    assert client.responses.cancel(bg.id).status == "cancelled"


def test_background_without_store_is_refused_and_creates_nothing(server):
    before, prompts = task_ids(server), running(server)
    r = httpx.post(server.url + "/v1/responses", headers=KEY, json={**ASK, "background": True, "store": False})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("background", "invalid_request") and "store" in err["message"]
    assert task_ids(server) == before and running(server) == prompts
    with pytest.raises(openai.BadRequestError):
        sdk(server, key="k1").responses.create(**ASK, background=True, store=False, stream=True)
    assert task_ids(server) == before


def test_in_a_conversation_its_items_join_when_it_ends(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    r = client.responses.create(model="m", input="Hello there", max_output_tokens=6, conversation=conv.id,
                                background=True)
    done = until(lambda: client.responses.retrieve(r.id), lambda x: x.status != "in_progress")
    items = until(lambda: client.conversations.items.list(conv.id, order="asc").data, lambda d: len(d) == 2)
    assert items[0].role == "user" and items[1].role == "assistant"
    assert items[1].content[0].text == done.output_text


def test_one_response_at_a_time_on_a_conversation(server):
    """While a response runs on a conversation another is a 400 conversation_locked (OpenAI's),
    naming `conversation`, nothing created; counting its tokens still answers. Two sent at once:
    one runs, one is refused (the run is recorded with the conversation's row locked)."""
    client = sdk(server, key="k1")
    until(lambda: running(server), lambda n: n == 0)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    first = client.responses.create(**ASK, conversation=conv.id, background=True)
    before, items = task_ids(server), client.conversations.items.list(conv.id).data
    for extra in ({}, {"background": True}, {"stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", input="and?", max_output_tokens=3, conversation=conv.id, **extra)
        assert (e.value.code, e.value.param) == ("conversation_locked", "conversation")
        assert first.id in e.value.message
    assert task_ids(server) == before and client.conversations.items.list(conv.id).data == items
    assert running(server) == 1
    assert client.responses.input_tokens.count(model="m", conversation=conv.id, input="and?").input_tokens > 0
    client.responses.cancel(first.id)  # cancelled: joins nothing, and the conversation is free
    both = []

    def ask() -> None:
        both.append(httpx.post(server.url + "/v1/responses", headers=KEY, timeout=30,
                               json={**ASK, "conversation": conv.id, "background": True}))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(r.status_code for r in both) == [200, 400], [r.text for r in both]
    refused = next(r for r in both if r.status_code == 400).json()["error"]
    assert refused["code"] == "conversation_locked"
    assert len(task_ids(server)) == len(before) + 1 and running(server) == 1
    client.responses.cancel(next(r for r in both if r.status_code == 200).json()["id"])


def test_a_kill_keeps_what_it_generated_and_frees_its_conversation(server):
    client = sdk(server, key="k1")
    until(lambda: running(server), lambda n: n == 0)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    r = client.responses.create(**ASK, background=True, conversation=conv.id)
    wait_committed(server.db, "TASK_" + r.id[5:])  # a progress row with output (about one a second)
    server.restart(hard=True)
    client = sdk(server, key="k1")
    got = until(lambda: client.responses.retrieve(r.id), lambda x: x.status != "in_progress")
    assert got.status == "failed" and got.background is True and got.usage.output_tokens > 0 and got.output_text
    assert f"/v1/tasks/TASK_{r.id[5:]}/continue" in got.error.message
    assert client.responses.cancel(r.id).status == "failed"  # ended: as it stands
    # the failed run joined nothing, and holds the conversation no longer
    after = client.responses.create(model="m", input="again", max_output_tokens=3, conversation=conv.id)
    assert after.status in ("completed", "incomplete")
    assert [i.role for i in client.conversations.items.list(conv.id, order="asc").data] == ["user", "user",
                                                                                            "assistant"]


def test_a_streamed_one_ends_with_the_shutdown_as_a_foreground_stream_does(server):
    """The shutdown interrupts its run at once, so its stream ends with response.failed (the
    response as GET then shows it), not after a wait with a shutting_down error event."""
    until(lambda: running(server), lambda n: n == 0)
    events: list[dict] = []

    def read() -> None:
        with httpx.Client(headers=KEY, timeout=60) as c, c.stream(
            "POST", server.url + "/v1/responses", json={**ASK, "background": True, "stream": True}
        ) as s:
            events.extend(json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: "))

    th = threading.Thread(target=read)
    th.start()
    until(lambda: len(events), lambda n: n >= 10)
    server.stop()
    th.join(10)
    assert not th.is_alive()
    end = events[-1]
    assert end["type"] == "response.failed" and end["response"]["status"] == "failed", end
    assert "/continue" in end["response"]["error"]["message"]
    server.start()
    got = sdk(server, key="k1").responses.retrieve(end["response"]["id"])
    assert got.status == "failed" and got.output_text == end["response"]["output"][0]["content"][0]["text"]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("resp-bg-1"), env={"RWKV_MAX_BATCH": "1"}) as srv:
        yield srv


def test_one_waiting_for_a_slot_is_queued(one_slot):
    """OpenAI's `queued`: a response whose run waits behind a full engine (here: one slot) reads
    queued on its create and GET, in_progress once it runs; a queued one can be cancelled."""
    client = sdk(one_slot, timeout=10)
    a = client.responses.create(**ASK, background=True)
    until(lambda: client.responses.retrieve(a.id), lambda x: len(x.output_text) > 0)  # a holds the slot
    b = client.responses.create(**ASK, background=True)
    got = client.responses.retrieve(b.id)
    assert b.status == got.status == "queued" and b.output == got.output == []  # (no message yet)
    c = client.responses.create(**ASK, background=True)
    cancelled = client.responses.cancel(c.id)  # (never ran)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens == 0
    assert client.responses.retrieve(a.id).status == "in_progress"
    client.responses.cancel(a.id)
    runs = until(lambda: client.responses.retrieve(b.id), lambda x: len(x.output_text) > 0)
    assert runs.status == "in_progress" and runs.output[0].status == "in_progress"
    assert client.responses.cancel(b.id).status == "cancelled"


def test_a_run_given_its_slot_is_no_longer_queued():
    """READY (its run waits for a slot) shows PREFILL once the engine admitted the run: a response
    reads in_progress while its prompt is fed (it read queued through a long prefill after a wait,
    until its first token)."""
    from types import SimpleNamespace

    from server.api.responses import render
    from server.engine.types import SamplingParams
    from server.tasks.records import PREFILL, READY, Run, Task

    t = Task(id="TASK_" + "0" * 32, kind="task", status=READY)
    t.run = Run(pos=0, n_input=9, params=SamplingParams(), key=None, handle=SimpleNamespace(admitted=False))
    assert render.status(t) == "queued" and t.info()["status"] == READY
    t.run.handle.admitted = True
    assert render.status(t) == "in_progress" and t.info()["status"] == PREFILL and t.phase() == PREFILL


def test_a_response_read_as_its_run_is_admitted_is_consistent():
    """The engine may admit a run between two reads of its status: a response reads its status
    once (it showed queued with an in-progress message)."""
    from server.api.responses import render
    from server.engine.types import SamplingParams
    from server.tasks.records import READY, Run, Task

    class AdmittedOnSecondRead:
        reads = 0

        @property
        def admitted(self) -> bool:
            self.reads += 1
            return self.reads > 1

    t = Task(id="TASK_" + "1" * 32, kind="task", status=READY)
    t.run = Run(pos=0, n_input=9, params=SamplingParams(), key=None, handle=AdmittedOnSecondRead())
    body = render.response(t, "m")
    assert (body["status"], body["output"]) == ("queued", [])
    assert render.response(t, "m")["status"] == "in_progress"  # (admitted by now)
