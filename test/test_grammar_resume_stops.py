"""A continue without a prompt of a constrained output that a stop string ended: the stop string's
tokens are in the history (the state read them) but not in the text, so the grammar reads only
the tokens whose text is the output shown (server.tasks.lead.grammar_prefix), after the run the
stop string ended and between the runs of one output; where the stop string began inside the
token that holds the output's last characters, no tokens spell the text: a 422, the task
unchanged. The text is read as the detokenizers show it: free text before a tool call's trigger
may hold bytes that are not UTF-8, shown as U+FFFD, which the tokens that hold them spell.
lead.grammar_prefix on its own, then a real server on the tiny random-weight model (only the
grammar can make its output valid), and one whose greedy output is a fixed walk of tokens."""

from __future__ import annotations

import json
import time
from array import array

import httpx
import jsonschema
import pytest
from test_grammar_resume import FORMAT, SCHEMA, create, go_on, history, without_state
from test_task_continue_text import GREEDY
from util_models import walk_checkpoint
from util_server import running_server, server_fixture, task_result

from server.tasks.lead import grammar_prefix
from server.tasks.output import Output
from server.tasks.records import Task
from server.tokenizer import get_tokenizer

EMOJI = "\U0001f99c".encode()  # four bytes: cut after two, it shows as one U+FFFD


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def ids(tok, *pieces: bytes) -> list[int]:
    """The token of each piece of bytes (each one token of the vocabulary)."""
    return [tok.token_table.index(p) for p in pieces]


def task(tokens: list[int], text: str) -> Task:
    return Task(id="TASK_x", kind="task", tokens=array("i", [7, *tokens]), out_start=1, out=Output(text))


def spelled(tok, prefix: tuple[int, ...]) -> bytes:
    return tok.decode_bytes(list(prefix))


# --- lead.grammar_prefix --------------------------------------------------------------------------
def test_every_token_is_read_when_the_text_is_theirs(tok):
    out = ids(tok, b"{", b'"', b"name") + [0]  # (EOS: the separator a stop token left)
    assert grammar_prefix(task(out, '{"name'), tok.decode_bytes) == tuple(out[:3])
    assert grammar_prefix(task(out, "{"), None) == tuple(out[:3])  # no tokenizer: all are read


def test_a_stop_string_s_tokens_are_left_out_at_the_end_and_between_runs(tok):
    # run 1 stopped on "name" ('{"' shown), run 2 wrote 'name": "ab' (its text starts afresh),
    # run 3 stopped on ", " inside the string: the text is '{"name": "ab'
    out = ids(tok, b"{", b'"', b"name", b"name", b'":', b' "', b"ab", b",", b" ")
    prefix = grammar_prefix(task(out, '{"name": "ab'), tok.decode_bytes)
    assert spelled(tok, prefix) == b'{"name": "ab'
    # and a character the output's end cut (shown as U+FFFD): its first bytes are read
    out += ids(tok, b'"', b"x", EMOJI[:1], EMOJI[1:2])
    prefix = grammar_prefix(task(out, '{"name": "ab"x\ufffd'), tok.decode_bytes)
    assert spelled(tok, prefix) == b'{"name": "ab"x' + EMOJI[:2]


def test_a_stop_string_that_began_inside_the_last_token_is_a_value_error(tok):
    out = ids(tok, b"{", b'"', b"name")  # stop "am": '{"n' shown, "n" inside the token "name"
    with pytest.raises(ValueError, match="a stop string began inside the token that holds the output's last"):
        grammar_prefix(task(out, '{"n'), tok.decode_bytes)


def test_bytes_that_are_not_utf8_are_read_as_the_tokens_that_hold_them(tok):
    # free text may hold any token: a lone continuation byte shows as U+FFFD, and so does a
    # character's first byte that the next token does not go on; run 1 stopped on "hi" with
    # "a<U+FFFD>b" shown, run 2 wrote "c"
    for bad in (b"\x80", b"\xe2"):
        out = ids(tok, b"a", bad, b"b", b"hi", b"c")
        assert spelled(tok, grammar_prefix(task(out, "a\ufffdbc"), tok.decode_bytes)) == b"a" + bad + b"bc"
    # a character's first byte, then the stop string's token: its run showed it as U+FFFD
    out = ids(tok, b"a", b"\xe2", b"hi")
    assert spelled(tok, grammar_prefix(task(out, "a\ufffd"), tok.decode_bytes)) == b"a\xe2"
    # a U+FFFD written as such (its three bytes are one token) is read too
    out = ids(tok, "\ufffd".encode(), b"hi")
    assert spelled(tok, grammar_prefix(task(out, "\ufffd"), tok.decode_bytes)) == "\ufffd".encode()


def test_a_long_output_no_tokens_spell_is_refused_at_once(tok):
    # the stop string "am" began inside the last token ("name"): the search that finds no
    # spelling only tries leaving out as many bytes as the tokens hold beyond the text's (it
    # took seconds, quadratic in the tokens, on the event loop)
    body = tok.encode("".join(f"item {i}, " for i in range(700)))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="a stop string began inside the token"):
        grammar_prefix(task([*body, *ids(tok, b"name")], tok.decode(body) + "n"), tok.decode_bytes)
    assert time.perf_counter() - t0 < 1.0, (len(body), time.perf_counter() - t0)


# --- tasks on a real server -----------------------------------------------------------------------
server = server_fixture()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_a_continue_after_a_stop_string_goes_on_from_the_text_shown(http):
    # the model's first tokens are "{", '"', "name" (seed 1): "name" stops the run at once
    a = create(http, response_format=FORMAT, max_tokens=300, seed=1, stop="name")
    assert (a["result"], a["finish_reason"]) == ('{"', "stop"), a
    b = go_on(http, a["task_id"], stop=[], max_tokens=3)  # the stop string lies between the runs
    assert b["finish_reason"] == "length" and b["result"].startswith('{"'), b
    c = go_on(http, a["task_id"], max_tokens=300)
    assert c["finish_reason"] == "stop" and c["result"].startswith(b["result"].removesuffix("\ufffd")), c
    jsonschema.validate(json.loads(c["result"]), SCHEMA)  # the grammar read '{"', not '{"name'


def test_a_stop_string_begun_inside_a_token_is_a_422_and_changes_nothing(server, http):
    a = create(http, response_format=FORMAT, max_tokens=300, seed=1, stop="am")  # '{"n' + "ame"
    assert (a["result"], a["finish_reason"]) == ('{"n', "stop"), a
    tid = a["task_id"]
    kept = history(server, tid)
    r = http.post(f"/v1/tasks/{tid}/continue", json={"stop": [], "max_tokens": 50})
    assert r.status_code == 422, r.text
    e = r.json()["error"]
    assert e["code"] == "invalid_request" and "a stop string began inside the token" in e["message"], e
    assert without_state(task_result(http, tid)) == without_state(a)
    assert history(server, tid) == kept
    # without the grammar the output goes on; with a prompt a new output starts its grammar
    d = go_on(http, tid, response_format={"type": "text"}, stop=[], max_tokens=2)
    assert d["result"].startswith('{"n') and d["completion_tokens"] == 5, d
    e2 = go_on(http, tid, prompt="\nData:", response_format=FORMAT, max_tokens=300)
    jsonschema.validate(json.loads(e2["result"]), SCHEMA)


# --- a tool call after free text that is not UTF-8 --------------------------------------------------
TOOLS = [{"type": "function", "name": "f", "strict": True,
          "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]  # fmt: skip


@pytest.fixture(scope="module")
def walker(tmp_path_factory, tok):
    """A server whose greedy output is a byte that is not UTF-8, " <tool", "hi", "_call>", "[",
    EOS (util_models.walk_checkpoint; the grammar writes the call list after the trigger)."""
    walk = [*ids(tok, b"\x80", b" <", b"tool", b"hi", b"_", b"call", b">", b"["), 0]
    tmp = tmp_path_factory.mktemp("walker")
    with running_server(tmp, model=walk_checkpoint(tmp / "walk.pth", walk)) as srv:
        yield srv


def test_a_tool_call_grammar_resumes_after_free_text_that_is_not_utf8_and_a_stop_string(walker):
    with httpx.Client(base_url=walker.url, timeout=60) as c:
        body = {"model": "m", "input": "Go", "tools": TOOLS, "max_output_tokens": 1, "temperature": 0}
        first = c.post("/v1/responses", json=body).json()
        tid = "TASK_" + first["id"].split("_", 1)[1]
        assert task_result(c, tid)["result"] == "\ufffd", first  # the byte 0x80
        a = go_on(c, tid, stop=["hi"], max_tokens=10, **GREEDY)
        assert (a["result"], a["finish_reason"]) == ("\ufffd <tool", "stop"), a
        # the grammar reads 0x80, " <", "tool" (not "hi"), so "_call>" completes the trigger
        b = go_on(c, tid, stop=[], max_tokens=300)
        assert b["finish_reason"] == "stop" and b["result"].startswith("\ufffd <tool_call>["), b
        done = c.get(f"/v1/responses/{first['id']}").json()
    calls = [o for o in done["output"] if o["type"] == "function_call"]
    assert done["status"] == "completed" and calls, done
    assert all((x["name"], json.loads(x["arguments"])) == ("f", {}) for x in calls), calls
