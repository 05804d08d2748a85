"""CORS against a real server: a browser page of another origin may call the API (rwkv_lightning
answers every origin, and its browser clients must work unchanged), the preflight needs no API
key, and `--cors-origins ''` turns it off (no CORS headers: browsers block such pages)."""

from __future__ import annotations

import httpx
from util_server import running_server, server_fixture

server = server_fixture(env={"RWKV_API_KEYS": "k1"})
PAGE = "http://chat.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip


def test_a_preflight_needs_no_key_and_allows_the_call(server):
    for path in ("/v1/chat/completions", "/v1/tasks/create", "/state/chat/completions"):
        r = httpx.options(server.url + path, headers=PREFLIGHT)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.headers["access-control-allow-origin"] in ("*", PAGE)
        assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_answers_carry_the_header_streamed_or_not_errors_too(server):
    key = {"Origin": PAGE, "Authorization": "Bearer k1"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=key, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=key,
                      timeout=60) as s:  # fmt: skip
        assert s.status_code == 200 and s.headers["access-control-allow-origin"] == "*"
        assert b"[DONE]" in b"".join(s.iter_bytes())
    r = httpx.get(server.url + "/v1/models", headers={"Origin": PAGE})  # no key: the 401 is readable too
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_an_empty_setting_turns_cors_off(tmp_path):
    with running_server(tmp_path, env={"RWKV_CORS_ORIGINS": ""}) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_listed_origins_only(tmp_path):
    with running_server(tmp_path, env={"RWKV_CORS_ORIGINS": f"{PAGE}, http://other.example"}) as srv:
        ok = httpx.options(srv.url + "/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
        bad = httpx.options(srv.url + "/v1/models", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
