"""The Responses API (/v1/responses) with the official SDK against a real server: a 5-step chain
with previous_response_id whose every step starts from the previous state (cached_tokens) across
a server restart, streaming events, get/delete, and bad input refused with nothing created."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from util_server import sdk, server_fixture, task_ids

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
# the grammar ends each answer with EOS, which the state consumes: the next step's cached tokens
# are then exactly the previous step's input + output
TEXT = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}


server = server_fixture(env={"RWKV_API_KEYS": "k1,k2"})
tasks = task_ids


def test_a_chain_of_five_continues_from_state_across_a_restart(server):
    client = sdk(server, key="k1")
    prev = client.responses.create(model="m", input="Pick a number.", instructions="Answer in JSON.", text=TEXT,
                                   max_output_tokens=30)
    chain = [prev]
    for step in range(4):
        if step == 2:
            server.restart()  # the chain lives in the database
            client = sdk(server, key="k1")
        r = client.responses.create(model="m", input=f"Another one ({step}).", previous_response_id=prev.id,
                                    text=TEXT, max_output_tokens=30)
        assert r.status == "completed" and r.previous_response_id == prev.id
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        u, pu = r.usage, prev.usage
        assert u.input_tokens_details.cached_tokens >= pu.input_tokens + pu.output_tokens
        assert u.input_tokens > pu.input_tokens + pu.output_tokens and u.output_tokens_details.reasoning_tokens == 0
        assert u.total_tokens == u.input_tokens + u.output_tokens
        chain.append(r)
        prev = r
    for r in chain:  # every step stays readable (forks, not continues)
        got = client.responses.retrieve(r.id)
        assert got.output_text == r.output_text and got.usage.input_tokens == r.usage.input_tokens


def test_streamed_response_events(server):
    client = sdk(server, key="k1")
    events = list(client.responses.create(model="m", input="Hello", max_output_tokens=8, temperature=1.0,
                                          stream=True))  # (the SDK's stream helper wants response.completed)
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if final.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == client.responses.retrieve(final.id).output_text


def test_delete_and_store_false(server):
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="x", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(Exception) as ei:
        client.responses.retrieve(r.id)
    assert getattr(ei.value, "status_code", None) == 404
    tmp = client.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{tmp.id}", headers={"Authorization": "Bearer k1"}).status_code == 404


@pytest.mark.parametrize("body,status,param", [
    ({"previous_response_id": "resp_" + "0" * 32}, 404, "previous_response_id"),
    ({"previous_response_id": "nonsense"}, 404, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"properties": {"a": {"$ref": "#"}}}}}},
     400, "text.format"),
    ({"tools": [{"type": "function", "name": "f g"}]}, 400, "tools[0].name"),  # (tools: test_responses_tools.py)
    ({"temperature": 9}, 400, "temperature"),
    ({"bogus": 1}, 400, "bogus"),
    ({"max_output_tokens": "5"}, 400, "max_output_tokens"),  # strict types: never coerced
    ({"stream": "yes"}, 400, "stream"),
    ({"store": 1}, 400, "store"),
    ({"include": ["reasoning.encrypted_content", "message.output_text"]}, 400, "include[1]"),  # (no such value)
    ({"reasoning": {"bogus": 1}}, 400, "reasoning.bogus"),
    ({"background": True, "store": False}, 400, "background"),  # (background needs store)
    ({"max_tool_calls": -1}, 400, "max_tool_calls"),
    ({"max_tool_calls": 2**64}, 400, "max_tool_calls"),  # (was a 500: past what the params' JSON holds)
    ({"top_logprobs": 21}, 400, "top_logprobs"),  # (0..20)
    ({"conversation": "conv_1"}, 404, "conversation"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"metadata": {"k": "v" * 513}}, 400, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, 400, "metadata"),  # (was named "metadata.kkk....[key]")
    ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, 400, "input[0].type"),  # (was a 500)
    ({"input": [{"type": {}, "role": "user", "content": "x"}]}, 400, "input[0].type"),
    ({"prompt_cache_retention": "1h"}, 400, "prompt_cache_retention"),
    ({"prompt_cache_options": {"ttl": "5m"}}, 400, "prompt_cache_options.ttl"),
    ({"text": {"verbosity": "loud"}}, 400, "text.verbosity"),
    # nested objects are strict and closed too (text.format.strict "yes" was read as true)
    ({"text": {"format": {**TEXT["format"], "strict": "yes"}}}, 400, "text.format.strict"),
    ({"stream_options": {"include_obfuscation": "no"}}, 400, "stream_options.include_obfuscation"),
    ({"stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    # a content part is named by its place (was "input[0].content: Input should be a valid string")
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "bogus": 1}]}]}, 400,
     "input[0].content[0].bogus"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_creates_nothing(server, body, status, param):
    before = tasks(server)
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **body},
                   headers={"Authorization": "Bearer k1"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert tasks(server) == before


def test_another_keys_response_is_not_found(server):
    mine = sdk(server, key="k1").responses.create(model="m", input="x", max_output_tokens=2)
    before = tasks(server, "k2")
    r = httpx.post(server.url + "/v1/responses", json={"input": "y", "previous_response_id": mine.id},
                   headers={"Authorization": "Bearer k2"})
    assert r.status_code == 404, r.text
    assert httpx.get(f"{server.url}/v1/responses/{mine.id}", headers={"Authorization": "Bearer k2"}).status_code == 404
    assert tasks(server, "k2") == before


def test_a_too_long_input_is_a_413_naming_input(server):
    before = tasks(server)
    prev = sdk(server, key="k1").responses.create(model="m", input="x", max_output_tokens=2)
    for extra in ({}, {"previous_response_id": prev.id}):  # a new response, and one continuing another
        r = httpx.post(server.url + "/v1/responses", json={"input": "hello " * 70_000, "max_output_tokens": 2, **extra},
                       headers={"Authorization": "Bearer k1"}, timeout=60)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "prompt_too_long" and "input" in err["message"], err
    assert len(tasks(server)) == len(before) + 1  # prev only


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_no_response_id_is_a_404_in_the_openai_shape(server, method):
    r = httpx.request(method, server.url + "/v1/responses/", headers={"Authorization": "Bearer k1"})
    assert r.status_code == 404, (r.status_code, r.headers, r.text)
    assert r.json()["error"]["type"] == "not_found_error" and r.json()["error"]["param"] == "response_id"


def test_post_with_a_trailing_slash_creates(server):
    r = httpx.post(server.url + "/v1/responses/", json={"input": "x", "max_output_tokens": 2},
                   headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    assert sdk(server, key="k1").responses.retrieve(r.json()["id"]).id == r.json()["id"]


def other_tasks(server) -> list[str]:
    """The ids of a plain /v1/tasks task and of a lightning session task of key k2."""
    auth = {"Authorization": "Bearer k2"}
    before = set(tasks(server, "k2"))
    r = httpx.post(server.url + "/v1/tasks/create", json={"prompt": "User: hi\n\nAssistant:", "max_tokens": 2},
                   headers=auth)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/state/chat/completions", headers=auth, timeout=60,
                   json={"session_id": "not-a-response", "contents": ["User: hi\n\nAssistant:"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    made = sorted(set(tasks(server, "k2")) - before)
    assert len(made) == 2 and all(t.startswith("TASK_") for t in made), made
    return made


def test_only_responses_are_responses(server):
    """A /v1/tasks task or a lightning session is no resp_<hex> of its id: not read, continued
    nor deleted through /v1/responses."""
    client, auth = sdk(server, key="k2"), {"Authorization": "Bearer k2"}
    for tid in other_tasks(server):
        rid = "resp_" + tid.split("_", 1)[1]
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{server.url}/v1/responses/{rid}", headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        before = tasks(server, "k2")
        r = httpx.post(server.url + "/v1/responses", json={"input": "y", "previous_response_id": rid}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert tasks(server, "k2") == before
        assert httpx.get(f"{server.url}/v1/tasks/{tid}/status", headers=auth).status_code == 200  # still there
    sessions = httpx.post(server.url + "/state/status", json={}, headers=auth).json()["sessions"]
    assert "not-a-response" in {s["session_id"] for s in sessions}
    r = client.responses.create(model="m", input="x", max_output_tokens=2)  # a response still is one
    assert client.responses.retrieve(r.id).id == r.id


def test_responses_stored_before_the_tag_still_read_as_responses():
    """A response is a task tagged by the route; chains stored by servers older than any mark
    keep working; a lightning session of that time and a newer untagged task are no responses."""
    from server.api.openai.chat_format import CHAT_STOP
    from server.api.responses.render import RESPONSE, UNMARKED_BEFORE, is_response
    from server.tasks.records import TASK, TMP, Task

    def task(stop, created_at, kind=TASK, tag=None):
        return Task(id="TASK_" + "0" * 32, kind=kind, params={"stop": stop}, created_at=created_at, tag=tag)

    old, new = UNMARKED_BEFORE - 86400, UNMARKED_BEFORE + 1
    stop = list(CHAT_STOP)
    assert is_response(task(stop, new, tag=RESPONSE)) and is_response(task(stop, old, tag=RESPONSE))
    assert is_response(task(stop, old))  # stored by an earlier server
    assert not is_response(task(stop, new))  # a /v1/tasks task made since
    assert not is_response(task(stop, old, tag="lightning session s"))
    assert not is_response(task([*stop, "\uffffrwkv_lightning session s"], old))  # marked, not migrated
    assert not is_response(task(stop, new, kind=TMP, tag=RESPONSE))


def test_a_continued_assistant_message_keeps_the_replys_leading_space(server):
    """An input ending with the assistant's message is continued: the reply's leading space is
    text the client joins to it (as /v1/completions writes it after the same prompt)."""
    from server.api.openai.chat_format import build_prompt

    inp = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, here"}]
    sample = {"temperature": 1.0, "top_p": 0.3, "extra_body": {"seed": 1}}  # (seed: our extra)
    prompt = build_prompt([(m["role"], m["content"]) for m in inp]).text
    client = sdk(server, key="k1")
    completion = client.completions.create(model="m", prompt=prompt, stop=["\n\n"], max_tokens=5, **sample)
    text = completion.choices[0].text
    assert text[:1].isspace(), text  # (this seed's continuation starts with a space: what is tested)
    r = client.responses.create(model="m", input=inp, max_output_tokens=5, **sample)
    assert r.output_text == text == client.responses.retrieve(r.id).output_text
    events = list(client.responses.create(model="m", input=inp, max_output_tokens=5, stream=True, **sample))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.content[0].text == text
    fresh = client.responses.create(model="m", input="x", max_output_tokens=5, **sample)
    assert fresh.output_text and not fresh.output_text[0].isspace()


def test_the_message_item_of_an_incomplete_response_is_incomplete(server):
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="x", max_output_tokens=2, extra_body={"seed": 1})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == client.responses.retrieve(r.id).output[0].status == "incomplete"
    events = list(client.responses.create(model="m", input="x", max_output_tokens=2, extra_body={"seed": 1},
                                          stream=True))
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete"
    assert done.status == events[-1].response.output[0].status == "incomplete"
    ended = client.responses.create(model="m", input="x", text=TEXT, max_output_tokens=30)  # EOS ends it
    assert ended.status == ended.output[0].status == "completed"


@pytest.mark.parametrize("extra", [{"include": []}, {"include": None}, {"store": None}, {"stream": None},
                                   {"reasoning": None}, {"reasoning": {"effort": "low", "summary": None}},
                                   {"background": False}, {"max_tool_calls": None}, {"top_logprobs": 0},
                                   {"prompt": None}, {"conversation": None},
                                   {"stream_options": {"include_obfuscation": False}},
                                   {"access_programs": None}, {"background_options": None},
                                   {"context_management": None}, {"context_management": []}, {"image": None},
                                   {"moderation": None}, {"prompt_cache_options": None},
                                   {"prompt_cache_retention": None}, {"prompt_cache_retention": "24h"},
                                   {"prompt_cache_retention": "in_memory"},
                                   {"prompt_cache_options": {"ttl": "12h", "mode": "explicit", "prewarm": False,
                                                             "comparison_response_id": "resp_x"}}],
                         ids=lambda v: str(v))
def test_nulls_and_an_empty_include_are_the_defaults(server, extra):
    """As chat takes null for a field not set; reasoning is ignored as chat's reasoning_effort."""
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **extra},
                   headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response" and r.json()["store"] is True  # not streamed, stored


@pytest.mark.parametrize("field,value,param", [
    ("access_programs", {"cyber": "standard"}, "access_programs"),
    ("background_options", {"completion_window": "soonest"}, "background_options"),
    ("image", {"context_compression": "auto"}, "image"),
    ("moderation", {"model": "omni-moderation-latest"}, "moderation"),
    ("prompt_cache_options", {"prewarm": True}, "prompt_cache_options.prewarm"),
])
def test_a_set_field_this_server_cannot_honour_is_refused_naming_it(server, field, value, param):
    """The SDK's request fields without a meaning here: null is accepted (above), a value is a 400
    unsupported_field naming it, nothing created."""
    before = tasks(server)
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": "Bearer k1"},
                   json={"input": "x", "max_output_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "unsupported_field", "invalid_request_error"), err
    assert err["message"].startswith(param.split(".")[0]) and err["message"].endswith(" is not supported on /v1/responses")
    assert err["message"].count("/v1/responses") == 1, err  # (one message named the route twice)
    assert tasks(server) == before


def test_text_verbosity_is_echoed(server):
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="x", max_output_tokens=2, text={"verbosity": "low"})
    assert r.text.verbosity == "low" == client.responses.retrieve(r.id).text.verbosity
    events = list(client.responses.create(model="m", input="x", max_output_tokens=2, stream=True,
                                          text={"verbosity": "high", "format": {"type": "text"}}))
    assert events[0].response.text.verbosity == events[-1].response.text.verbosity == "high"
    plain = client.responses.create(model="m", input="x", max_output_tokens=2)
    assert plain.text.verbosity == "medium"  # (OpenAI's default, as OpenAI shows it)


def test_a_prefill_only_response_has_nothing_cached(server):
    """max_output_tokens 0 holds the input's last token back (fed by the next response): it is
    not a cached token."""
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="hello there", max_output_tokens=0)
    assert r.usage.input_tokens > 1 and r.usage.input_tokens_details.cached_tokens == 0, r.usage


def test_metadata_is_kept_with_the_response(server):
    """As OpenAI does: shown in the answer and when read back (SDKs tag their runs with it)."""
    client = sdk(server, key="k1")
    r = client.responses.create(model="m", input="x", max_output_tokens=2, metadata={"session": "abc", "n": "1"})
    assert r.metadata == {"session": "abc", "n": "1"} == client.responses.retrieve(r.id).metadata


def test_includes_of_items_never_made_here_are_accepted_and_add_nothing(server):
    """Some clients send include ["reasoning.encrypted_content"] with every request: there are no
    reasoning items (nor built-in tools' results, nor images) here, so there is nothing to add."""
    client = sdk(server, key="k1")
    ask = {"model": "m", "input": "x", "max_output_tokens": 4, "temperature": 0}
    plain = client.responses.create(**ask)
    every = ["reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
             "web_search_call.action.sources", "message.input_image.image_url",
             "computer_call_output.output.image_url", "code_interpreter_call.outputs"]
    r = client.responses.create(**ask, include=every, store=False)
    assert r.status == plain.status and [o.model_dump() for o in r.output] == [
        {**o.model_dump(), "id": r.output[0].id} for o in plain.output]
    streamed = list(client.responses.create(**ask, include=["reasoning.encrypted_content"], stream=True))
    assert streamed[-1].response.output_text == plain.output_text


def test_responses_validate_with_the_sdks_models(server):
    """The SDK parses responses without validating them; a client that validates (pydantic's
    model_validate on the SDK's types) needs every required field, e.g. usage's
    input_tokens_details.cache_write_tokens (required by the installed SDK's ResponseUsage; 0
    here)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "m", "input": "Pick a number.", "text": TEXT, "max_output_tokens": 30}
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": "Bearer k1"}) as http:
        r = Response.model_validate(http.post("/v1/responses", json=body).json())
        streamed = http.post("/v1/responses", json={**body, "stream": True}).text
    assert r.usage is not None and r.usage.input_tokens_details.cache_write_tokens == 0
    events = [json.loads(line[6:]) for line in streamed.split("\n") if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_python(e).type for e in events][-1] == "response.completed"
