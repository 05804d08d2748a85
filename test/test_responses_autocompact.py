"""Server-side compaction in a create (`context_management`, OpenAI's) against a real server with
the official SDK: past its threshold a create compacts the history first and its output starts
with the compaction item (streamed first, read back alike), the answer and its usage are those of
the same create without it, the item resumes the history for a client that chains by input (and
drops what came before it), a chain compacts again only once its window since the last compaction
is past the threshold, bad entries change nothing, a client that leaves during the compaction
leaves nothing behind, and the Agents SDK's ModelSettings.context_management runs on it."""

from __future__ import annotations

import time
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel
from test_responses_compact import leave_during_the_prefill
from test_responses_streams import check_numbered, read_events
from util_server import async_sdk, sdk, server_fixture, task_ids

GREEDY = {"model": "m", "max_output_tokens": 8, "temperature": 0}
LONG = "lorem ipsum dolor sit amet " * 12  # (~60 tokens: past the thresholds below)


def cm(threshold: int | None) -> list[dict]:
    return [{"type": "compaction", **({} if threshold is None else {"compact_threshold": threshold})}]


server = server_fixture(env={"RWKV_API_KEYS": "k1"})
tasks = task_ids


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer k1"}, timeout=60)


def dumped(output) -> list[dict]:
    """Output items as the next request's input items (as clients append them)."""
    return [o.model_dump(exclude_none=True, warnings=False) for o in output]


def test_past_the_threshold_the_output_starts_with_a_compaction_and_the_answer_is_the_same(server):
    client = sdk(server, key="k1")
    r1 = client.responses.create(input=LONG, **GREEDY)
    plain = client.responses.create(input="And again.", previous_response_id=r1.id, **GREEDY)
    cut = client.responses.create(input="And again.", previous_response_id=r1.id, context_management=cm(20),
                                  **GREEDY)  # fmt: skip
    assert [o.type for o in cut.output] == ["compaction", "message"]
    item = cut.output[0]
    assert item.encrypted_content.startswith("cmp_") and item.id == item.encrypted_content
    assert cut.output_text == plain.output_text
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == (plain.usage.input_tokens, plain.usage.output_tokens)
    cached = cut.usage.input_tokens_details.cached_tokens  # (the compaction's last token and "Assistant:" fed after)
    assert cached > plain.usage.input_tokens_details.cached_tokens and cut.usage.input_tokens - cached <= 5
    assert cut.previous_response_id == r1.id  # (it forked its compaction: the request's is shown)
    assert dumped(client.responses.retrieve(cut.id).output) == dumped(cut.output)
    assert [i.content[0].text for i in client.responses.input_items.list(cut.id).data] == ["And again."]
    # the chain goes on from the response as from the one without a compaction
    a = client.responses.create(input="Third.", previous_response_id=cut.id, **GREEDY)
    b = client.responses.create(input="Third.", previous_response_id=plain.id, **GREEDY)
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens


def test_under_the_threshold_nothing_is_compacted(server):
    client = sdk(server, key="k1")
    before = len(tasks(server))
    r = client.responses.create(input="Hi.", context_management=cm(10_000), **GREEDY)
    assert [o.type for o in r.output] == ["message"]
    assert len(tasks(server)) == before + 1  # the response alone
    r = client.responses.create(input="Hi.", context_management=cm(None), **GREEDY)  # max_prompt_tokens
    assert [o.type for o in r.output] == ["message"]


def test_a_client_chaining_by_input_resumes_the_compaction_and_may_drop_what_came_before(server):
    client = sdk(server, key="k1")
    first = [{"role": "user", "content": LONG}]
    r1 = client.responses.create(input=first, context_management=cm(20), **GREEDY)
    assert [o.type for o in r1.output] == ["compaction", "message"]
    nxt = {"role": "user", "content": "Go on."}
    kept = client.responses.create(input=[*first, *dumped(r1.output), nxt], **GREEDY)
    dropped = client.responses.create(input=[*dumped(r1.output), nxt], **GREEDY)
    whole = client.responses.create(input=[*first, *dumped(r1.output)[1:], nxt], **GREEDY)  # (no compaction)
    assert kept.output_text == dropped.output_text == whole.output_text
    assert kept.usage.input_tokens == dropped.usage.input_tokens == whole.usage.input_tokens
    assert dropped.usage.input_tokens_details.cached_tokens > len(LONG.split())  # forked, not prefilled again


def test_a_chain_compacts_again_only_past_the_threshold_since_its_last_compaction(server):
    client = sdk(server, key="k1")
    kinds = []
    prev = None
    for text in (LONG, "Short.", "Short.", LONG):
        r = client.responses.create(input=text, previous_response_id=prev, context_management=cm(40), **GREEDY)
        kinds.append(r.output[0].type)
        prev = r.id
    assert kinds == ["compaction", "message", "message", "compaction"]


def test_the_stream_sends_the_compaction_first_and_replays_alike(server):
    body = {"input": LONG, "stream": True, "context_management": cm(20), **GREEDY}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json=body, headers={"Authorization": "Bearer k1"}) as r:
            assert r.status_code == 200, r.read()
            events = read_events(r.iter_lines())
        rid = events[0]["response"]["id"]
        with c.stream("GET", f"/v1/responses/{rid}?stream=true", headers={"Authorization": "Bearer k1"}) as r:
            replay = read_events(r.iter_lines())
    check_numbered(events)
    assert replay == events
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds[:5] == [("response.created", None), ("response.in_progress", None),
                         ("response.output_item.added", 0), ("response.output_item.done", 0),
                         ("response.output_item.added", 1)]  # fmt: skip
    assert events[2]["item"]["type"] == "compaction" and events[4]["item"]["type"] == "message"
    assert {i for t, i in kinds[4:-1]} == {1}  # every event of the message at output index 1
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" or final["status"] == "incomplete"
    assert final["output"][0] == events[3]["item"]


def test_with_tools_the_answer_is_the_same(server):
    tools = [{"type": "function", "name": "clock", "description": "The time", "strict": True,
              "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]  # fmt: skip
    client = sdk(server, key="k1")
    for choice in ("auto", "required"):
        ask = {"input": LONG, "tools": tools, "tool_choice": choice, **GREEDY, "max_output_tokens": 32}
        plain = client.responses.create(**ask)
        cut = client.responses.create(**ask, context_management=cm(20))
        assert [o.type for o in cut.output] == ["compaction", *(o.type for o in plain.output)]
        assert dumped(cut.output)[1:] == [{**o, "id": o["id"].replace(plain.id[5:], cut.id[5:])}
                                          | ({"call_id": o["call_id"].replace(plain.id[5:], cut.id[5:])}
                                             if "call_id" in o else {})
                                          for o in dumped(plain.output)]  # fmt: skip


def test_a_response_in_a_conversation_is_not_compacted(server):
    client = sdk(server, key="k1")
    conv = client.conversations.create()
    r = client.responses.create(input=LONG, conversation=conv.id, context_management=cm(5), **GREEDY)
    assert [o.type for o in r.output] == ["message"]


@pytest.mark.parametrize("value,param", [
    ([{"type": "truncation"}], "context_management[0].type"),
    ([{"type": "compaction", "compact_threshold": 0}], "context_management[0].compact_threshold"),
    ([{"type": "compaction", "compact_threshold": "9"}], "context_management[0].compact_threshold"),
    ([{"type": "compaction", "limit": 9}], "context_management[0].limit"),
    ([{"type": "compaction"}, {"type": "compaction"}], "context_management"),
    ({"type": "compaction"}, "context_management"),
])  # fmt: skip
def test_bad_entries_change_nothing(server, value, param):
    before = tasks(server)
    r = post(server, "/v1/responses", {"input": LONG, "context_management": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert tasks(server) == before


def test_a_client_that_leaves_during_the_compaction_leaves_nothing(server):
    """The compaction's prefill (~12,000 tokens here: seconds) whose client leaves at 0.5 s: its
    run is stopped and its task deleted, and no response is made."""
    leave_during_the_prefill(server, "/v1/responses", {"input": "lorem ipsum dolor " * 3000,
                                                       "context_management": cm(20)})  # fmt: skip


agents = pytest.importorskip("agents", reason="needs the openai-agents package (the test extra)")
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, SQLiteSession, set_tracing_disabled  # noqa: E402

set_tracing_disabled(True)  # the SDK would send traces to OpenAI


class Answer(BaseModel):  # (a random-weight model's reply ends only where a grammar ends it)
    answer: Literal["yes", "no"]


async def test_the_agents_sdk_model_settings_context_management(server):
    """ModelSettings.context_management with a session that keeps the items: the first run's
    output holds the compaction item, and the next run (its input: the session's items) forks
    it."""
    model = OpenAIResponsesModel(model="rwkv", openai_client=async_sdk(server, key="k1"))
    settings = ModelSettings(temperature=0, max_tokens=64, context_management=cm(10))
    agent = Agent(name="a", instructions="Answer.", model=model, output_type=Answer, model_settings=settings)
    session = SQLiteSession("autocompact")
    await Runner.run(agent, LONG, session=session)
    assert "compaction" in [i.get("type") for i in await session.get_items()]
    second = await Runner.run(agent, "Again?", session=session)
    assert second.final_output.answer in ("yes", "no")
    assert second.raw_responses[-1].usage.input_tokens_details.cached_tokens > len(LONG.split())


@pytest.mark.parametrize("fields", [{"store": False}, {"background": True}], ids=["not-stored", "background"])
def test_not_stored_and_background_responses_compact_too(server, fields):
    client = sdk(server, key="k1")
    r = client.responses.create(input=LONG, context_management=cm(20), **fields, **GREEDY)
    if fields.get("background"):
        deadline = time.monotonic() + 30
        while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.1)
            r = client.responses.retrieve(r.id)
    assert [o.type for o in r.output] == ["compaction", "message"]
    nxt = client.responses.create(input=[*dumped(r.output), {"role": "user", "content": "Go on."}], **GREEDY)
    assert nxt.usage.input_tokens_details.cached_tokens > len(LONG.split())
