"""Logprobs on /v1/responses (`include: ["message.output_text.logprobs"]` with `top_logprobs`)
against a real server, with the official SDK: the values are those /v1/chat/completions reports
for the same chat (the same prompt, greedy), the stream's deltas carry each token once and add up
to the final part, a response without the include has none, a follow-up does not inherit them,
and they are kept in memory only (none after a restart). The token spans (which tokens belong to
a message's text) and the task parameter's checks are tested without a server."""

from __future__ import annotations

import time
from array import array

import httpx
import orjson
import pytest
from util_server import committed_row, running_server, sdk

from server.api.responses.logprobs import logprobs_of, tokens_in
from server.engine.types import TokenLogprob
from server.tasks.errors import TaskInvalid
from server.tasks.output import Output
from server.tasks.params import clean_params, sampling_params
from server.tasks.token_logprobs import LogprobBudget, TokenLogprobs

LOGPROBS = ["message.output_text.logprobs"]
ASK = {"model": "m", "input": "Tell me about the sea.", "temperature": 0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("resp-lp")) as srv:
        yield srv


def _bytes(entries) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries)


def test_the_values_are_chat_completions_and_the_top_ones_hold_the_greedy_choice(server):
    client = sdk(server)
    r = client.responses.create(**ASK, include=LOGPROBS, top_logprobs=3)
    part = r.output[0].content[0]
    assert r.status == "incomplete" and r.top_logprobs == 3  # (cut by max_output_tokens: no stop token)
    assert part.text and len(part.logprobs) == r.usage.output_tokens
    assert part.text in _bytes(part.logprobs).decode("utf-8", "replace")  # the tokens' bytes hold the text (and its hidden lead)
    for e in part.logprobs:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the most probable
        assert e.top_logprobs[0].logprob == e.logprob and e.top_logprobs[1].logprob <= e.logprob
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK["input"]}],
                                          temperature=0, max_tokens=24, logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.content.strip() == part.text
    theirs = chat.choices[0].logprobs.content
    ours = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in part.logprobs]
    assert ours == [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in theirs]
    got = client.responses.retrieve(r.id).output[0].content[0]
    assert [e.model_dump() for e in got.logprobs] == [e.model_dump() for e in part.logprobs]


def test_a_stream_sends_each_token_once_and_its_deltas_add_up_to_the_part(server):
    client = sdk(server)
    events = list(client.responses.create(**ASK, include=LOGPROBS, top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.logprobs for e in deltas)  # (a delta of text has its tokens' logprobs)
    streamed = [lp.model_dump() for e in deltas for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    part = next(e for e in events if e.type == "response.content_part.done").part
    final = events[-1].response.output[0].content[0]
    assert streamed == [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in part.logprobs]
    assert streamed == [lp.model_dump() for lp in final.logprobs] and len(streamed) > 3
    replay = list(client.responses.retrieve(events[-1].response.id, stream=True))  # (the replay: alike)
    again = [lp.model_dump() for e in replay if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert again == streamed


def test_a_continued_message_lists_every_token_of_its_text(server):
    """An input that ends with an assistant message is continued: the reply's leading whitespace
    is its text (no hidden lead), so its entries spell the whole text, streamed alike."""
    client = sdk(server)
    ask = {**ASK, "input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}],
           "include": LOGPROBS}
    r = client.responses.create(**ask)
    part = r.output[0].content[0]
    assert part.text and _bytes(part.logprobs).decode("utf-8", "replace") == part.text
    events = list(client.responses.create(**ask, stream=True))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.model_dump() for lp in part.logprobs]


def test_none_without_the_include_and_a_follow_up_does_not_inherit_them(server):
    client = sdk(server)
    plain = client.responses.create(**ASK, top_logprobs=5)  # (as OpenAI's: top_logprobs alone returns none)
    assert plain.top_logprobs == 5 and plain.output[0].content[0].logprobs == []
    first = client.responses.create(**ASK, include=LOGPROBS)
    assert first.top_logprobs is None and first.output[0].content[0].logprobs
    assert all(e.top_logprobs == [] for e in first.output[0].content[0].logprobs)  # (top_logprobs 0)
    then = client.responses.create(**{**ASK, "input": "And the sky?"}, previous_response_id=first.id)
    assert then.output[0].content[0].text and then.output[0].content[0].logprobs == []


def test_they_validate_with_the_sdks_models(server):
    """A client that validates (pydantic's model_validate on the SDK's types) takes the entries,
    in the response and in its events."""
    import json

    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {**ASK, "include": LOGPROBS, "top_logprobs": 2}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = Response.model_validate(http.post("/v1/responses", json=body).json())
        streamed = http.post("/v1/responses", json={**body, "stream": True}).text
    assert len(r.output[0].content[0].logprobs[0].top_logprobs) == 2
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(line[6:])) for line in streamed.split("\n") if line.startswith("data: ")]
    assert events[-1].type == "response.incomplete"
    assert sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta") == r.usage.output_tokens


def test_a_response_continued_after_its_stop_string_leaves_the_stop_out(server):
    """A response that ended on its stop string ("\n\n", completed), continued through
    /v1/tasks: the stop string's tokens (never shown) stay out of its entries, which spell its
    text (they stood inside it, as tokens with no text)."""
    client = sdk(server)
    r = client.responses.create(model="m", input="Hello", extra_body={"seed": 17}, max_output_tokens=60,
                                include=LOGPROBS)
    assert r.status == "completed", "the seed no longer ends on the stop string: pick another"
    part = r.output[0].content[0]
    assert len(part.logprobs) < r.usage.output_tokens  # (the stop's tokens: left out)
    tid = "TASK_" + r.id.split("_", 1)[1]
    c = httpx.post(f"{server.url}/v1/tasks/{tid}/continue", json={"max_tokens": 6}, timeout=60)
    assert c.status_code == 200, c.text
    deadline = time.monotonic() + 30
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = got.output[0].content[0]
    assert after.text.startswith(part.text) and len(after.text) > len(part.text)
    spelled = _bytes(after.logprobs).decode("utf-8", "replace")
    assert spelled.lstrip() == after.text.lstrip(), (spelled, after.text)


def test_a_bad_top_logprobs_is_refused_naming_it(server):
    r = httpx.post(server.url + "/v1/responses", json={**ASK, "include": LOGPROBS, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_they_are_kept_in_memory_only(server):
    client = sdk(server)
    r = client.responses.create(**ASK, include=LOGPROBS)
    assert r.output[0].content[0].logprobs
    server.restart()  # (a graceful stop: the task's row is written)
    got = sdk(server).responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.output[0].content[0].logprobs == []


def _out(pieces: list[tuple[str, int]]) -> Output:
    out = Output(finished=False)
    for text, n in pieces:
        out.append(text, n)
    return out


def test_the_tokens_of_a_text_span():
    # "\n" (the hidden lead), " Hi" "," two tokens of one character (the first shows no text), "!" and
    # the stop token (no text)
    out = _out([("\n", 1), (" Hi", 1), (",", 1), ("", 1), ("é", 1), ("!", 1), ("", 1)])
    assert list(out.offsets) == [1, 4, 5, 5, 6, 7, 7]
    text = out.text.lstrip()  # " Hi,é!" less its lead: "Hi,é!" (starts at 2)
    assert out.text.find(text) == 2
    assert list(tokens_in(out, 2, len(out.text))) == [1, 2, 3, 4, 5]  # the lead's and the stop's left out
    assert list(tokens_in(out, 0, len(out.text))) == [0, 1, 2, 3, 4, 5]
    assert list(tokens_in(out, 1, 5)) == [1, 2]  # " Hi,": the character's tokens not yet
    assert list(tokens_in(out, 1, 6)) == [1, 2, 3, 4]
    assert list(tokens_in(out, 5, 6)) == [3, 4]  # the character's first token starts where its text is
    assert list(tokens_in(out, 0, 0)) == [] and list(tokens_in(Output(), 0, 3)) == []


def test_an_output_keeps_one_logprob_per_token_or_none():
    lp = [TokenLogprob(i, -0.5) for i in range(4)]
    out = Output(finished=False)
    out.append("ab", 2, lp[:2])
    out.append("", 0)  # (a final flush: text without a token)
    assert out.logprobs is not None and out.logprobs.slice(0, 9) == lp[:2]
    out.append("c", 1, lp[2:3])
    assert out.logprobs.slice(0, 3) == lp[:3] and len(out.logprobs) == len(out)
    out.append("d", 1)  # a run that computes none: the list ends
    assert out.logprobs is None
    out.append("e", 1, lp[3:])
    assert out.logprobs is None  # (never again for this output: it would not match its tokens)
    later = Output("xy", array("q", [1, 2]))  # read back from the database: none, and none begin
    later.append("z", 1, lp[:1])
    assert later.logprobs is None


def test_packed_logprobs_give_back_what_came():
    """float32 values come back exactly (they are float32 already); alternatives per token may
    differ in number (a continue with another top_logprobs)."""
    import torch

    vals = torch.randn(12).log_softmax(0).tolist()  # (doubles holding float32 values, as the engine's)
    lps = [TokenLogprob(7, vals[0], ((7, vals[0]), (3, vals[1]))), TokenLogprob(65535, vals[2]),
           TokenLogprob(0, vals[3], tuple((i, vals[4 + i]) for i in range(8)))]
    packed = TokenLogprobs(lps[:1])
    packed.extend(lps[1:])
    assert len(packed) == 3 and packed.slice(0, 3) == lps and packed.slice(1, 2) == lps[1:2]
    assert packed.slice(2, 99) == lps[2:] and packed.slice(3, 3) == []
    assert packed.nbytes == (3 + 1 + 9) * 8 + 3 * 8  # (entries: 8 bytes each; ends: 8 a token)


def _ended(budget: LogprobBudget, n: int) -> Output:
    out = Output(finished=False)
    out.append("x" * n, n, [TokenLogprob(1, -1.0)] * n)  # 16 bytes a token (k = 0)
    budget.ended(out)
    return out


def test_the_budget_lets_the_oldest_ended_outputs_logprobs_go():
    import gc

    budget = LogprobBudget(limit=16 * 100)
    a, b = _ended(budget, 40), _ended(budget, 40)
    assert budget.bytes == 16 * 80 and a.logprobs is not None
    c = _ended(budget, 40)  # over the limit: the oldest (a) lets its logprobs go
    assert a.logprobs is None and b.logprobs is not None and c.logprobs is not None and budget.bytes == 16 * 80
    budget.resumed(b)  # a continue of b runs: its logprobs are its run's, never let go meanwhile
    b.append("y" * 10, 10, [TokenLogprob(2, -2.0)] * 10)
    d = _ended(budget, 70)  # over the limit: c goes (b, running, is not held: it would have gone first)
    assert b.logprobs is not None and len(b.logprobs) == 50 and c.logprobs is None and budget.bytes == 16 * 70
    budget.ended(b)  # the continue ended: b counted anew, as the newest; d is the oldest, and goes
    assert b.logprobs is not None and d.logprobs is None and budget.bytes == 16 * 50
    big = _ended(budget, 200)  # one output alone over the limit keeps none, and takes none from the others
    assert big.logprobs is None and b.logprobs is not None and budget.bytes == 16 * 50
    del b
    gc.collect()
    assert budget.bytes == 0  # an output let go of (its task left memory) no longer counts


def test_forks_and_templates_through_the_task_api_do_not_compute_them(server):
    client = sdk(server)
    r = client.responses.create(**ASK, include=LOGPROBS, top_logprobs=20)
    tid = "TASK_" + r.id.split("_", 1)[1]
    fork = httpx.post(f"{server.url}/v1/tasks/{tid}/fork", json={"prompt": " more", "max_tokens": 2}).json()
    tpl = httpx.post(f"{server.url}/v1/tasks/{tid}/as_template", params={"name": "from_a_response"})
    assert tpl.status_code == 200, tpl.text
    server.restart()  # (every row written)
    params = {t: orjson.loads(committed_row(server.db, t)["params"])
              for t in (tid, fork["task_id"], tpl.json()["task_id"])}
    assert params[tid]["logprobs"] == 20
    assert "logprobs" not in params[fork["task_id"]] and "logprobs" not in params[tpl.json()["task_id"]], params


def test_a_continue_hides_the_tokens_its_stop_never_showed():
    lp = [TokenLogprob(i, -0.5 * i) for i in range(6)]  # (float32 values, as the engine gives)
    out = Output(finished=False)
    for i, text in enumerate(["Hi", "!", "", ""]):  # (the last two: the stop string's, no text)
        out.append(text, 1, lp[i : i + 1])
    out.hide_unshown()
    out.append(" More", 1, lp[4:5])  # the continue's text comes after them
    out.append(".", 1, lp[5:6])
    assert out.logprobs.slice(0, 6) == [lp[0], lp[1], lp[4], lp[5]]
    assert logprobs_of(out, tokens_in(out, 0, len(out.text))) == [lp[0], lp[1], lp[4], lp[5]]
    assert logprobs_of(out, range(2, 5)) == [lp[4]]  # (a stream's slice alike)


@pytest.mark.parametrize("bad", [-1, 21, "3", True, 2.0])
def test_the_logprobs_parameter_is_checked(bad):
    with pytest.raises(TaskInvalid) as exc:
        clean_params({"logprobs": bad}, 65536)
    assert exc.value.param == "logprobs"


def test_the_logprobs_parameter_reaches_the_run():
    assert sampling_params(clean_params({"logprobs": 4}, 65536), 16).logprobs == 4
    assert sampling_params(clean_params({}, 65536), 16).logprobs is None
