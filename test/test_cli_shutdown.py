"""How `serve` ends: Ctrl-C (SIGINT) ends it by SIGINT, as docs/deployment.md says (a shell shows
130), without the KeyboardInterrupt traceback; SIGTERM while clients are still sending their
request bodies answers them 503 `shutting_down` at once instead of holding the graceful shutdown
for uvicorn's 5 s and then cancelling them (a plain-text 500 and a traceback per request)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from util_server import ServerProcess, free_port

from server.api.body_reads import BodyReads

ROOT = Path(__file__).resolve().parents[1]
QUIET_LOG = ("Traceback", "KeyboardInterrupt", "CancelledError", "graceful shutdown exceeded")


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(log.read_text()[-3000:])


def test_ctrl_c_ends_serve_by_sigint_without_a_traceback(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu", "RWKV_STATS_INTERVAL": "0"}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--db", str(tmp_path / "t.db"), "--model", "synthetic:tiny"]  # fmt: skip
    with open(log, "wb") as out:  # SIGINT as a terminal's Ctrl-C finds it: Python's handler in place
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert rc == -signal.SIGINT, text[-3000:]  # the shell's 130
    assert "shut down" in text and not [w for w in QUIET_LOG if w in text], text[-3000:]


# --- SIGTERM while bodies are still coming ---------------------------------------------------------


def partial_request(port: int, path: str, content_type: str = "application/json") -> socket.socket:
    """A connection that sent a request's headers and the start of its 1000-byte body, no more."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: 1000\r\n\r\n{{\"prompt\":".encode())  # fmt: skip
    return s


def read_all(s: socket.socket, timeout: float = 10) -> bytes:
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_sigterm_answers_requests_still_sending_their_body_503_at_once(tmp_path):
    srv = ServerProcess(tmp_path)
    with srv:
        srv.start()
        paths = ("/v1/completions", "/v1/tasks/create", "/v2/chat/completions", "/v1/states/slow")
        conns = [partial_request(srv.port, p, "application/octet-stream" if "states" in p else "application/json")
                 for p in paths]  # fmt: skip
        time.sleep(0.5)  # each request's task waits for the rest of its body
        t0 = time.monotonic()
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=30)
        took = time.monotonic() - t0
        answers = [read_all(s) for s in conns]
        for s in conns:
            s.close()
        log = srv.log_tail(400)
    assert rc == -signal.SIGTERM, log
    assert took < 4.5, f"{took:.1f}s to exit (uvicorn's graceful deadline is 5 s)\n{log}"
    for path, raw in zip(paths, answers):
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), (path, raw[:300])
        assert b"connection: close" in head.lower() and b"application/json" in head, (path, head)
        assert json.loads(body)["error"]["code"] == "shutting_down", (path, body)
    assert not [w for w in QUIET_LOG if w in log], log
    assert log.count("503") >= len(paths) and "the server is shutting down" in log, log


# --- BodyReads, in process ---------------------------------------------------------------------------


class SlowBody:
    """An ASGI receive: the first part of a body, then (when `rest` is set) the rest."""

    def __init__(self) -> None:
        self.rest = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        if self.calls == 1:
            return {"type": "http.request", "body": b"{", "more_body": True}
        await self.rest.wait()
        return {"type": "http.request", "body": b"}", "more_body": False}


def body_reads() -> BodyReads:
    return BodyReads(FastAPI())


def test_a_wait_for_the_body_is_cut_by_the_drain():
    async def run() -> None:
        reads, body = body_reads(), SlowBody()
        receive = reads._receive(body)
        assert (await receive())["more_body"] is True
        waiting = asyncio.create_task(receive())
        await asyncio.sleep(0.01)
        reads.drain()
        with pytest.raises(reads.error) as err:
            await waiting
        assert err.value.status_code == 503 and not reads.waiting and not reads.cut
        if hasattr(waiting, "cancelling"):  # (Python 3.11+) the cancel was taken back
            assert waiting.cancelling() == 0

    asyncio.run(run())


def test_a_body_already_received_passes_the_drain():
    async def run() -> None:
        reads, body = body_reads(), SlowBody()
        receive = reads._receive(body)
        reads.drain()
        assert (await receive())["body"] == b"{"  # here at once: passes
        body.rest.set()
        assert (await receive())["body"] == b"}"
        assert (await receive())["body"] == b"}"  # complete: later calls (disconnect watchers) pass through
        blocked = reads._receive(SlowBody())
        await blocked()
        with pytest.raises(reads.error):  # it would have to wait: cut
            await blocked()

    asyncio.run(run())


def test_another_cancel_of_a_body_wait_is_not_taken_for_the_drain():
    async def run() -> None:
        reads, body = body_reads(), SlowBody()
        receive = reads._receive(body)
        await receive()
        waiting = asyncio.create_task(receive())
        await asyncio.sleep(0.01)
        waiting.cancel()  # e.g. uvicorn's deadline
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not reads.waiting

    asyncio.run(run())
