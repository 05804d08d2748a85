"""A continue without a prompt of a constrained output that a stop string ended: the stop string's
tokens are in the history (the state read them) but not in the text, so the grammar reads only
the tokens whose text is the output shown (server.tasks.lead.grammar_prefix), after the run the
stop string ended and between the runs of one output; where the stop string began inside the
token that holds the output's last characters, no tokens spell the text: a 422, the task
unchanged. lead.grammar_prefix on its own, then a real server on the tiny random-weight model
(only the grammar can make its output valid)."""

from __future__ import annotations

import json
from array import array

import httpx
import jsonschema
import pytest
from test_grammar_resume import FORMAT, SCHEMA, create, go_on, history, without_state
from util_server import server_fixture, task_result

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
