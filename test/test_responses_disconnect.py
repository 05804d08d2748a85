"""/v1/responses is tied to its request: a client that leaves before the answer's end (streamed
or not) stops the run at once, store: false or true; a stored one stays readable ("cancelled",
with what was generated) and can be continued. Real server, the official SDK."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from util_server import running_server, sdk

LONG = 200_000  # max_output_tokens no test waits for: only an abort ends such a run
# greedy, and an input whose greedy answer on the test model has no "\n\n" (the chat stop) in its
# first 2,000 tokens: the run cannot end by itself while a test looks at it
ASK = {"model": "m", "input": "y", "temperature": 0, "max_output_tokens": LONG}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("resp-disc")) as srv:
        yield srv


def running(server) -> int:
    return httpx.get(server.url + "/health").json()["running"]


def wait_running(server, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while running(server) != n:
        assert time.monotonic() < deadline, f"/health running != {n} after {timeout}s\n{server.log_tail()}"
        time.sleep(0.05)


def settled(server, rid: str, timeout: float = 10):
    """The response once its run has settled: /health counts a slot free as soon as the engine
    ends the sequence, a moment before the task layer has its result (a loaded CI machine
    read "in_progress" in between)."""
    deadline = time.monotonic() + timeout
    while (r := sdk(server).responses.retrieve(rid)).status == "in_progress":
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def newest_response_id(server) -> str:
    """The id of the newest stored task, as a response id (a non-streamed answer that never came)."""
    t = httpx.get(server.url + "/v1/tasks/list", params={"kind": "task", "limit": 1}).json()["tasks"][0]
    return "resp_" + t["task_id"].split("_", 1)[1]


def stream_then_leave(server, store: bool) -> tuple[str, int]:
    """Stream a long response, read 20 events, check it still runs, close the connection; its id
    and the text deltas read (each holds at least one token)."""
    client = sdk(server)
    deltas = 0
    with client.responses.create(**ASK, stream=True, store=store) as s:
        for i, ev in enumerate(s):
            if i == 0:
                rid = ev.response.id
            deltas += ev.type == "response.output_text.delta"
            if i == 20:
                break
        assert ev.type == "response.output_text.delta", ev  # mid-answer
        assert running(server) == 1
    return rid, deltas


def ask_then_leave(server, store: bool) -> None:
    """A non-streamed long response whose client gives up (timeout) while it runs."""
    gone = threading.Event()

    def ask() -> None:
        with pytest.raises(openai.APITimeoutError):
            sdk(server, timeout=3).responses.create(**ASK, store=store)
        gone.set()

    th = threading.Thread(target=ask)
    th.start()
    wait_running(server, 1)  # it started ...
    assert not gone.is_set()
    th.join(30)
    assert gone.is_set()  # ... and its client left while it ran


@pytest.mark.parametrize("store", [False, True])
def test_a_stream_whose_client_leaves_is_stopped(server, store):
    wait_running(server, 0)
    rid, deltas = stream_then_leave(server, store)
    wait_running(server, 0, timeout=5)  # stopped, not burning the slot up to max_output_tokens
    if store:  # readable: cancelled, with what was generated (at least what the client read)
        r = settled(server, rid)
        assert r.status == "cancelled" and r.incomplete_details is None
        assert deltas >= 10 and deltas <= r.usage.output_tokens < LONG and r.output_text, (deltas, r.usage)


@pytest.mark.parametrize("store", [False, True])
def test_a_non_streamed_response_whose_client_leaves_is_stopped(server, store):
    wait_running(server, 0)
    before = newest_response_id(server) if store else None
    ask_then_leave(server, store)
    wait_running(server, 0, timeout=5)
    if store:
        rid = newest_response_id(server)
        assert rid != before
        r = settled(server, rid)
        assert r.status == "cancelled" and 0 < r.usage.output_tokens < LONG


def test_a_cancelled_response_can_be_continued(server):
    wait_running(server, 0)
    rid, _ = stream_then_leave(server, True)
    client = sdk(server)
    deadline = time.monotonic() + 5
    while (prev := client.responses.retrieve(rid)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = client.responses.create(model="m", input="go on", previous_response_id=rid, max_output_tokens=4)
    assert r.previous_response_id == rid and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens
    assert running(server) == 0


def test_a_response_that_ends_is_not_stopped_by_its_client_leaving(server):
    """Reading the whole stream (the last event) then closing is a completed stream, not an abort."""
    client = sdk(server)
    events = list(client.responses.create(model="m", input="x", max_output_tokens=6, stream=True))
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and final.status != "cancelled"
    assert client.responses.retrieve(final.id).status == final.status
