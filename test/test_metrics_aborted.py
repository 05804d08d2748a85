"""rwkv_requests_aborted_total against a real server: a client that leaves before its answer
counts once, streamed or not, on the OpenAI and the lightning routes."""

from __future__ import annotations

import time

import httpx
import pytest
from util_server import server_fixture

from server.api.metrics import parse_metrics

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
