"""text.format on /v1/responses opens a new assistant turn with the gap chat writes after
"Assistant:" (agents.ready_grammar, shared with chat): the task stores the gapped grammar, so a
fork or continue of it runs the same; the model (the random tiny model: what it writes is what
the grammar allows) writes the gap, and no client sees it: the response's output_text, its
streamed deltas and the stored response read back start with the JSON. No gap where chat has
none: a reply that continues an assistant message, free text first (auto tools), forced calls.
A real server and the official SDK."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from util_server import sdk, server_fixture, task_result, wait_committed

from server.api.openai import tools
from server.api.openai.agents import GAP
from server.engine.types import GrammarSpec
from server.tasks.params import grammar_fields

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip
FORMAT = {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_time", "description": "The time", "parameters": ZONE, "strict": True}]
ASK = {"model": "m", "input": "Pick a number.", "text": {"format": FORMAT}, "max_output_tokens": 30}
FMT = GrammarSpec.json_schema(json.dumps(SCHEMA))


server = server_fixture()


def task_id(rid: str) -> str:
    return "TASK_" + rid.split("_", 1)[1]


def stored(server, rid: str) -> dict:
    """The response's task parameters as stored (what a continue, fork or restart runs)."""
    return json.loads(wait_committed(server.db, task_id(rid), until=lambda row: True)["params"])


def raw(server, rid: str) -> str:
    """What the model wrote (the task's output, the gap included)."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return task_result(c, task_id(rid))["result"]


def sse(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: ")]


def check_shown(server, r: dict, written: str) -> None:
    """The response `r` shows the reply the model `written` after the gap, without it (also read
    back with GET); a completed one is JSON valid for the schema."""
    assert written.startswith(GAP + "{"), written
    (msg,) = r["output"]
    assert msg["content"][0]["text"] == written.lstrip()
    if r["status"] == "completed":
        jsonschema.validate(json.loads(msg["content"][0]["text"]), SCHEMA)
    assert httpx.get(f"{server.url}/v1/responses/{r['id']}").json()["output"] == r["output"]


@pytest.mark.parametrize("fmt,spec", [(FORMAT, FMT), ({"type": "json_object"}, GrammarSpec("json_object"))],
                         ids=["json_schema", "json_object"])  # fmt: skip
def test_a_formatted_reply_runs_behind_the_gap_no_client_sees(server, fmt, spec):
    """(A json_object reply of the random model mostly runs on to max_output_tokens: incomplete.)"""
    r = sdk(server).responses.create(**{**ASK, "text": {"format": fmt}, "max_output_tokens": 12},
                                     extra_body={"seed": 1})  # fmt: skip
    assert r.status in ("completed", "incomplete" if fmt is not FORMAT else "") and r.output_text[:1] == "{", r
    params = stored(server, r.id)
    assert params["grammar"] == grammar_fields(GrammarSpec.any_of([(GAP, spec)]))
    assert params["response_format"] == {"type": "text"} and params["meta"]["format"]["type"] == fmt["type"]
    assert params["hidden_lead"] is True
    check_shown(server, r.model_dump(exclude_unset=True), raw(server, r.id))
    assert r.text.format.type == fmt["type"]  # (the request's format, kept in meta)


def test_a_streamed_formatted_reply_shows_no_gap(server):
    """The deltas are the reply from its first character, the message item open from the start
    (a response without tools), and the replay (GET ?stream=true) is the same."""
    r = httpx.post(server.url + "/v1/responses", json={**ASK, "stream": True}, timeout=60)
    events = sse(r.text)
    final = events[-1]["response"]
    assert final["status"] == "completed", final
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and not deltas[0][:1].isspace() and "".join(deltas) == final["output"][0]["content"][0]["text"]
    assert [e["type"] for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    check_shown(server, final, raw(server, final["id"]))
    replay = httpx.get(f"{server.url}/v1/responses/{final['id']}", params={"stream": "true"}, timeout=60)
    assert sse(replay.text) == events


def test_a_fork_of_the_task_runs_the_gapped_grammar(server):
    """The grammar is the task's: a /v1/tasks fork (a new "Assistant:" turn) writes the gap too."""
    rid = sdk(server).responses.create(**ASK).id
    with httpx.Client(base_url=server.url, timeout=60) as c:
        fork = c.post(f"/v1/tasks/{task_id(rid)}/fork", json={"prompt": "\n\nUser: Again.\n\nAssistant:",
                                                               "max_tokens": 30, "seed": 5})  # fmt: skip
        assert fork.status_code == 200, fork.text
        res = task_result(c, fork.json()["task_id"])
    assert res["finish_reason"] == "stop" and res["result"].startswith(GAP + "{"), res
    jsonschema.validate(json.loads(res["result"]), SCHEMA)


def test_the_response_shows_the_request_s_format_as_sent(server):
    """description and strict as sent (QA: description dropped, strict false shown true); strict
    absent shows true (the output follows the schema either way)."""
    for extra, shown in (({"description": "an answer", "strict": False}, {"description": "an answer", "strict": False}),
                         ({}, {"strict": True})):  # fmt: skip
        fmt = {**{k: v for k, v in FORMAT.items() if k != "strict"}, **extra}
        r = httpx.post(server.url + "/v1/responses", json={**ASK, "text": {"format": fmt}, "max_output_tokens": 4},
                       timeout=60).json()  # fmt: skip
        want = {"type": "json_schema", "name": FORMAT["name"], "schema": FORMAT["schema"], **shown}
        assert r["text"]["format"] == want, r["text"]
        assert httpx.get(f"{server.url}/v1/responses/{r['id']}").json()["text"]["format"] == want


def test_a_follow_up_after_a_formatted_reply_goes_on_from_it(server):
    """previous_response_id after a formatted reply: the history holds the reply as written (the
    gap too), the next reply (free text, then formatted again) starts from its state."""
    client = sdk(server)
    first = client.responses.create(**ASK)
    free = client.responses.create(model="m", input="Why?", previous_response_id=first.id, max_output_tokens=8)
    assert free.status in ("completed", "incomplete") and free.previous_response_id == first.id
    assert stored(server, free.id)["grammar"] == {} and not free.output_text[:1].isspace()
    again = client.responses.create(**{**ASK, "input": "Another."}, previous_response_id=first.id)
    assert again.status == "completed" and again.previous_response_id == first.id
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens
    check_shown(server, again.model_dump(exclude_unset=True), raw(server, again.id))
    assert [o.content[0].text for o in client.responses.retrieve(first.id).output] == [first.output_text]


def test_tools_auto_with_a_format_put_the_gap_before_either(server):
    r = sdk(server).responses.create(**ASK, tools=TOOLS, temperature=1.0, top_p=1.0, extra_body={"seed": 3})
    assert r.status == "completed", r
    alts = GrammarSpec(**stored(server, r.id)["grammar"]).alternatives()
    assert [p for p, _ in alts] == [GAP + tools.MARKER, GAP]
    written = raw(server, r.id)
    assert written.startswith(GAP) and not written.startswith(GAP * 2), written
    if r.output[0].type == "message":
        check_shown(server, r.model_dump(exclude_unset=True), written)
    else:
        assert {o.type for o in r.output} == {"function_call"} and written.startswith(GAP + tools.MARKER)


def test_no_gap_where_chat_has_none(server):
    """A reply that continues an assistant message keeps its format's own grammar (stored as the
    format, as before); free text first (auto tools) and forced calls keep their grammars."""
    client = sdk(server)
    cont = client.responses.create(**{**ASK, "input": [{"role": "user", "content": "Pick a number."},
                                                       {"role": "assistant", "content": "Here:"}]})  # fmt: skip
    params = stored(server, cont.id)
    assert params["grammar"] == {} and params["response_format"]["type"] == "json_schema"
    assert params["hidden_lead"] is False
    written = raw(server, cont.id)
    assert written.startswith("{") and cont.output_text == written, written
    auto = tools.plan(TOOLS, "auto", None, flat=True)
    forced = tools.plan(TOOLS, "required", None, flat=True)
    assert auto is not None and forced is not None
    for choice, plan in (("auto", auto), ("required", forced)):
        r = client.responses.create(model="m", input="What time is it?", tools=TOOLS, tool_choice=choice,
                                    max_output_tokens=30)  # fmt: skip
        assert stored(server, r.id)["grammar"] == grammar_fields(plan.grammar())
    r = client.responses.create(**ASK, tools=TOOLS, tool_choice="required")  # (the format is a later turn's)
    assert stored(server, r.id)["grammar"] == grammar_fields(forced.grammar())


def listed(server) -> list[dict]:
    """The task list, without each task's `state` (an earlier test's state written behind its
    row turns "cached" into "stored" at any moment: no change a request made)."""
    return [{k: v for k, v in t.items() if k != "state"} for t in httpx.get(server.url + "/v1/tasks/list").json()["tasks"]]


def test_a_bad_schema_is_a_400_naming_the_format(server):
    before = listed(server)
    for extra in ({}, {"tools": TOOLS}):
        fmt = {**FORMAT, "schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}}  # (recursive)
        r = httpx.post(server.url + "/v1/responses", json={**ASK, "text": {"format": fmt}, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("text.format", "invalid_schema"), r.text
    assert listed(server) == before


def test_the_shown_mode_of_a_gapped_format_is_no_tools():
    """A stored format behind the gap is no call grammar: the response reads as one without tools
    (render.params_mode), while the call-or-format union, behind the gap or not, is "formatted"."""
    from server.api.responses.render import params_mode

    plan = tools.plan(TOOLS, "auto", None, flat=True)
    assert plan is not None
    union = plan.with_format(FMT).grammar()
    behind = GrammarSpec.any_of([(GAP + p, alt) for p, alt in union.alternatives()])
    assert params_mode({"grammar": grammar_fields(GrammarSpec.any_of([(GAP, FMT)]))}) is None
    assert params_mode({"grammar": grammar_fields(behind)}) == params_mode({"grammar": grammar_fields(union)}) \
        == "formatted"  # fmt: skip
