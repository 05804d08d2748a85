"""Schema-driven fuzzing (schemathesis + hypothesis) of every documented route of a real server:
no 5xx, every status and content type documented, every documented response body valid against
its schema, and the server still serving afterwards. Bounded in time: a fixed number of examples
per operation (RWKV_FUZZ_EXAMPLES, default 25) and a server-side cap on max_tokens, so generated
requests finish quickly on the tiny model."""

from __future__ import annotations

import os

import httpx
import pytest
from util_server import server_fixture

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install '.[test]')")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi import checks as oa_checks  # noqa: E402

EXAMPLES = int(os.environ.get("RWKV_FUZZ_EXAMPLES", "25"))
server = server_fixture(env={"RWKV_MAX_TOKENS_LIMIT": "16", "RWKV_MAX_BATCH": "16", "RWKV_MAX_QUEUE": "64",
                             "RWKV_MAX_PROMPT_TOKENS": "512"})


def _app_schema() -> dict:
    """The server's OpenAPI document, built from the app at collection time (no model loads;
    test_the_served_schema_is_the_fuzzed_one checks it equals what the server serves)."""
    from server.api.app import create_app
    from server.config import Settings

    return create_app(Settings()).openapi()


APP_SCHEMA = _app_schema()
schema = schemathesis.openapi.from_dict(APP_SCHEMA)
CHECKS = [
    schemathesis.checks.not_a_server_error,
    oa_checks.status_code_conformance,
    oa_checks.content_type_conformance,
    oa_checks.response_schema_conformance,
]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_route_answers_as_documented(case, server):
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)


def test_the_served_schema_is_the_fuzzed_one(server):
    assert httpx.get(server.url + "/openapi.json").json() == APP_SCHEMA


def test_still_serving_after_the_fuzz(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert server.alive
    assert "Traceback" not in server.log_tail(2000)
