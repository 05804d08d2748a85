"""prefill_time on a real server (docs/task-api.md): the seconds from the submission of the run
that generated the output's first token to that token, 0 while the output has none; the
stream's header shows the figure as it stands (0 before the first token), the final event and
get_result the same figure."""

from __future__ import annotations

import time

import httpx
import pytest
from test_task_api_raw_http import sse, wait_done
from util_server import server_fixture

server = server_fixture(env={"RWKV_MAX_BATCH": "2", "RWKV_MAX_QUEUE": "4"})
LONG = {"max_tokens": 100000, "ignore_eos": True}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url + "/v1/tasks", timeout=30) as c:
        yield c


def status(http: httpx.Client, tid: str) -> dict:
    return http.get(f"/{tid}/get_result").json()


@pytest.mark.parametrize("max_tokens", [8, 0])
def test_stream_header_final_event_and_result_agree(http, max_tokens):
    ev = sse(http.post("/tmp", json={"prompt": "User: Hi!\n\nAssistant:", "max_tokens": max_tokens, "stream": True,
                                     "ignore_eos": True}))  # sampled: an end-of-text could end it early
    head, final = ev[0], ev[-2]
    result = status(http, head["task_id"])
    assert final["prefill_time"] == round(result["prefill_time"], 6)
    assert head["prefill_time"] in (0, final["prefill_time"])  # 0: sent before the first token
    if max_tokens:
        assert final["usage"]["completion_tokens"] == max_tokens and final["prefill_time"] > 0
    else:
        assert final["usage"]["completion_tokens"] == 0 and final["prefill_time"] == head["prefill_time"] == 0


def test_a_run_stopped_while_queued_has_no_prefill_time(http):
    """A task that generated before is continued while two long tasks fill both slots: its
    answer does not carry the earlier figure, and stopped while it waits (nothing generated) it
    shows 0; a later run that generates sets it again."""
    tid = http.post("/create", json={"prompt": "short", "max_tokens": 2, "ignore_eos": True}).json()["task_id"]
    assert wait_done(http, tid)["prefill_time"] > 0
    running = [http.post("/create", json={"prompt": f"long {i}", **LONG}).json()["task_id"] for i in range(2)]
    try:
        queued = http.post(f"/{tid}/continue", json={"prompt": " next", **LONG}).json()
        assert queued["status"] == 1 and queued["prefill_time"] == 0, queued  # READY: waits for a slot
        time.sleep(0.5)
        stopped = http.post(f"/{tid}/stop", json={}).json()
        assert stopped["status"] == 3 and stopped["generated_buf"] == 0, stopped
        got = status(http, tid)
        assert got["completion_tokens"] == 0 and got["prefill_time"] == 0, got
    finally:
        for t in running:
            http.post(f"/{t}/stop", json={})
    http.post(f"/{tid}/continue", json={"prompt": " more", "max_tokens": 4})
    done = wait_done(http, tid)
    assert done["completion_tokens"] == 4 and done["prefill_time"] > 0, done
