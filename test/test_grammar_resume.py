"""A continue without a prompt extends the SAME output, so its grammar goes on where the output
stands (SamplingParams.grammar_prefix, constraints.Constraint): an output cut short (max_tokens,
over several continues, across a restart) ends valid for its grammar; a continue whose grammar
the output does not fit is refused with a message that says so, the task unchanged; an output
that already fits its grammar whole ends at once. The Constraint and the engine on their own, then
a real server on the tiny random-weight model (only the grammar can make its output valid)."""

from __future__ import annotations

import json
from array import array

import httpx
import jsonschema
import pytest
from test_task_continue_text import GREEDY, PARROT, parrot_checkpoint
from util_server import committed_row, running_server, server_fixture, task_result

from server.config import Settings
from server.engine import Engine, SamplingParams
from server.engine.constraints import Constraint
from server.engine.grammar import GrammarCompiler
from server.engine.types import GrammarSpec
from server.model import load_model
from server.tokenizer import get_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}  # fmt: skip
OTHER = {"type": "array", "items": {"type": "integer"}}  # no output of SCHEMA fits it
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
HALF = '{"name": "ab'


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.token_table)


@pytest.fixture(scope="module")
def engine(tok):
    e = Engine(load_model("synthetic:tiny"), tok, Settings(max_batch=8, stats_interval=0.0)).start()
    yield e
    e.shutdown()


# --- the Constraint ------------------------------------------------------------------------------
def test_a_prefix_is_read_before_the_first_token(compiler, tok):
    c = Constraint(compiler.compile(GrammarSpec.json_schema(SCHEMA)), tok.encode(HALF), compiler.table)
    assert c.error is None and not c.pending
    assert c.matcher.accept_string('c", "n": 1, "tags": []}') and c.matcher.accept_token(0)  # then EOS: done


def test_a_prefix_goes_through_the_trigger(compiler):
    spec = GrammarSpec("regex", "d[0-9]{2}", trigger="e")
    the, ed, twelve = (compiler.table.index(b) for b in (b"the", b"ed", b"12"))
    free = Constraint(compiler.compile(spec), [the], compiler.table)  # "the": the trigger ends the token
    assert free.matcher is not None and free.matcher.accept_string("d12")
    past = Constraint(compiler.compile(spec), [ed, twelve], compiler.table)  # "ed": "d" runs past it
    assert past.matcher is not None and past.matcher.accept_token(0)  # "d12" read: it may end
    waiting = Constraint(compiler.compile(GrammarSpec("regex", "[0-9]", trigger="z")), [the], compiler.table)
    assert waiting.matcher is None and waiting.k == 0  # still free text


def test_a_prefix_that_does_not_fit_is_a_clear_value_error(compiler, tok):
    ids = tok.encode(HALF)
    with pytest.raises(ValueError, match=rf"the output so far does not fit the grammar: its token 1 of {len(ids)}"):
        Constraint(compiler.compile(GrammarSpec.json_schema(OTHER)), ids, compiler.table)
    spec = compiler.compile(GrammarSpec("regex", "d[0-9]{2}", trigger="e"))
    the, ex, x = (compiler.table.index(b) for b in (b"the", b"ex", b"x"))
    with pytest.raises(ValueError, match="the output so far does not fit the grammar: its token 2 of 2"):
        Constraint(spec, [the, x], compiler.table)  # the grammar's first token
    with pytest.raises(ValueError, match="the output so far does not fit the grammar: its token 1 of 1"):
        Constraint(spec, [ex], compiler.table)  # the text after the trigger, inside its token


# --- the engine ---------------------------------------------------------------------------------
def test_the_engine_completes_a_prefix_into_a_valid_output(engine, tok):
    spec = GrammarSpec.json_schema(SCHEMA)
    for seed in range(6):
        sp = SamplingParams(max_tokens=200, seed=seed, grammar=spec, grammar_prefix=tuple(tok.encode(HALF)))
        r = engine.submit("x", sp).result(600)  # (result() counts each event as a poll)
        assert r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(HALF + r.text), SCHEMA)


def test_a_complete_prefix_can_only_end(engine, tok):
    whole = tuple(tok.encode('{"name": "ab", "n": 1, "tags": []}'))
    sp = SamplingParams(max_tokens=50, seed=1, grammar=GrammarSpec.json_schema(SCHEMA), grammar_prefix=whole)
    r = engine.submit("x", sp).result(60)
    assert (r.text, r.token_ids, r.finish_reason) == ("", [], "stop")


def test_submit_refuses_a_prefix_that_does_not_fit(engine, tok):
    sp = SamplingParams(max_tokens=5, grammar=GrammarSpec.json_schema(OTHER), grammar_prefix=tuple(tok.encode(HALF)))
    with pytest.raises(ValueError, match="does not fit the grammar"):
        engine.submit("x", sp, request_id="refused")
    assert engine.submit("x", SamplingParams(max_tokens=2), request_id="refused").result(60).finish_reason == "length"


# --- tasks on a real server ---------------------------------------------------------------------
server = server_fixture()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def create(c: httpx.Client, **body) -> dict:
    r = c.post("/v1/tasks/create", json={"prompt": "Data:", **body})
    assert r.status_code == 200, r.text
    return task_result(c, r.json()["task_id"])


def without_state(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "state"}


def go_on(c: httpx.Client, tid: str, **body) -> dict:
    r = c.post(f"/v1/tasks/{tid}/continue", json=body)
    assert r.status_code == 200, r.text
    return task_result(c, tid)


def history(server, tid: str) -> tuple[list[int], str, int]:
    """(tokens, state id, state_pos) of the task's committed row, once its state is stored."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        task_result(c, tid, until=lambda r: r["finished"] and r["state"] == "stored")
    row = committed_row(server.db, tid)
    assert row is not None
    return array("i", row["tokens"]).tolist(), row["state_id"], row["state_pos"]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_cut_json_schema_output_continues_into_valid_json(http, seed):
    a = create(http, response_format=FORMAT, max_tokens=5, seed=seed)
    assert a["finish_reason"] == "length" and a["result"].startswith("{")
    b = go_on(http, a["task_id"], max_tokens=300)
    assert b["finish_reason"] == "stop" and b["result"].startswith(a["result"]), b
    jsonschema.validate(json.loads(b["result"]), SCHEMA)


def test_an_output_of_many_continues_and_a_restart_stays_valid(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = create(c, response_format=FORMAT, max_tokens=3, seed=6)
    server.restart()  # the next run's prefix comes from the database
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _ in range(200):
            if r["finish_reason"] != "length":
                break
            before, r = r["result"], go_on(c, r["task_id"], max_tokens=3)
            assert r["result"].startswith(before.removesuffix("\ufffd")), (before, r)
    assert r["finish_reason"] == "stop" and r["completion_tokens"] > 9, r  # (several continues)
    jsonschema.validate(json.loads(r["result"]), SCHEMA)


def test_a_continue_whose_grammar_the_output_does_not_fit_is_refused(http):
    a = create(http, response_format=FORMAT, max_tokens=5, seed=3)
    other = {"type": "json_schema", "json_schema": {"name": "other", "schema": OTHER}}
    r = http.post(f"/v1/tasks/{a['task_id']}/continue", json={"response_format": other, "max_tokens": 50})
    assert r.status_code == 422, r.text
    assert "the output so far does not fit the grammar" in r.json()["error"]["message"]
    # nothing changed, the format neither (but `state`: "cached" becomes "stored" once the state
    # written behind the run is committed, whenever that is)
    assert without_state(task_result(http, a["task_id"])) == without_state(a)
    b = go_on(http, a["task_id"], max_tokens=300)
    jsonschema.validate(json.loads(b["result"]), SCHEMA)
    assert go_on(http, a["task_id"], response_format={"type": "text"}, max_tokens=2)["completion_tokens"] == (
        b["completion_tokens"] + 2
    )  # no grammar: nothing to fit


def test_a_complete_output_continued_ends_at_once(server, http):
    a = create(http, response_format=FORMAT, max_tokens=300, seed=4)
    assert a["finish_reason"] == "stop", a
    kept = history(server, a["task_id"])
    tokens, _, pos = kept
    assert tokens[-2:] != [0, 0] and tokens[-1] == 0 and pos == len(tokens) - 1  # the EOS is pending
    b = go_on(http, a["task_id"], max_tokens=50)
    assert (b["result"], b["finish_reason"], b["completion_tokens"]) == (a["result"], "stop", a["completion_tokens"])
    # the task is as it was: its run read the pending EOS and stopped, but no second EOS follows
    # it, and its state is the one from before that EOS (which stays pending)
    assert history(server, a["task_id"]) == kept
    c = go_on(http, a["task_id"], response_format={"type": "text"}, max_tokens=2)
    assert (c["prompt_tokens"], c["completion_tokens"]) == (1, a["completion_tokens"] + 2), c  # (no rebuild)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip


def test_a_cut_tool_call_of_a_response_continues_into_a_valid_call(http):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    body = {"model": "m", "input": "Weather?", "tools": tools, "tool_choice": "required", "seed": 2,
            "max_output_tokens": 6}  # fmt: skip
    first = http.post("/v1/responses", json=body).json()
    assert first["status"] == "incomplete", first
    tid = "TASK_" + first["id"].split("_", 1)[1]
    assert go_on(http, tid, max_tokens=300)["finish_reason"] == "stop"
    done = http.get(f"/v1/responses/{first['id']}").json()
    calls = [o for o in done["output"] if o["type"] == "function_call"]
    assert done["status"] == "completed" and calls, done
    for call in calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)


@pytest.fixture(scope="module")
def parrot(tmp_path_factory):
    """A server whose greedy output is one emoji (three tokens) repeated (test_task_continue_text)."""
    tmp = tmp_path_factory.mktemp("parrot")
    with running_server(tmp, model=parrot_checkpoint(tmp / "parrot.pth")) as srv:
        yield srv


def test_a_character_split_between_runs_completes_inside_the_json_string(parrot):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}
    with httpx.Client(base_url=parrot.url, timeout=60) as c:
        a = create(c, response_format=fmt, max_tokens=3, **GREEDY)
        assert a["result"] == '"\ufffd'  # the quote, then two of the emoji's three tokens
        b = go_on(c, a["task_id"], max_tokens=4)
        assert b["result"] == '"' + PARROT * 2  # the string goes on (a fresh grammar wrote '"\ufffd"...')
