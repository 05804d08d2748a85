"""How a Responses stream ends and how it is read again (real servers, the official SDKs):

- a stream the server's stop (SIGTERM) cuts ends the Responses way: `response.failed` with the
  response as it then reads (status failed, a server_error saying how to resume it), every event
  an OpenAI stream event with its `event:` line and contiguous sequence numbers, no [DONE]; the
  SDK's stream helper and the Agents SDK raise a clear error; a failing source ends with an
  `error` event;
- `GET /v1/responses/{id}?stream=true` streams a response's events numbered as its own stream
  numbered them: a finished one's replayed (with `starting_after`: those after it), a running
  one's on to its end, without stopping it when the reader leaves."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from util_server import async_sdk, running_server, sdk

# greedy, and an input whose greedy answer on the test model has no "\n\n" (the chat stop) in its
# first 2,000 tokens (test_responses_disconnect.py): the run cannot end by itself during a test
ASK = {"model": "m", "input": "y", "temperature": 0, "max_output_tokens": 200_000}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
TEXT = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time", "parameters": ZONE, "strict": True}]
EVENTS = TypeAdapter(ResponseStreamEvent)


def read_events(lines, on_event=None) -> list[dict]:
    """The events of an SSE body (its lines), each checked: an OpenAI Responses stream event whose
    `event:` line is its type; no [DONE]. on_event(i, event) after each."""
    events, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            assert line != "data: [DONE]", "a Responses stream has no [DONE]"
            ev = json.loads(line[6:])
            assert kind == ev.get("type"), (kind, ev)
            EVENTS.validate_python(ev)
            events.append(ev)
            kind = None
            if on_event is not None:
                on_event(len(events) - 1, ev)
    return events


def check_numbered(events: list[dict], first: int = 0) -> None:
    assert [e["sequence_number"] for e in events] == list(range(first, first + len(events)))


def stream_events(srv, method: str, path: str, on_event=None, **kw) -> list[dict]:
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream(method, path, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_events(r.iter_lines(), on_event)


def deltas(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


# --- the server's stop under a stream ----------------------------------------------------------------


def test_a_stream_the_shutdown_cuts_ends_with_response_failed_and_replays_alike(tmp_path):
    with running_server(tmp_path) as srv:
        def on_event(i: int, ev: dict) -> None:
            if i == 20:
                assert ev["type"] == "response.output_text.delta", ev  # mid-answer
                srv.proc.send_signal(15)  # SIGTERM: the stream goes on to its end

        events = stream_events(srv, "POST", "/v1/responses", on_event, json={**ASK, "stream": True})
        srv.proc.wait(30)
        check_numbered(events)
        last = events[-1]
        assert last["type"] == "response.failed", last
        failed = last["response"]
        assert failed["status"] == "failed" and failed["incomplete_details"] is None
        assert failed["error"]["code"] == "server_error" and "/continue" in failed["error"]["message"]
        (item,) = failed["output"]
        assert item["status"] == "incomplete" and item["content"][0]["text"] == deltas(events) != ""
        kinds = [e["type"] for e in events]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]
        srv.start()
        stored = httpx.get(f"{srv.url}/v1/responses/{failed['id']}").json()
        assert stored["status"] == "failed" and stored["output"] == failed["output"], stored
        # the stored response replays the stream as it was sent
        assert stream_events(srv, "GET", f"/v1/responses/{failed['id']}", params={"stream": "true"}) == events


def test_the_sdks_stream_helper_sees_the_failed_response(tmp_path):
    """The SDK parses every event (response.failed included); its helper's final response is
    then an error: there is no response.completed (as for OpenAI's own failed responses)."""
    with running_server(tmp_path) as srv, sdk(srv).responses.stream(**ASK) as s:
        seen = []
        for i, ev in enumerate(s):
            seen.append(ev)
            if i == 20:
                srv.proc.send_signal(15)
        srv.proc.wait(30)
        assert seen[-1].type == "response.failed" and seen[-1].response.error.code == "server_error"
        assert "the server stopped" in seen[-1].response.error.message
        with pytest.raises(RuntimeError, match="response.completed"):
            s.get_final_response()


async def test_the_agents_sdk_raises_a_clear_error(tmp_path):
    agents = pytest.importorskip("agents", reason="needs the openai-agents package (the test extra)")

    agents.set_tracing_disabled(True)
    with running_server(tmp_path) as srv:
        client = async_sdk(srv)
        model = agents.OpenAIResponsesModel(model="rwkv", openai_client=client)
        agent = agents.Agent(name="a", model=model,
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=200_000))
        run = agents.Runner.run_streamed(agent, "y")
        n = 0
        with pytest.raises(agents.exceptions.ModelBehaviorError) as ei:
            async for ev in run.stream_events():
                n += ev.type == "raw_response_event"
                if n == 20:
                    srv.proc.send_signal(15)
        await asyncio.to_thread(srv.proc.wait, 30)
    assert "response.failed" in str(ei.value) and "server_error" in str(ei.value), ei.value


async def test_a_failing_source_ends_with_an_error_event(monkeypatch):
    """The stream's own failure (a bug): an `error` event after the events sent, numbered next;
    the run is stopped. Chat and completions keep their error chunk and [DONE]
    (test_sse_response.py)."""
    from server.api.responses.stream import ResponseStream
    from server.api.streaming.sse import SSEResponse
    from server.tasks.output import Output
    from server.tasks.records import RUNNING, TASK, Task

    t = Task(id="TASK_" + "a" * 32, kind=TASK, params={"max_tokens": 50}, prompt="User: x\n\nAssistant:",
             out=Output(finished=False), status=RUNNING, tag="response")
    stopped: list[int] = []
    source = ResponseStream(t, "m", on_abort=lambda: stopped.append(1))
    calls, real = [], ResponseStream._plain

    def plain(self, data: str) -> bytes:
        calls.append(data)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return real(self, data)

    monkeypatch.setattr(ResponseStream, "_plain", plain)
    body: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def produce() -> None:
        for word in (" one", " two", " three"):
            await asyncio.sleep(0.02)
            t.out.append(word, 1)
            t.out.notify()

    response = SSEResponse(source, ping_interval=0, error_end=source.error_end)
    await asyncio.wait_for(asyncio.gather(response({"type": "http", "app": None}, receive, send), produce()), 5)
    events = read_events(b"".join(body).decode().split("\n"))
    check_numbered(events)
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1, "code": "internal_error",
                          "message": "internal error while streaming", "param": None}
    assert deltas(events) == "one" and stopped == [1]


# --- GET /v1/responses/{id}?stream=true ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("resp-streams")) as srv:
        yield srv


@pytest.mark.parametrize("body", [
    {"input": "Hello", "max_output_tokens": 12, "temperature": 1.0, "seed": 3},
    {"input": "Pick a number.", "text": TEXT, "max_output_tokens": 30},
    {"input": "What time is it?", "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 40},
    {"input": "What time is it?", "tools": TOOLS, "max_output_tokens": 40, "temperature": 1.0, "seed": 1},
], ids=["text", "format", "forced-call", "auto-tools"])
def test_a_finished_response_replays_its_stream(server, body):
    live = stream_events(server, "POST", "/v1/responses", json={"model": "m", **body, "stream": True})
    check_numbered(live)
    rid = live[0]["response"]["id"]
    path = f"/v1/responses/{rid}"
    assert stream_events(server, "GET", path, params={"stream": "true"}) == live
    for after in (0, 3, len(live) - 2, len(live) - 1, len(live) + 5):
        assert stream_events(server, "GET", path, params={"stream": "true", "starting_after": after}) \
            == live[after + 1:]  # fmt: skip
    client = sdk(server)
    typed = list(client.responses.retrieve(rid, stream=True))
    assert [e.model_dump(exclude_unset=True) for e in typed] == [EVENTS.validate_python(e).model_dump(
        exclude_unset=True) for e in live]  # fmt: skip
    with client.responses.stream(response_id=rid, starting_after=2) as s:  # (the helper skips them itself)
        assert [e.sequence_number for e in s] == list(range(3, len(live)))
        if live[-1]["type"] == "response.completed":
            assert s.get_final_response().output_text == client.responses.retrieve(rid).output_text


def test_a_bad_starting_after_is_a_400(server):
    rid = sdk(server).responses.create(model="m", input="x", max_output_tokens=2).id
    r = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    assert httpx.get(f"{server.url}/v1/responses/resp_{'0' * 32}", params={"stream": "true"}).status_code == 404


def test_a_running_response_streams_on_to_its_end(server):
    """A reader of a running response gets its events from its start (or after starting_after)
    and on to its end, numbered as the creating stream numbers them; a reader that leaves stops
    nothing (the run is its creating request's)."""
    client = sdk(server)
    live: list = []
    with client.responses.create(**{**ASK, "max_output_tokens": 300}, stream=True) as s:
        for ev in s:
            live.append(ev.model_dump(exclude_unset=True))
            if len(live) == 10:
                break
        rid = live[0]["response"]["id"]
        path = f"/v1/responses/{rid}"
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("GET", path, params={"stream": "true"}) as r:  # read a little, then leave
                read_events(line for _, line in zip(range(12), r.iter_lines(), strict=False))
            assert c.get(path).json()["status"] == "in_progress"
        resumed = stream_events(server, "GET", path, params={"stream": "true", "starting_after": 5})
        assert resumed[-1]["type"] == "response.incomplete"  # (the run went on to its max_output_tokens)
        live += [ev.model_dump(exclude_unset=True) for ev in s]
    assert [EVENTS.validate_python(e).model_dump(exclude_unset=True) for e in resumed] == live[6:]
    assert client.responses.retrieve(rid).status == "incomplete"


def test_a_response_deleted_while_streamed_ends_its_stream_incomplete_reading_cancelled(server):
    """DELETE of a response whose creating stream is being read stops its run: the stream ends
    with response.incomplete carrying the response as cancelled (OpenAI's stream has no event of
    its own for it; docs/agents.md), then the response is gone."""
    deleted: list = []

    def on_event(i: int, ev: dict) -> None:
        if ev["type"] == "response.output_text.delta" and not deleted:
            rid = ev["item_id"].replace("msg_", "resp_", 1)
            deleted.append(httpx.delete(f"{server.url}/v1/responses/{rid}", timeout=30))

    events = stream_events(server, "POST", "/v1/responses", on_event, json={**ASK, "stream": True})
    assert deleted and deleted[0].status_code == 200, deleted
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled", last
    assert last["response"]["incomplete_details"] is None
    check_numbered(events)
    assert httpx.get(f"{server.url}/v1/responses/{last['response']['id']}").status_code == 404


def test_without_stream_retrieve_is_json(server):
    r = sdk(server).responses.create(model="m", input="x", max_output_tokens=2)
    got = httpx.get(f"{server.url}/v1/responses/{r.id}", params={"stream": "false", "starting_after": 3})
    assert got.status_code == 200 and got.json()["id"] == r.id


def test_the_document_describes_the_responses_streams_as_they_are(server):
    """The OpenAPI document says what these streams are: typed events, no [DONE] (chat's say [DONE])."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path, method in (("/v1/responses", "post"), ("/v1/responses/{response_id}", "get")):
        assert "no [DONE]" in paths[path][method]["responses"]["200"]["description"]
    assert "[DONE]`" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["description"]
