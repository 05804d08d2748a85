"""Text the lightning routes cannot use, through a real server: a string that is not valid UTF-8
(a lone surrogate, which JSON's "\\ud800" escape carries) is a 400 naming the field before
anything runs, on every route and in every string field (before, an echoed one failed the answer
with a 500 after the run, a prompt was rewritten with U+FFFD, a session route answered the task
API's 422); and the session routes' task-layer errors take lightning's statuses."""

from __future__ import annotations

import httpx
import pytest
from util_lightning import GREEDY, idle, metric, post_escaped
from util_server import server_fixture

from server.api.errors import ApiError
from server.api.lightning.state_routes import _tasks
from server.tasks.errors import TaskConflict, TaskInvalid

server = server_fixture(env={"RWKV_CONVERSATION_CACHE_BYTES": "0"})
BAD = "x\ud800y"
CHEAP = {"max_tokens": 2, **GREEDY}
V1 = {"contents": ["a"], **CHEAP}
FIM = {"prefix": ["a"], "suffix": ["b"], **CHEAP}
TRANSLATE = {"target_lang": "en", "text_list": ["hi"], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], **CHEAP}
STATE = {"session_id": "txt", "contents": ["a"], **CHEAP}
MULTI = {"session_id": "msur", "dialogue_idx": 0, "contents": ["a"], **CHEAP}
SETUP = {
    "/state/chat/completions": ("/state/chat/completions", STATE),
    "/state/delete": ("/state/chat/completions", STATE),
    "/multi_state/chat/completions": ("/multi_state/chat/completions", MULTI),
}
CASES = [  # (path, a valid body, the field given BAD, how the error names it)
    ("/v1/chat/completions", V1, "model", "model"),
    ("/v1/chat/completions", V1, "contents", "contents"),
    ("/v2/chat/completions", V1, "model", "model"),
    ("/v2/chat/completions", V1, "contents", "contents"),
    ("/v2/chat/completions", V1, "stop_tokens", "stop_tokens"),
    ("/FIM/v1/batch-FIM", FIM, "model", "model"),
    ("/FIM/v1/batch-FIM", FIM, "prefix", "prefix"),
    ("/FIM/v1/batch-FIM", FIM, "suffix", "suffix"),
    ("/translate/v1/batch-translate", TRANSLATE, "source_lang", "source_lang"),
    ("/translate/v1/batch-translate", TRANSLATE, "target_lang", "target_lang"),
    ("/translate/v1/batch-translate", TRANSLATE, "text_list", "text_list"),
    ("/big_batch/completions", {"contents": ["a"], "max_tokens": 2}, "contents", "contents"),
    ("/openai/v1/chat/completions", CHAT, "contents", "contents"),
    ("/openai/v1/chat/completions", CHAT, "system", "system"),
    ("/openai/v1/chat/completions", CHAT, "model", "model"),
    ("/openai/v1/chat/completions", CHAT, "messages", "messages[0].content"),
    ("/state/chat/completions", STATE, "model", "model"),
    ("/state/chat/completions", STATE, "contents", "contents"),
    ("/state/chat/completions", STATE, "session_id", "session_id"),
    ("/multi_state/chat/completions", MULTI, "model", "model"),
    ("/multi_state/chat/completions", MULTI, "contents", "contents"),
    ("/state/delete", {"session_id": "txt"}, "session_id", "session_id"),
    ("/state/status", {}, "password", "password"),
]


@pytest.fixture(scope="module")
def c(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def sessions(c: httpx.Client) -> list:
    r = c.post("/state/status", json={})
    assert r.status_code == 200, r.text
    return r.json()["sessions"]


def with_bad(body: dict, field: str) -> dict:
    """body with BAD in `field` (inside the list, or the first message, where the field is one)."""
    if field == "messages":
        return {**body, "messages": [{"role": "user", "content": BAD}]}
    return {**body, field: [BAD] if isinstance(body.get(field), list) or field == "contents" else BAD}


@pytest.mark.parametrize(("path", "body", "field", "param"), CASES, ids=[f"{p}:{f}" for p, _, f, _ in CASES])
def test_a_lone_surrogate_is_a_400_before_anything_runs(c, path, body, field, param):
    setup = SETUP.get(path)
    if setup is not None:  # a session the refused call could have changed
        assert post_escaped(c, *setup).status_code == 200
    before, tokens = sessions(c), metric(c, "rwkv_prompt_tokens_total")
    r = post_escaped(c, path, with_bad(body, field))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request")
    assert "lone surrogate U+D800" in error["message"]
    idle(c)
    assert metric(c, "rwkv_prompt_tokens_total") == tokens  # nothing was prefilled
    assert sessions(c) == before  # no session made, continued, branched or deleted


def test_the_reported_multi_state_case_makes_no_node(c):
    body = {"session_id": "msur-qa", "dialogue_idx": 0, "contents": ["a"], "model": "m\ud800", "max_tokens": 2}
    r = post_escaped(c, "/multi_state/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert not any(s["session_id"].startswith("msur-qa") for s in sessions(c))


def test_valid_non_ascii_text_is_untouched(c):
    text = "中文 ✿ 🙂 \ufffd"
    r = post_escaped(c, "/v2/chat/completions", {"contents": [text], "model": text, **CHEAP})
    assert r.status_code == 200 and r.json()["model"] == text, r.text
    r = post_escaped(c, "/state/delete", {"session_id": text})
    assert r.status_code == 404 and r.json()["message"] == f"Session {text} not found"


# --- the session routes' task-layer errors ----------------------------------------------------------
async def test_a_task_layer_bad_value_is_lightnings_400_naming_its_field():
    async def invalid() -> None:
        raise TaskInvalid("prompt is not valid text at character 1 (a lone surrogate?)", param="prompt")

    with pytest.raises(ApiError) as exc:
        await _tasks(invalid())
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "invalid_request", "contents")

    async def penalty() -> None:
        raise TaskInvalid("invalid 'repetition_penalty': 9 is out of range", param="repetition_penalty")

    with pytest.raises(ApiError) as exc:
        await _tasks(penalty())
    assert (exc.value.status, exc.value.param) == (400, "alpha_frequency")

    async def busy() -> None:
        raise TaskConflict("the task is running")

    with pytest.raises(ApiError) as exc:
        await _tasks(busy())
    assert (exc.value.status, exc.value.code) == (409, "task_conflict")  # other statuses are kept
