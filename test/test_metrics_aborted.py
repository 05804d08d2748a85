"""rwkv_requests_aborted_total against a real server: a client that leaves before its answer
counts once, streamed or not, on the OpenAI and the lightning routes."""

from __future__ import annotations

import time

import httpx
import pytest
from util_server import server_fixture

from server.api.metrics import parse_metrics
from server.tokenizer import get_tokenizer

server = server_fixture()

ABORTED = "rwkv_requests_aborted_total"
LONG = {"max_tokens": 100000, "ignore_eos": True}
BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **LONG}),
    "completions": ("/v1/completions", {"prompt": "x", **LONG}),
    "lightning": ("/v1/chat/completions", {"contents": ["x"], **LONG}),
}


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def settled(url: str, before: float) -> dict[str, float]:
    """/metrics once nothing runs any more and the counter has moved past `before` (or 5 s passed)."""
    deadline = time.monotonic() + 5
    while True:
        m = metrics(url)
        idle = m["rwkv_requests_running"] == 0 and m["rwkv_requests_waiting"] == 0
        if (idle and m[ABORTED] > before) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def leave_early(url: str, path: str, body: dict, stream: bool) -> None:
    """Send the request and hang up before its (endless) answer: a stream after its first
    chunk, a plain request after 0.7 s. The random model can end a chat turn by itself (its
    text hits the turn's stop string, "\n\n"): such an answer is no abort (see
    test_an_answered_request_is_no_abort), so the request is sent again, up to 5 times."""
    if stream:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_bytes())
        return  # leaving the block mid-stream closes the connection
    for _ in range(5):
        try:
            r = httpx.post(url + path, json=body, timeout=httpx.Timeout(30, read=0.7))
        except httpx.ReadTimeout:
            return
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    pytest.fail(f"answered five times before the client left: {r.text[:500]}")


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_leaves_counts_one_abort(server, route, stream):
    path, body = BODIES[route]
    before = metrics(server.url)[ABORTED]
    leave_early(server.url, path, body, stream)
    m = settled(server.url, before)
    assert m["rwkv_requests_running"] == 0, server.log_tail()
    assert m[ABORTED] == before + 1, server.log_tail()
    time.sleep(0.3)  # a second count (none expected) would show by now
    assert metrics(server.url)[ABORTED] == before + 1


def test_an_answered_request_is_no_abort(server):
    before = metrics(server.url)[ABORTED]
    for path, body in BODIES.values():
        r = httpx.post(server.url + path, json={**body, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
    assert metrics(server.url)[ABORTED] == before


def test_leaving_a_stream_that_only_watches_a_run_is_no_abort(server):
    """A task's stream (GET /stream, or a TASK_ create's) and a stored response's stream only
    watch their run: leaving them stops nothing, so it is no abort (QA: each counted one, and the
    log said "aborting its generation" while the run went on)."""
    c = httpx.Client(base_url=server.url, timeout=30)
    tid = c.post("/v1/tasks/create", json={"prompt": "x", **LONG}).json()["task_id"]
    before = metrics(server.url)[ABORTED]
    for _ in range(2):
        with c.stream("GET", f"/v1/tasks/{tid}/stream") as r:
            assert r.status_code == 200
            next(r.iter_bytes())
    with c.stream("POST", "/v1/tasks/create", json={"prompt": "y", "stream": True, **LONG}) as r:
        next(r.iter_lines())
    time.sleep(0.5)  # an abort counted would show by now
    assert metrics(server.url)[ABORTED] == before, server.log_tail()
    assert c.get(f"/v1/tasks/{tid}/status").json()["status"] == 2  # still running
    assert "the run it watched goes on" in server.log_tail(200)
    for t in c.get("/v1/tasks/list", params={"limit": 1000}).json()["tasks"]:
        if t["status"] == 2:
            c.post(f"/v1/tasks/{t['task_id']}/stop", json={})


def fed(url: str) -> float:
    return metrics(url)["rwkv_prompt_tokens_total"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_leaves_while_its_long_prompt_is_prefilled_aborts_the_prefill(server, stream):
    """With the conversation cache on, a long prompt's rest is prefilled (and kept) before the
    answer begins; a client that left meanwhile went unnoticed until that prefill ended (QA: a
    ~35k-token prompt prefilled 10 s more after its client had gone). Now the prefill is aborted:
    the engine is idle soon after, well short of the prompt, and the request is one abort (499)."""
    tag = f"{time.monotonic_ns() % 10**8:x}"  # uncached: a prompt no earlier request sent
    prompt = " ".join(f"{tag}{i}" for i in range(6000))
    n = len(get_tokenizer().encode(prompt))
    f0, a0 = fed(server.url), metrics(server.url)[ABORTED]
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 50, "stream": stream},
                   timeout=httpx.Timeout(30, read=1.0))
        pytest.fail("answered within 1 s: no prefill to leave")
    except httpx.ReadTimeout:
        pass  # gone while it prefills
    m = settled(server.url, a0)
    assert m["rwkv_requests_running"] == 0 and m[ABORTED] == a0 + 1, server.log_tail()
    time.sleep(0.5)
    assert fed(server.url) - f0 < n / 2, (fed(server.url) - f0, n)  # the prefill stopped early
    assert "aborting the prefill" in server.log_tail(200)


def test_inter_token_latency_counts_every_token_after_the_first():
    """A run's tokens that reach its stream together with the first one (one wake-up) count as
    gaps of 0: the histogram holds tokens - 1 observations per run, however they were batched."""
    from types import SimpleNamespace

    from server.api.latency import Recorder
    from server.api.metrics import Metrics
    from server.engine.types import Event

    for batches in ([3, 1, 2], [1, 1, 1, 1, 1, 1], [6]):
        m = Metrics()
        rec, seq = Recorder(m, 0.0), SimpleNamespace(t_last=None)
        for n in batches:
            rec.on_batch(seq, [Event("x" * n, list(range(n)), n)])
        assert m.ttft.count == 1 and m.itl.count == sum(batches) - 1, batches
    assert m.itl.sum == 0.0  # [6]: all came at once
