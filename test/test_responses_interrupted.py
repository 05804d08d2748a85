"""A response whose run the server's stop cut short (a shutdown, restart or crash: the task's
finish reason "interrupted") reads as OpenAI's schema allows: status "failed" with error code
"server_error" and a message that says what happened and how to resume it (POST
/v1/tasks/{task_id}/continue, or previous_response_id); OpenAI's incomplete_details.reason has
no "interrupted". Real server (SIGKILL mid-answer, restart), the official SDK's strict models."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI
from openai.types.responses import Response
from util_server import running_server, task_result, wait_committed

# greedy, and an input whose greedy answer on the test model has no "\n\n" (the chat stop) in its
# first 2,000 tokens (test_responses_disconnect.py): the run cannot end by itself while it is killed
ASK = {"model": "m", "input": "y", "temperature": 0, "max_output_tokens": 200_000}


def strict(body: dict) -> Response:
    """body parsed by the SDK's Response model with validation (the SDK itself does not validate).
    Usage aside: openai 3.60 requires input_tokens_details.cache_write_tokens, which the server
    does not send yet (not what these tests are about)."""
    return Response.model_validate({**body, "usage": None})


def _task(finish_reason: str, kind: str = "task"):
    from server.tasks.output import Output
    from server.tasks.records import TASK, TMP, Task

    return Task(id=("TASK_" if kind == "task" else "TMP_") + "c" * 32, kind=TASK if kind == "task" else TMP,
                params={"max_tokens": 50, "stop": ["\n\n"]}, prompt="User: x\n\nAssistant:", out=Output(" so far"),
                finish_reason=finish_reason, tag="response")  # fmt: skip


@pytest.mark.parametrize("kind", ["task", "tmp"])
def test_an_interrupted_response_is_failed_with_a_server_error(kind):
    from server.api.responses.render import response

    body = response(_task("interrupted", kind), "m")
    parsed = strict(body)  # every enum of OpenAI's schema
    assert parsed.status == "failed" and parsed.incomplete_details is None and parsed.error is not None
    assert parsed.error.code == "server_error" and "the server stopped" in parsed.error.message
    assert parsed.output[0].status == "incomplete" and parsed.output_text == "so far"
    if kind == "task":
        assert f"POST /v1/tasks/TASK_{'c' * 32}/continue" in parsed.error.message
        assert "previous_response_id" in parsed.error.message
    else:
        assert "not stored" in parsed.error.message and "/continue" not in parsed.error.message


@pytest.mark.parametrize("reason,status,details", [
    ("stop", "completed", None), ("length", "incomplete", {"reason": "max_output_tokens"}),
    ("stopped", "cancelled", None), ("error", "failed", None),
])  # fmt: skip
def test_every_finish_reason_reads_inside_openais_schema(reason, status, details):
    from server.api.responses.render import response

    body = response(_task(reason), "m")
    strict(body)
    assert (body["status"], body["incomplete_details"]) == (status, details)
    assert (body["error"] is None) == (status != "failed")


def stream_then(srv, end) -> str:
    """Stream a long response, read 20 events, then end(): the server stops under the open stream."""
    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with client.responses.create(**ASK, stream=True) as s:
        for i, ev in enumerate(s):
            if i == 0:
                rid = ev.response.id
            if i == 20:
                break
        assert ev.type == "response.output_text.delta", ev  # mid-answer
        wait_committed(srv.db, "TASK_" + rid.split("_", 1)[1])  # a progress write has landed (the text so far is kept)
        end()
    return rid


def wait_then(srv, end) -> str:
    """A long non-streamed response waited for, then end() (the request gets a 503)."""
    answer: list = []
    waiter = threading.Thread(target=lambda: answer.append(httpx.post(srv.url + "/v1/responses", json=ASK,
                                                                      timeout=60)))  # fmt: skip
    waiter.start()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        deadline = time.monotonic() + 30
        while not (tasks := c.get("/v1/tasks/list", params={"kind": "task"}).json()["tasks"]) or not \
                c.get(f"/v1/tasks/{tasks[0]['task_id']}/get_result").json()["result"]:  # fmt: skip
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.1)
    wait_committed(srv.db, tasks[0]["task_id"])  # a progress write has landed
    end()
    waiter.join()
    assert answer[0].status_code == 503 and answer[0].json()["error"]["code"] == "shutting_down", answer[0].text
    return "resp_" + tasks[0]["task_id"].split("_", 1)[1]


@pytest.mark.parametrize("how", ["crash", "shutdown", "shutdown_waiting"])
def test_a_response_the_servers_stop_cut_short_fails_and_resumes_as_its_message_says(tmp_path, how):
    """SIGKILL, or SIGTERM (a graceful stop ends the response's request first: its run is
    interrupted as the shutdown's own are, not "cancelled" as by a client that left), under a
    stream or a waiting non-streamed request; after the restart the response reads failed."""
    with running_server(tmp_path) as srv:
        if how == "crash":
            rid = stream_then(srv, srv.kill)
        elif how == "shutdown":
            rid = stream_then(srv, srv.stop)
        else:
            rid = wait_then(srv, srv.stop)
        srv.start()
        raw = httpx.get(f"{srv.url}/v1/responses/{rid}").json()
        got = strict(raw)
        assert got.status == "failed" and got.incomplete_details is None, raw
        assert got.error is not None and got.error.code == "server_error"
        tid = "TASK_" + rid.split("_", 1)[1]
        assert f"POST /v1/tasks/{tid}/continue" in got.error.message, got.error.message
        kept = got.output_text
        assert kept
        with httpx.Client(base_url=srv.url, timeout=60) as c:  # resume it, as the message says
            r = c.post(f"/v1/tasks/{tid}/continue", json={"max_tokens": 5})
            assert r.status_code == 200, r.text
            task_result(c, tid)
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        after = client.responses.retrieve(rid)
        assert after.status == "incomplete" and after.error is None, after
        assert after.incomplete_details.reason == "max_output_tokens" and after.output_text.startswith(kept)
        assert len(after.output_text) > len(kept)
