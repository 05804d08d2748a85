"""POST /v1/responses/compact (OpenAI's compaction; here the history's state, kept) against a real
server with the official SDK: a compaction of a chain (previous_response_id) or of an input holds
that history (a response sent the compaction item answers as one sent the chain or the whole
history, token for token), its output lists the history's user messages, it survives a restart
and can be compacted again, the token count knows it, bad requests change nothing, and the
Agents SDK's OpenAIResponsesCompactionSession runs on it in both of its modes."""

from __future__ import annotations

import time
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel
from util_server import async_sdk, sdk, server_fixture, task_ids

GREEDY = {"model": "m", "max_output_tokens": 8, "temperature": 0}


server = server_fixture(env={"RWKV_API_KEYS": "k1,k2"})
tasks = task_ids


def post(server, path: str, body: dict | str, key: str = "k1") -> httpx.Response:
    """POST a JSON body (a str: as it is)."""
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if isinstance(body, str):
        return httpx.post(server.url + path, content=body.encode(), headers=h, timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def items(compacted) -> list[dict]:
    """A compaction's output as the next request's input items (as the Agents SDK sends them)."""
    return [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]


def user_texts(compacted) -> list[str]:
    return [o.content[0].text for o in compacted.output if o.type == "message" and o.role == "user"]


def test_a_compacted_chain_answers_as_the_chain_after_a_restart_and_its_deletion(server):
    client = sdk(server, key="k1")
    r1 = client.responses.create(input="Hello there.", **GREEDY)
    r2 = client.responses.create(input="And again.", previous_response_id=r1.id, **GREEDY)
    cp = client.responses.compact(model="gpt-4.1", previous_response_id=r2.id)
    assert cp.object == "response.compaction" and cp.id.startswith("cmp_")
    assert user_texts(cp) == ["Hello there.", "And again."]
    last = cp.output[-1]
    assert last.type == "compaction" and last.encrypted_content and len(cp.output) == 3
    held = r2.usage.input_tokens + r2.usage.output_tokens
    assert cp.usage.input_tokens == held and cp.usage.output_tokens == 0
    b = client.responses.create(input="Third.", previous_response_id=r2.id, **GREEDY)
    client.responses.delete(r2.id)  # the state the compaction shares with it stays its
    client.responses.delete(r1.id)
    server.restart()  # a compaction is stored
    client = sdk(server, key="k1")
    a = client.responses.create(input=[*items(cp), {"role": "user", "content": "Third."}], **GREEDY)
    assert a.output_text == b.output_text and a.usage == b.usage
    assert a.usage.input_tokens_details.cached_tokens >= held - 1  # forked, not prefilled again
    assert a.previous_response_id is None  # (it forked a compaction, no response)
    assert [i.content[0].text for i in client.responses.input_items.list(a.id).data] == ["Third."]


HISTORY = [
    {"role": "user", "content": "Hi"},
    {"type": "function_call", "call_id": "call_1", "name": "clock", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
    {"role": "assistant", "content": "It is noon."},
]


def test_a_compacted_input_answers_as_the_whole_history(server):
    client = sdk(server, key="k1")
    cp = client.responses.compact(model="m", input=HISTORY, instructions="Be brief.")
    assert user_texts(cp) == ["Hi"] and cp.usage.input_tokens_details.cached_tokens == 0
    nxt = {"role": "user", "content": "And tomorrow?"}
    a = client.responses.create(input=[*items(cp), nxt], **GREEDY)
    b = client.responses.create(input=[*HISTORY, nxt], instructions="Be brief.", **GREEDY)
    assert a.output_text == b.output_text
    assert a.usage.input_tokens == b.usage.input_tokens
    assert a.usage.input_tokens_details.cached_tokens >= cp.usage.input_tokens - 1
    # a call the compacted history made is known after it: its output may come again
    again = [*items(cp), {"type": "function_call_output", "call_id": "call_1", "output": "still noon"}]
    assert client.responses.create(input=again, **GREEDY).status in ("completed", "incomplete")
    count = post(server, "/v1/responses/input_tokens", {"input": [*items(cp), nxt]}).json()
    assert count["input_tokens"] == a.usage.input_tokens


def test_a_compaction_of_a_compaction(server):
    client = sdk(server, key="k1")
    cp = client.responses.compact(model="m", input=HISTORY)
    more = [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "No."}]
    cp2 = client.responses.compact(model="m", input=[*items(cp), *more])
    assert user_texts(cp2) == ["Hi", "More?"]
    assert cp2.usage.input_tokens_details.cached_tokens >= cp.usage.input_tokens - 1
    nxt = {"role": "user", "content": "Bye."}
    a = client.responses.create(input=[*items(cp2), nxt], **GREEDY)
    b = client.responses.create(input=[*items(cp), *more, nxt], **GREEDY)
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens
    # by previous_response_id from a response that forked a compaction: every user message
    cp3 = client.responses.compact(model="m", previous_response_id=a.id)
    assert user_texts(cp3) == ["Hi", "More?", "Bye."]


def _compaction(server, key: str = "k1") -> dict:
    return post(server, "/v1/responses/compact", {"input": "Hello."}, key).json()["output"][-1]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/responses/compact", {"model": "m"}, 400, "input"),
    ("/v1/responses/compact", {"input": [{"type": "compaction", "encrypted_content": "cmp_" + "0" * 32}]}, 400,
     "input[0].encrypted_content"),
    ("/v1/responses/compact", {"input": "x", "image": {"context_compression": "enabled"}}, 400, "image"),
    ("/v1/responses/compact", {"input": "x", "tools": []}, 400, "tools"),
    ("/v1/responses/compact", '{"input": "bad \\ud800"}', 400, "input"),
    ("/v1/responses/compact", {"previous_response_id": "resp_" + "0" * 32}, 404, "previous_response_id"),
    ("/v1/responses", {"input": ["OWN"], "previous_response_id": "resp_" + "0" * 32}, 400, "previous_response_id"),
    ("/v1/responses", {"input": ["OWN"], "conversation": "conv_x"}, 400, "input[0]"),
    ("/v1/responses", {"input": ["OTHER", {"role": "user", "content": "x"}]}, 400, "input[0].encrypted_content"),
    ("/v1/responses", {"input": [{"type": "compaction", "encrypted_content": "x"}]}, 400, "input[0].encrypted_content"),
])  # fmt: skip
def test_bad_requests_change_nothing(server, path, body, status, param):
    own, other = _compaction(server), _compaction(server, "k2")
    if isinstance(body, dict) and isinstance(body.get("input"), list):
        body["input"] = [{"OWN": own, "OTHER": other}.get(it, it) if isinstance(it, str) else it
                         for it in body["input"]]  # fmt: skip
    before = tasks(server), tasks(server, "k2")
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert (tasks(server), tasks(server, "k2")) == before


def test_a_compaction_is_no_response_and_is_deleted_as_a_task(server):
    item = _compaction(server)
    hex_ = item["encrypted_content"].removeprefix("cmp_")
    h = {"Authorization": "Bearer k1"}
    for rid in (item["id"], "resp_" + hex_):
        assert httpx.get(f"{server.url}/v1/responses/{rid}", headers=h).status_code == 404
    r = post(server, "/v1/responses", {"input": "x", "previous_response_id": "resp_" + hex_})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.url + "/v1/responses/compact", headers=h)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert post(server, f"/v1/tasks/TASK_{hex_}/delete", {}).status_code == 200
    r = post(server, "/v1/responses", {"input": [item, {"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content"


def test_a_client_that_leaves_leaves_no_compaction(server):
    """A compaction of ~12,000 tokens (seconds of prefill here) whose client leaves at 0.5 s: its
    run is stopped and its task deleted (a stopped one would stay listed, cancelled)."""
    leave_during_the_prefill(server, "/v1/responses/compact", {"input": "lorem ipsum dolor " * 3000})


def leave_during_the_prefill(server, path: str, body: dict) -> None:
    """POST `body` and leave after 0.5 s (its prefill takes seconds here): the tasks of key k1 are
    as before once its run has been stopped, and the log has its 499."""
    before = tasks(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer k1"}, timeout=0.5)
    deadline = time.monotonic() + 10
    while tasks(server) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tasks(server) == before
    assert f'POST {path}" 499' in server.log_tail(200)


agents = pytest.importorskip("agents", reason="needs the openai-agents package (the test extra)")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIResponsesCompactionSession,
    OpenAIResponsesModel,
    Runner,
    SQLiteSession,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # the SDK would send traces to OpenAI


class Answer(BaseModel):  # (a random-weight model's reply ends only where a grammar ends it)
    answer: Literal["yes", "no"]


@pytest.mark.parametrize("mode", ["previous_response_id", "input"])
async def test_the_agents_sdk_compaction_session(server, mode):
    """Compaction after every run: the session then holds the user messages and one compaction
    item, and the next run starts from the compaction's state (its input was cached)."""
    client = async_sdk(server, key="k1")
    model = OpenAIResponsesModel(model="rwkv", openai_client=client)
    agent = Agent(name="a", instructions="Answer.", model=model, output_type=Answer,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))  # fmt: skip
    session = OpenAIResponsesCompactionSession(f"s-{mode}", SQLiteSession(f"s-{mode}"), client=client,
                                               compaction_mode=mode, should_trigger_compaction=lambda ctx: True)  # fmt: skip
    await Runner.run(agent, "Hi.", session=session)
    kept = await session.get_items()
    assert [i.get("type") for i in kept] == ["message", "compaction"], kept
    second = await Runner.run(agent, "Again.", session=session)
    usage = second.raw_responses[-1].usage
    assert usage.input_tokens_details.cached_tokens > 0  # forked the compaction
    kept = await session.get_items()
    assert [i.get("type") for i in kept] == ["message", "message", "compaction"], kept
    assert [i["content"][0]["text"] for i in kept[:2]] == ["Hi.", "Again."]
