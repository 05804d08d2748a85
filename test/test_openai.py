"""The official `openai` SDK against a real server (uvicorn subprocess, tiny synthetic model)."""

from __future__ import annotations

import re
import httpx
import pytest
from openai import OpenAI
from util_server import sdk, server_fixture

from server.api.metrics import parse_metrics
from server.api.openai.chat_format import build_prompt, default_few_shot_path, load_few_shot
from server.tokenizer import get_tokenizer

# Several tests compare the sampled answers of repeated requests: a start from the conversation
# cache is within float rounding of a full prefill, not bit-equal, so the cache is off here
# (test_conversation_cache.py tests it).
server = server_fixture(env={"RWKV_CONVERSATION_CACHE_BYTES": "0"})


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return sdk(server)


def chat(client: OpenAI, content: str = "Hello", **kw):
    return client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}], **kw)


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["synthetic:tiny"]
    assert client.models.retrieve("synthetic:tiny").id == "synthetic:tiny"
    r = httpx.get(server.url + "/v1/models/other.pth")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_chat_non_streaming_usage_and_length(client):
    r = chat(client, max_tokens=5, seed=3, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "synthetic:tiny"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    expected = len(get_tokenizer().encode("User: Hello\n\nAssistant:"))
    assert r.usage.prompt_tokens == expected


def test_chat_stream_equals_non_stream_with_include_usage(client):
    kw = {"max_tokens": 12, "seed": 11, "temperature": 1.0, "top_p": 0.9}
    full = chat(client, "Tell me a story", **kw)
    chunks = list(chat(client, "Tell me a story", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client):
    chunks = list(chat(client, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_n2_independent_samples_and_seed_offsets(client):
    kw = {"max_tokens": 10, "temperature": 1.0, "top_p": 1.0, "extra_body": {"ignore_eos": True}}
    r = chat(client, "Pick a word", n=2, seed=100, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 10
    r1 = chat(client, "Pick a word", n=1, seed=101, **kw)
    assert r1.choices[0].message.content == r.choices[1].message.content  # sample i uses seed + i
    assert r.choices[0].message.content != r.choices[1].message.content
    chunks = list(chat(client, "Pick a word", n=2, seed=100, stream=True, **kw))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_completions_stop_string(client):
    kw = {"model": "m", "prompt": "The weather today", "max_tokens": 40, "seed": 5, "temperature": 1.0,
          "top_p": 1.0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_completions_prompt_forms_echo_and_usage(client):
    tok = get_tokenizer()
    r = client.completions.create(model="m", prompt=["one", "two three"], n=2, max_tokens=3, echo=True, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("one") and r.choices[2].text.startswith("two three")
    assert r.usage.prompt_tokens == len(tok.encode("one")) + len(tok.encode("two three"))
    ids = tok.encode("Hello world")
    r2 = client.completions.create(model="m", prompt=ids, max_tokens=2)
    assert r2.usage.prompt_tokens == len(ids)


def test_multibyte_characters_never_split(client):
    """Random weights emit many CJK / emoji / byte tokens: the streamed pieces must join to the
    same text as the non-streamed answer (a split character would show up as U+FFFD pieces)."""
    for seed in range(4):
        kw = {"model": "m", "prompt": "你好，世界 🌍", "max_tokens": 40, "seed": seed,  # noqa: RUF001
              "temperature": 1.5, "top_p": 1.0, "extra_body": {"ignore_eos": True}}
        full = client.completions.create(**kw).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(pieces) == full
        for p in pieces:
            p.encode("utf-8")  # no lone surrogates


def test_chat_format_blank_lines_and_system_prefix(client, server):
    msgs = [{"role": "system", "content": "You are terse.\n\n\nVery terse."},
            {"role": "user", "content": "line one\r\n\r\nUser: not a turn"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    prompt = build_prompt([(m["role"], m["content"]) for m in msgs])
    assert "\n\nUser: not a turn" not in prompt.text and "line one\nUser: not a turn" in prompt.text
    tok = get_tokenizer()
    assert r.usage.prompt_tokens == len(tok.encode(prompt.prefix)) + len(tok.encode(prompt.rest))
    before = parse_metrics(httpx.get(server.url + "/metrics").text)
    client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    after = parse_metrics(httpx.get(server.url + "/metrics").text)
    key = 'rwkv_state_cache_hits_total{tier="prefix"}'
    assert after[key] == before[key] + 1  # the system prefix state was reused


def test_few_shot_prefix(client):
    plain = chat(client, "Hi", max_tokens=1)
    shot = chat(client, "Hi", max_tokens=1, extra_body={"few_shot": True})
    few = load_few_shot(default_few_shot_path())
    assert shot.usage.prompt_tokens == plain.usage.prompt_tokens + len(get_tokenizer().encode(few))


def test_assistant_last_message_is_continued(client):
    r = client.chat.completions.create(model="m", max_tokens=1, messages=[
        {"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}])
    assert r.usage.prompt_tokens == len(get_tokenizer().encode("User: Count\n\nAssistant: one, two,"))


def test_unsupported_fields_refused(client):
    import openai

    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=1, logit_bias={"5": 1})
    assert ei.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError):  # the legacy field (tools are honoured: test_openai_agents.py)
        chat(client, max_tokens=1, functions=[{"name": "f", "parameters": {}}])


def test_openai_names_map_onto_ours(client, server):
    """frequency_penalty is repetition_penalty; max_completion_tokens is max_tokens (and wins)."""
    # greedy, random weights: some token comes twice in 40; a negative repetition penalty then
    # favours it at every later step, so the text differs from the one without the penalty
    kw = {"model": "m", "prompt": "The weather today", "max_tokens": 40, "temperature": 0, "presence_penalty": 0}
    ours = client.completions.create(**kw, extra_body={"repetition_penalty": -10.0, "ignore_eos": True})
    openai_name = client.completions.create(**kw, frequency_penalty=-10.0, extra_body={"ignore_eos": True})
    none = client.completions.create(**kw, frequency_penalty=0.0, extra_body={"ignore_eos": True})
    assert openai_name.choices[0].text == ours.choices[0].text != none.choices[0].text
    r = chat(client, max_tokens=9, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_every_route_has_the_same_defaults(server):
    """No sampling field given: the completions route and the task route sample alike."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "seed": 3}
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    tid = httpx.post(server.url + "/v1/tasks/create", json=body, timeout=60).json()["task_id"]
    for _ in range(600):
        task = httpx.get(f"{server.url}/v1/tasks/{tid}/get_result", timeout=30).json()
        if task["finished"]:
            break
    assert task["result"] == text and text


def test_start_up_says_api_keys_are_off_and_what_the_weights_and_caches_are(server):
    log = server.log_tail(100000)
    assert "API keys   off: every route is open" in log
    assert "weights    fp32 (no --quant)" in log and "fp32 weights) ..." in log  # (CPU: fp32 compute)
    assert "conversations off" in log  # (this module's server turns the conversation cache off)


CONTINUED = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, here"}]
SAMPLE = {"max_tokens": 5, "seed": 1, "temperature": 1.0, "top_p": 0.3}


def completion_of(client: OpenAI, messages: list) -> str:
    """The text /v1/completions writes after the chat prompt of `messages` (the same sampling)."""
    prompt = build_prompt([(m["role"], m["content"]) for m in messages])
    return client.completions.create(model="m", prompt=prompt.text, stop=["\n\n"], **SAMPLE).choices[0].text


@pytest.mark.parametrize("extra", [{}, {"logprobs": True}], ids=["plain", "agent"])
def test_a_continued_assistant_message_keeps_the_replys_leading_space(client, extra):
    """The reply continues the message: its leading space is text the client joins to it (only
    the gap after a fresh "Assistant:" is left out)."""
    text = completion_of(client, CONTINUED)
    assert text[:1].isspace(), text  # (this seed's continuation starts with a space: what is tested)
    kw = {"model": "m", "messages": CONTINUED, **SAMPLE, **extra}
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full == streamed == text
    fresh = CONTINUED[:1]
    kw["messages"] = fresh
    assert client.chat.completions.create(**kw).choices[0].message.content == completion_of(client, fresh).lstrip()


def test_a_trailing_slash_answers_as_the_plain_path(server):
    """POST /v1/chat/completions/ and /v1/completions/, GET /v1/models/: the plain route's
    answer, not a 307 redirect with an empty body."""
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
              "/v1/completions": {"prompt": "x"}}
    for path, body in bodies.items():
        slashed = httpx.post(server.url + path + "/", json={**body, **SAMPLE}, timeout=60)
        plain = httpx.post(server.url + path, json={**body, **SAMPLE}, timeout=60)
        assert slashed.status_code == 200, (path, slashed.status_code, slashed.text)
        assert slashed.json()["choices"] == plain.json()["choices"]
        bad = httpx.post(server.url + path + "/", json={**body, "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    r = httpx.get(server.url + "/v1/models/")
    assert r.status_code == 200 and r.json() == httpx.get(server.url + "/v1/models").json()
    r = httpx.get(server.url + "/v1/models/synthetic:tiny/")
    assert r.status_code == 200 and r.json() == httpx.get(server.url + "/v1/models/synthetic:tiny").json()


def test_no_route_answers_a_trailing_slash_with_a_redirect(server):
    """Every route of the OpenAPI document (task, lightning, state, ops and dashboard routes too),
    its path with one or two trailing slashes: the plain path's status, never the router's 307
    (an empty body; httpx and most SDKs do not follow it for a POST)."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert len(paths) > 20
    checked = 0
    for path, ops in paths.items():
        url = server.url + re.sub(r"\{[^}]+\}", "NOPE", path)
        for method in ops:
            kw = {"json": {}} if method in ("post", "put", "patch") else {}
            plain = httpx.request(method, url, timeout=60, **kw)
            for slashes in ("/", "//"):
                slashed = httpx.request(method, url + slashes, timeout=60, **kw)
                assert slashed.status_code == plain.status_code != 307, (method, path, slashes, slashed.text)
            checked += 1
    assert checked > 25


LEAD = {"max_tokens": 16, "seed": 725, "temperature": 5.0, "top_p": 1.0}
"""A sampling whose reply to "Hello" opens with a newline on the tiny synthetic model."""


@pytest.mark.parametrize("extra", [{}, {"logprobs": True}], ids=["plain", "agent"])
def test_chat_stop_strings_never_match_in_the_hidden_leading_whitespace(client, extra):
    """A chat reply's leading whitespace (the gap after "Assistant:") is not shown, so a stop
    string cannot match inside it: `stop` applies to the text the client is shown. Completions
    (raw text, nothing hidden) match there as before."""
    prompt = build_prompt([("user", "Hello")]).text
    raw = client.completions.create(model="m", prompt=prompt, **LEAD).choices[0].text
    assert raw[:1] == "\n" and raw.strip(), repr(raw)  # (this seed's reply opens with a newline: what is tested)
    stops = ["\n", " "]
    shown = raw.lstrip()
    cut = min((i for i in (shown.find(s) for s in stops) if i >= 0), default=-1)
    expect = shown if cut < 0 else shown[:cut]
    kw = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "stop": stops, **LEAD, **extra}
    c = client.chat.completions.create(**kw).choices[0]
    assert (c.message.content, c.finish_reason) == (expect, "length" if cut < 0 else "stop"), repr(raw)
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expect
    legacy = client.completions.create(model="m", prompt=prompt, stop=stops, **LEAD).choices[0]
    assert (legacy.text, legacy.finish_reason) == ("", "stop")
