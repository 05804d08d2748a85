"""rwkv_lightning's batch routes through a real server (tiny model): lightning's request bodies
from its document, its JSON and SSE shapes, prompt order, [DONE], and its bad input."""

from __future__ import annotations

import math

import httpx
import pytest
from util_lightning import GREEDY, idle, metric, sse, texts_by_index
from util_server import server_fixture

from server.tokenizer import get_tokenizer

# No conversation cache: its background repair of an OpenAI-style reply would show as a running
# sequence to the idle checks after refused requests.
server = server_fixture(env={"RWKV_MAX_BATCH": "64", "RWKV_CONVERSATION_CACHE_BYTES": "0"})
PROMPTS = ["User: What is the capital of France?\n\nAssistant: <think>\n</think>\n",
           "User: Count to three.\n\nAssistant:", "Once upon a time"]


@pytest.fixture(scope="module")
def c(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def one(c: httpx.Client, prompt: str, path: str = "/v1/chat/completions", **kw) -> str:
    r = c.post(path, json={"contents": [prompt], **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_v1_contents_answers_one_choice_per_prompt_in_order(c):
    r = c.post("/v1/chat/completions", json={"model": "my-label", "contents": PROMPTS, "max_tokens": 6,
                                             "pad_zero": True, "noise": 1.5, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "model", "choices"}
    assert (body["id"], body["object"], body["model"]) == ("rwkv7-batch", "chat.completion", "my-label")
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    for ch in body["choices"]:
        assert ch["message"]["role"] == "assistant" and ch["finish_reason"] == "length"
    # choice i is prompt i's answer: each prompt alone gives the same greedy text
    for i, prompt in enumerate(PROMPTS):
        assert one(c, prompt, max_tokens=6, **GREEDY) == body["choices"][i]["message"]["content"]


def test_v1_contents_stream_native_chunks_chunk_size_and_done(c):
    full = c.post("/v1/chat/completions", json={"contents": PROMPTS[:2], "max_tokens": 7, **GREEDY}).json()
    r = c.post("/v1/chat/completions", json={"contents": PROMPTS[:2], "max_tokens": 7, "stream": True,
                                             "chunk_size": 3, **GREEDY})
    events = sse(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    for ev in chunks:  # lightning's chunk: no id, model or finish_reason
        assert set(ev) == {"object", "choices"} and ev["object"] == "chat.completion.chunk"
        (ch,) = ev["choices"]
        assert set(ch) == {"index", "delta"} and set(ch["delta"]) == {"content"} and ch["delta"]["content"]
    got = texts_by_index(chunks)
    assert got == {i: ch["message"]["content"] for i, ch in enumerate(full["choices"])}
    for i in (0, 1):  # a flush per 3 tokens (and one at the end): at most ceil(7 / 3) events per prompt
        n = sum(1 for ev in chunks if ev["choices"][0]["index"] == i)
        assert 1 <= n <= math.ceil(7 / 3)


def test_v2_route_and_its_id(c):
    r = c.post("/v2/chat/completions", json={"contents": PROMPTS[:2], "max_tokens": 4, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "rwkv7-batch-v2" and len(r.json()["choices"]) == 2
    assert texts_by_index(sse(c.post("/v2/chat/completions", json={"contents": ["x"], "max_tokens": 3,
                                                                   "stream": True})))


def test_a_messages_body_stays_openai(c):
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("chatcmpl-") and "usage" in r.json()
    both = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "contents": ["x"]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "contents"  # OpenAI: unknown field


def test_fim_pairs_prefix_and_suffix_by_position(c):
    prefix, suffix = ["def add(a, b):\n    return ", "x = "], ["\n\nprint(add(1, 2))", "\nprint(x)"]
    r = c.post("/FIM/v1/batch-FIM", json={"prefix": prefix, "suffix": suffix, "max_tokens": 5,
                                          "stop_tokens": ["\n"], **{k: v for k, v in GREEDY.items() if k != "stop_tokens"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["object"]) == ("rwkv7-batch", "FIM.completion")
    for i, (p, s) in enumerate(zip(prefix, suffix, strict=True)):  # stop_tokens does not apply to FIM
        assert body["choices"][i]["message"]["content"] == one(c, f"✿prefix✿✿suffix✿{s}✿middle✿{p}", max_tokens=5,
                                                                **GREEDY)
    events = sse(c.post("/FIM/v1/batch-FIM", json={"prefix": prefix, "suffix": suffix, "max_tokens": 5,
                                                   "stream": True, **GREEDY}))
    assert events[-1] == "[DONE]" and set(texts_by_index(events)) <= {0, 1}


def test_translate_answers_in_text_list_order(c):
    r = c.post("/translate/v1/batch-translate", json={"source_lang": "auto", "target_lang": "zh-CN",
                                                      "text_list": ["Hello", "Good night"], "max_tokens": 6})
    assert r.status_code == 200, r.text
    out = r.json()["translations"]
    assert [t["detected_source_lang"] for t in out] == ["en", "en"]
    for t, text in zip(out, ["Hello", "Good night"], strict=True):  # greedy, no penalties, no stop strings
        plain = one(c, f"auto: {text}\n\nChinese:", max_tokens=6, alpha_presence=0, alpha_frequency=0, **GREEDY)
        assert t["text"] == plain.strip()
    r = c.post("/translate/v1/batch-translate", json={"source_lang": "ja", "target_lang": "en",
                                                      "text_list": ["こんにちは"], "max_tokens": 3})
    assert r.json()["translations"][0]["detected_source_lang"] == "ja"


def test_translate_of_no_text_is_an_empty_list_as_on_lightning(c):
    r = c.post("/translate/v1/batch-translate", json={"target_lang": "en", "text_list": []})
    assert (r.status_code, r.json()) == (200, {"translations": []}), r.text


def test_translate_names_the_languages_lightning_names(c):
    # lightning names eight codes in its prompt (zh-CN, zh-TW, en, ja, fr, de, es, ru) and writes any
    # other code as given: the same request makes the same prompt, so the same greedy answer
    plain = {"max_tokens": 4, "alpha_presence": 0, "alpha_frequency": 0, **GREEDY}
    for src, tgt, prompt in (("it", "ko", "it: Hello\n\nko:"), ("pt", "ar", "pt: Hello\n\nar:"),
                             ("vi", "th", "vi: Hello\n\nth:"), ("ru", "fr", "Russian: Hello\n\nFrench:")):
        r = c.post("/translate/v1/batch-translate", json={"source_lang": src, "target_lang": tgt,
                                                          "text_list": ["Hello"], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["translations"][0]["text"] == one(c, prompt, **plain).strip(), (src, tgt)


def test_big_batch_always_streams(c):
    prompts = [f"Item {i}:" for i in range(20)]
    events = sse(c.post("/big_batch/completions", json={"contents": prompts, "max_tokens": 4, "stream": False,
                                                        "temperature": 0, "stop_tokens": [], "ignore_eos": True}))
    assert events[-1] == "[DONE]"
    got = texts_by_index(events[:-1])
    assert set(got) == set(range(20))
    for i in (0, 7, 19):  # temperature is its only sampling field: no penalties
        assert got[i] == one(c, prompts[i], max_tokens=4, alpha_presence=0, alpha_frequency=0, **GREEDY)


def test_openai_style_route_json_and_stream(c, server):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "More"}]}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "stop_tokens": [], "ignore_eos": True}
    r = c.post("/openai/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["id"].startswith("chatcmpl-") and full["object"] == "chat.completion"
    assert full["model"] == "synthetic:tiny" and isinstance(full["created"], int)
    (ch,) = full["choices"]
    assert ch["index"] == 0 and ch["message"]["role"] == "assistant" and ch["finish_reason"] == "length"
    tok = get_tokenizer()
    want = len(tok.encode("System: You are terse.\n\n")) + len(
        tok.encode("User: Hi\n\nAssistant: Hello.\n\nUser: More\n\nAssistant: <think>\n</think>\n"))
    assert full["usage"] == {"prompt_tokens": want, "completion_tokens": 5, "total_tokens": want + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # ours: OpenAI's cache field
    events = sse(c.post("/openai/v1/chat/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == chunks[0]["id"] and "usage" not in e
               for e in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == ch["message"]["content"]


def test_use_prefix_cache_takes_the_system_block_from_the_chat_prefix_cache(c):
    system = "You answer in exactly one short sentence, lighthouse keeper style."
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0, "stop_tokens": [], "ignore_eos": True}
    entries = 'rwkv_state_cache_entries{tier="prefix"}'
    before = metric(c, entries)
    off = c.post("/openai/v1/chat/completions", json={**body, "use_prefix_cache": False}).json()
    assert metric(c, entries) == before
    on = c.post("/openai/v1/chat/completions", json=body).json()
    assert metric(c, entries) == before + 1
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert on["usage"] == off["usage"]  # (its first use prefilled the block: nothing was cached)
    again = c.post("/openai/v1/chat/completions", json=body).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["usage"]["prompt_tokens"] and again["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"]
    no_system = {**body, "messages": body["messages"][1:]}  # no system block: nothing kept for it
    r = c.post("/openai/v1/chat/completions", json=no_system)
    assert r.status_code == 200 and metric(c, entries) == before + 1, r.text


def test_openai_style_models_and_empty_prompt(c):
    # lightning's card (its document: owned_by is always "rwkv_lightning"), our model's id
    model_id = c.get("/v1/models").json()["data"][0]["id"]
    assert c.get("/openai/v1/models").json() == {
        "object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "rwkv_lightning"}]}
    r = c.post("/openai/v1/chat/completions", json={"messages": [{"role": "user", "content": "  \n "}]})
    assert r.status_code == 400 and r.json() == {"error": "Empty prompt"}


# --- bad input: a clear 4xx, nothing else changes ------------------------------------------------
def refused(c: httpx.Client, path: str, body: dict, status: int = 400) -> dict:
    prompt_tokens = metric(c, "rwkv_prompt_tokens_total")
    r = c.post(path, json=body)
    assert r.status_code == status, r.text
    idle(c)
    assert metric(c, "rwkv_prompt_tokens_total") == prompt_tokens  # nothing was submitted
    return r.json()


def test_empty_contents(c):
    assert refused(c, "/v1/chat/completions", {"contents": []}) == {"error": "'contents' must hold at least one prompt"}
    assert "error" in refused(c, "/big_batch/completions", {"contents": []})
    assert refused(c, "/v2/chat/completions", {"contents": ["ok", ""]})["error"] == "'contents[1]' is an empty prompt"


def test_ten_thousand_contents_exceed_the_queue(c):
    e = refused(c, "/v1/chat/completions", {"contents": ["x"] * 10_000, "max_tokens": 1})
    assert e["error"] == "bsz overflow, Max bsz=4096", "lightning's text exactly (clients match it)"
    assert (e["request_bsz"], e["max_bsz"]) == (10_000, 4096)


def test_mismatched_prefix_and_suffix(c):
    e = refused(c, "/FIM/v1/batch-FIM", {"prefix": ["a", "b", "c"], "suffix": ["x", "y"]})
    assert e == {"error": "prefix and suffix are paired by position: got 3 prefixes and 2 suffixes"}
    refused(c, "/FIM/v1/batch-FIM", {"prefix": [], "suffix": []})


def test_bad_fields_are_named(c):
    e = refused(c, "/v1/chat/completions", {"contents": ["x"], "temperature": 99})
    assert e["error"]["param"] == "temperature"
    e = refused(c, "/v1/chat/completions", {"contents": ["x"], "stop_tokens": ["x" * 257]})  # ours: 256 at most
    assert e["error"]["param"] == "stop_tokens" and "'stop_tokens'" in e["error"]["message"]
    e = refused(c, "/v1/chat/completions", {"contents": "not a list"})
    assert e["error"]["param"] == "contents"
    refused(c, "/translate/v1/batch-translate", {"text_list": ["x"]})  # target_lang is required


# --- lightning's lenient values ------------------------------------------------------------------
def test_empty_stop_strings_are_dropped_as_on_lightning(c):
    want = one(c, PROMPTS[0], max_tokens=6, **GREEDY)
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for stops in ([""], [""] * 20, ["", "\u2603\u2603\u2603"]):  # 20 empty strings: none counts toward the 16
        assert one(c, PROMPTS[0], stop_tokens=stops, **greedy) == want
        assert one(c, PROMPTS[0], "/v2/chat/completions", stop_tokens=stops, max_tokens=2) is not None
        events = sse(c.post("/big_batch/completions", json={"contents": PROMPTS[:1], "stop_tokens": stops, **greedy}))
        assert texts_by_index(events) == {0: want}
        r = c.post("/openai/v1/chat/completions", json={"contents": ["hi"], "max_tokens": 2, "stop_tokens": stops})
        assert r.status_code == 200, r.text


def _flushes(events: list) -> int:
    return sum(1 for ev in events if isinstance(ev, dict) and ev.get("object") == "chat.completion.chunk")


def test_chunk_size_zero_flushes_every_token_and_a_large_one_once(c):
    body = {"contents": PROMPTS[:2], "max_tokens": 7, "stream": True, **GREEDY}
    want = {i: ch["message"]["content"] for i, ch in enumerate(
        c.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"])}
    # lightning's batch stream: every token at 0 (and below), i.e. chunk_size 1 (test_lightning_parts
    # checks the rule); how many flushes that makes depends on how many tokens each stream wake-up
    # finds (two tokens read at once go out together), so only the bounds are fixed here
    for size in (0, -3):
        events = sse(c.post("/v1/chat/completions", json={**body, "chunk_size": size}))
        assert texts_by_index(events) == want and 2 <= _flushes(events) <= 14
    for size in (4097, 10**9):  # no upper bound: one flush per prompt, at its end
        events = sse(c.post("/v1/chat/completions", json={**body, "chunk_size": size}))
        assert texts_by_index(events) == want and _flushes(events) == 2
    events = sse(c.post("/big_batch/completions", json={**body, "chunk_size": 0}))
    assert texts_by_index(events) == want

    def contents(size: int) -> list[str]:  # the content chunks of the OpenAI-style stream
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True, "chunk_size": size,
                **GREEDY}
        chunks = sse(c.post("/openai/v1/chat/completions", json=chat))[:-1]
        return [e["choices"][0]["delta"]["content"] for e in chunks if "content" in e["choices"][0]["delta"]]

    one = "".join(contents(1))
    assert "".join(contents(0)) == one and len(contents(10**6)) == 1 and contents(10**6) == [one]
