"""rwkv_lightning's credential on our API keys, through a real server with keys: the body's
`password` or `Authorization: Bearer`; no lightning route is open; sessions live under the
caller's key; a wrong password changes nothing."""

from __future__ import annotations

import httpx
import pytest
from util_lightning import GREEDY, idle, metric, post_escaped
from util_server import server_fixture

from server.api.lightning.errors import UNAUTHORIZED
from server.api.lightning.paths import BODY_KEY_PATHS
from server.tokenizer import get_tokenizer

# No conversation cache: a background repair of an OpenAI-style reply would show as a running
# sequence to the idle check of a later route.
server = server_fixture(env={"RWKV_API_KEYS": "k1,k2", "RWKV_CONVERSATION_CACHE_BYTES": "0"})
CHEAP = {"max_tokens": 1, **GREEDY}
BODIES = {  # a cheap, valid request of each lightning POST route (lightning's documented fields)
    "/v1/chat/completions": {"contents": ["hi"], **CHEAP},
    "/v2/chat/completions": {"contents": ["hi"], **CHEAP},
    "/translate/v1/batch-translate": {"target_lang": "en", "text_list": ["hi"], "max_tokens": 1},
    "/FIM/v1/batch-FIM": {"prefix": ["a"], "suffix": ["b"], **CHEAP},
    "/big_batch/completions": {"contents": ["hi"], "max_tokens": 1},
    "/state/chat/completions": {"session_id": "auth-s", "contents": ["hi"], **CHEAP},
    "/multi_state/chat/completions": {"session_id": "auth-m", "dialogue_idx": 0, "contents": ["hi"], **CHEAP},
    "/state/status": {},
    "/state/delete": {"session_id": "auth-none", "delete_prefix": True},
    "/openai/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], **CHEAP},
}


@pytest.fixture(scope="module")
def c(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_every_lightning_post_route_is_listed():
    assert set(BODIES) == BODY_KEY_PATHS


@pytest.mark.parametrize("path", sorted(BODIES))
def test_no_route_is_open_and_both_credentials_work(c, path):
    body = BODIES[path]
    tokens = metric(c, "rwkv_prompt_tokens_total")
    for bad in ({}, {"password": "wrong"}):
        r = c.post(path, json={**body, **bad})
        assert r.status_code == 401, (path, r.text)
        assert r.json() == {"error": UNAUTHORIZED}
    r = c.post(path, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    idle(c)
    assert metric(c, "rwkv_prompt_tokens_total") == tokens  # refused before anything ran
    ok = c.post(path, json={**body, "password": "k1"})
    assert ok.status_code == 200, (path, ok.text)
    ok = c.post(path, json=body, headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200, (path, ok.text)


def test_the_openai_body_still_needs_the_header(c):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k2"}).status_code == 200


def test_models_routes_need_a_key(c):
    for bad in ({}, {"Authorization": "Bearer nope"}):  # lightning's route: lightning's 401
        r = c.get("/openai/v1/models", headers=bad)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized: invalid or missing password"})
    assert c.get("/v1/models").json()["error"]["code"] == "invalid_api_key"  # ours: our shape
    r = c.get("/openai/v1/models", headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.json()["object"] == "list"


def test_sessions_live_under_the_callers_key(c):
    k1, k2 = {"password": "k1"}, {"password": "k2"}

    def names(key: dict) -> set[str]:
        return {s["session_id"] for s in c.post("/state/status", json=key).json()["sessions"]}

    r = c.post("/state/chat/completions", json={"session_id": "mine", "contents": ["hi"], **CHEAP, **k1})
    assert r.status_code == 200
    r = c.post("/multi_state/chat/completions", json={"session_id": "tree", "dialogue_idx": 0, "contents": ["hi"],
                                                      **CHEAP, **k1})
    assert r.json()["dialogue_idx"] == 1
    assert {"mine", "tree:1"} <= names(k1) and not {"mine", "tree:1"} & names(k2)
    r = c.post("/multi_state/chat/completions", json={"session_id": "tree", "dialogue_idx": 1, "contents": ["x"],
                                                      **CHEAP, **k2})
    assert r.status_code == 404  # another key's node does not exist for k2
    assert c.post("/state/delete", json={"session_id": "mine", **k2}).status_code == 404
    wrong = c.post("/state/delete", json={"session_id": "mine", "password": "nope"})
    assert wrong.status_code == 401
    assert "mine" in names(k1)  # neither k2 nor a wrong password removed it
    tokens = metric(c, "rwkv_prompt_tokens_total")
    r = c.post("/state/chat/completions", json={"session_id": "mine", "contents": ["hi"], **CHEAP, **k2})
    assert r.status_code == 200  # k2's own "mine": a new session from the zero state
    assert metric(c, "rwkv_prompt_tokens_total") - tokens == len(get_tokenizer().encode("hi"))  # nothing of k1's


# --- the credential comes first: no key, a 401 whatever the body; with a key, the body's checks ---
KEYLESS_BAD = {  # bodies that fail the route's own checks
    "a field of the wrong type": {"contents": "x", "max_tokens": "many"},
    "a field out of range": {"contents": ["x"], "temperature": 99},
    "a lone surrogate": {"contents": ["x"], "model": "m\ud800", "session_id": "s\ud800"},
    "no JSON object": [1, 2],
}
LIGHTNINGS_OWN = sorted(BODIES.keys() - {"/v1/chat/completions"})


@pytest.mark.parametrize("path", [*LIGHTNINGS_OWN, "/v1/chat/completions"])
def test_a_keyless_bad_body_is_a_401(c, path):
    def unauthorized(r: httpx.Response, why: str, lightnings: bool = True) -> None:
        assert r.status_code == 401, (why, r.text)
        if lightnings or path != "/v1/chat/completions":  # (not lightning's body there: the OpenAI 401)
            assert r.json() == {"error": UNAUTHORIZED}, (why, r.text)

    for why, body in KEYLESS_BAD.items():
        unauthorized(post_escaped(c, path, body), why, isinstance(body, dict))
        if isinstance(body, dict):
            unauthorized(post_escaped(c, path, {**body, "password": "wrong"}), why)
    r = c.post(path, content=b'{"password": "k1", ', headers={"content-type": "application/json"})
    unauthorized(r, "not JSON: no password in it", False)
    idle(c)


@pytest.mark.parametrize("path", ["/v2/chat/completions", "/state/chat/completions", "/translate/v1/batch-translate"])
def test_with_a_key_the_body_is_checked(c, path):
    for key in ({"password": "k1"}, {}):
        headers = {} if key else {"Authorization": "Bearer k2"}
        r = post_escaped(c, path, {"contents": "x", "text_list": "x", "target_lang": 1, **key}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        echoed = "source_lang" if "translate" in path else "model"  # a field the answer repeats
        r = post_escaped(c, path, {**BODIES[path], echoed: "m\ud800", **key}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == echoed, r.text
    idle(c)
