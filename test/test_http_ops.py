"""Operations against a real server: /health 503 while loading then 200, /metrics, and client
disconnects that free their slots."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import orjson
import pytest
from util_server import ServerProcess, running_server

from server.api.metrics import parse_metrics


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A server whose loading takes 2 extra seconds (test hook RWKV_DEBUG_LOAD_DELAY)."""
    srv = ServerProcess(tmp_path_factory.mktemp("ops"), env={"RWKV_DEBUG_LOAD_DELAY": "2"})
    srv.start(wait=False)
    yield srv
    srv.stop()


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def test_health_503_while_loading_then_200(slow_server):
    seen: list[int] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            r = httpx.get(slow_server.url + "/health", timeout=30)
        except httpx.TransportError:
            assert slow_server.alive, slow_server.log_tail()
            time.sleep(0.05)
            continue
        seen.append(r.status_code)
        if r.status_code == 503:
            body = r.json()
            assert body["status"] == "loading" and body["error"]["code"] == "loading"
            assert_loading_api(slow_server.url)
        if r.status_code == 200:
            assert r.json()["status"] == "ok" and r.json()["model"] == "synthetic:tiny"
            break
        time.sleep(0.05)
    assert seen and seen[0] == 503 and seen[-1] == 200, seen


def assert_loading_api(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    if r.status_code == 503:  # (may have become ready in between)
        assert r.json()["error"]["code"] == "loading" and "retry-after" in r.headers


def test_metrics_families(slow_server):
    slow_server.wait_ready()
    url = slow_server.url
    before = metrics(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    text = httpx.get(url + "/metrics").text
    for family in ("rwkv_requests_running", "rwkv_requests_waiting", "rwkv_prompt_tokens_total",
                   "rwkv_generation_tokens_total", "rwkv_time_to_first_token_seconds",
                   "rwkv_inter_token_latency_seconds", "rwkv_engine_step_seconds", "rwkv_state_cache_bytes",
                   "rwkv_state_cache_hits_total", "rwkv_http_requests_total", "rwkv_gc_collections_total"):
        assert f"# TYPE {family} " in text, family
    # every family named *_total is a counter (Prometheus' rule; rate() depends on it)
    kinds = dict(ln.split()[2:4] for ln in text.splitlines() if ln.startswith("# TYPE "))
    assert kinds["rwkv_engine_finished_total"] == "counter" and kinds["rwkv_engine_overhead_seconds"] == "gauge"
    helps = dict(ln.split(None, 3)[2:4] for ln in text.splitlines() if ln.startswith("# HELP "))
    assert not [f for f, h in helps.items() if h.startswith("Engine figure")], helps  # each family says what it is
    assert not [f for f in kinds if f.endswith(("_ms", "_bucket")) and kinds[f] != "histogram"], kinds
    assert not [f for f, k in kinds.items() if f.endswith("_total") and k != "counter"], kinds
    after = parse_metrics(text)
    assert after['rwkv_gc_collections_total{generation="0"}'] > 0  # the server process's own collector
    # the task layer's events are there before they happen (an alert on state_corrupt needs its series)
    assert after['rwkv_task_events_total{event="state_corrupt"}'] == after['rwkv_task_events_total{event="rebuilds"}'] == 0
    assert after["rwkv_time_to_first_token_seconds_count"] == before["rwkv_time_to_first_token_seconds_count"] + 1
    assert after["rwkv_generation_tokens_total"] >= before["rwkv_generation_tokens_total"] + 1
    assert after["rwkv_prompt_tokens_total"] > before["rwkv_prompt_tokens_total"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_one_token_answer_is_counted_when_it_arrives(slow_server, stream):
    """A client that got a one-token answer (prefilled, sampled and ended in one engine step) and
    reads /metrics at once finds its prompt and its token counted: the engine counts a step
    before it delivers the step's events (a one-choice stream is written by the engine thread
    right at the delivery)."""
    slow_server.wait_ready()
    url = slow_server.url
    before = metrics(url)
    body = {"prompt": [510, 285, 9], "max_tokens": 1, "ignore_eos": True, "stream": stream}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and (not stream or r.text.rstrip().endswith("data: [DONE]")), r.text
    after = metrics(url)
    assert after["rwkv_generation_tokens_total"] == before["rwkv_generation_tokens_total"] + 1
    assert after["rwkv_prompt_tokens_total"] == before["rwkv_prompt_tokens_total"] + 3


def _counted(url: str, key: str, want: float, timeout: float = 10.0) -> float:
    """The metric `key` once it reaches `want` (or its value after `timeout` s): a stream is
    counted after its last bytes went out, so the client can read /metrics before that."""
    deadline = time.monotonic() + timeout
    while (got := metrics(url).get(key, 0)) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def _streamed(url: str, body: dict) -> dict[int, str]:
    """{choice index: its streamed text} of a streamed completion (well ended)."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    texts: dict[int, str] = {}
    for line in lines[:-1]:
        for c in orjson.loads(line[6:])["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


def test_streams_are_written_by_the_engine_thread_and_equal_the_whole_answer(slow_server):
    """A one-choice stream goes the direct path (server.api.streaming.direct: counted direct_ended) and
    carries exactly the text of the same seeded request answered whole; an n=2 stream takes the
    event loop (counted loop)."""
    slow_server.wait_ready()
    url = slow_server.url
    body = {"prompt": "Once upon a time", "max_tokens": 40, "seed": 11, "ignore_eos": True}
    before = metrics(url)
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert _streamed(url, body) == {0: whole} and len(whole) > 0
    key = 'rwkv_http_streams_total{path="direct_ended"}'
    assert _counted(url, key, before.get(key, 0) + 1) == before.get(key, 0) + 1
    mid = metrics(url)
    two = _streamed(url, {**body, "n": 2})
    assert two[0] == whole and len(two[1]) > 0  # choice 0 has the same seed
    key = 'rwkv_http_streams_total{path="loop"}'
    assert _counted(url, key, mid.get(key, 0) + 1) == mid.get(key, 0) + 1


def _stream_then_drop(url: str, started: threading.Barrier, release: threading.Event, errors: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 100000, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines, n = r.iter_lines(), 0  # (breaking out of iter_lines would close the connection)
            while n < 3:
                n += next(lines).startswith("data: ")
            started.wait(timeout=60)  # all 20 are mid-stream ...
            release.wait(timeout=60)  # ... leaving the block drops the connection
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
        started.abort()


def test_disconnected_streams_free_their_slots(slow_server):
    slow_server.wait_ready()
    url, n = slow_server.url, 20
    barrier, release = threading.Barrier(n + 1), threading.Event()
    errors: list = []
    threads = [threading.Thread(target=_stream_then_drop, args=(url, barrier, release, errors)) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=60)
        m = metrics(url)
        assert m["rwkv_requests_running"] == n, {k: v for k, v in m.items() if "requests" in k}
    finally:
        release.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    t0 = time.monotonic()  # (about 0.1 s; the bound is a loaded machine's: the runs would go on for minutes)
    while True:
        m = metrics(url)
        if m["rwkv_requests_running"] == 0 and m["rwkv_requests_waiting"] == 0:
            break
        assert time.monotonic() - t0 < 10, f"slots still busy after 10 s: {m['rwkv_requests_running']}"
        time.sleep(0.02)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text


def test_non_streaming_client_that_leaves_is_aborted(slow_server):
    url = slow_server.url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 100000, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=0.5))
    t0 = time.monotonic()
    while metrics(url)["rwkv_requests_running"] != 0:
        assert time.monotonic() - t0 < 10, "the run went on after its client left"
        time.sleep(0.02)


async def _read_to_done_and_hang_up(port: int, body: bytes) -> bytes:
    """One raw HTTP/1.1 stream read until [DONE], then the connection closed at once (as clients
    that stop at [DONE] do, before the chunked terminator may have come)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(body), body))
    got = b""
    while b"data: [DONE]" not in got:
        data = await reader.read(65536)
        if not data:
            break
        got += data
    writer.close()
    return got


def test_streams_closed_right_after_done_are_not_aborts(slow_server):
    """Clients that hang up once they read [DONE] completed their streams: no abort is counted
    or logged, on the direct path (n=1) and the loop path (n=2)."""
    slow_server.wait_ready()
    url, port = slow_server.url, slow_server.port
    before, log_before = metrics(url), slow_server.log_tail(100000).count("client disconnected")

    async def waves() -> list[bytes]:
        out: list[bytes] = []
        for n in (1, 1, 1, 2):
            body = orjson.dumps({"prompt": "hi", "max_tokens": 8, "n": n, "stream": True, "ignore_eos": True})
            out += await asyncio.gather(*(_read_to_done_and_hang_up(port, body) for _ in range(40)))
        return out

    answers = asyncio.run(waves())
    assert all(a.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in a for a in answers)
    for path, n in (("direct_ended", 120), ("loop", 40)):
        key = f'rwkv_http_streams_total{{path="{path}"}}'
        assert _counted(url, key, before.get(key, 0) + n) == before.get(key, 0) + n, path
    time.sleep(0.5)  # an abort (none expected) would be counted by now
    assert metrics(url)["rwkv_requests_aborted_total"] == before["rwkv_requests_aborted_total"]
    assert slow_server.log_tail(100000).count("client disconnected") == log_before


def test_sigterm_ends_open_streams_and_exits(slow_server):
    """(Runs last: stops the module's server.) Open streams end with a `shutting_down` error event
    and [DONE], waiting non-streaming requests get 503, and the process exits promptly."""
    slow_server.wait_ready()
    url, out = slow_server.url, {}
    body = {"prompt": "x", "max_tokens": 100000, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out["stream"] = [line for line in r.iter_lines() if line]

    def plain() -> None:
        out["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while metrics(url)["rwkv_requests_running"] < 2:
        assert time.monotonic() - t0 < 30
        time.sleep(0.05)
    t0 = time.monotonic()
    slow_server.stop(timeout=20)
    assert time.monotonic() - t0 < 4, slow_server.log_tail()
    for t in threads:
        t.join(timeout=10)
    assert out["stream"][-2:] == [
        ('data: {"error":{"message":"the server is shutting down","type":"service_unavailable",'
         '"param":null,"code":"shutting_down"}}'), "data: [DONE]"]
    assert out["plain"].status_code == 503 and out["plain"].json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in slow_server.log_tail(200)


def _get_health(sock: socket.socket) -> bytes:
    """One GET /health on an open keep-alive connection: the response's bytes (b"" if the server
    closed the connection)."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    except OSError:
        return b""
    got = b""
    while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
        data = sock.recv(65536)
        if not data:
            break
        got += data
    return got


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_an_idle_connection_outlives_the_clients_own_expiry(tmp_path):
    """httpx and the OpenAI SDK drop an idle connection after 5 s; the server keeps one open
    longer (--keep-alive-timeout, 75 s), so a request sent on a connection idle for 6 s is
    answered, not lost to a close racing it."""
    with running_server(tmp_path) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")


def test_keep_alive_timeout_closes_idle_connections(tmp_path):
    with running_server(tmp_path, env={"RWKV_KEEP_ALIVE_TIMEOUT": "1"}) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
            time.sleep(2.5)
            assert sock.recv(65536) == b""  # closed by the server
