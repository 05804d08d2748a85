"""Run a REAL server (uvicorn in a subprocess) on a free loopback port, for tests.

    from util_server import ServerProcess, running_server   # test/ is on sys.path under pytest

    with running_server(tmp_path, env={"RWKV_API_KEYS": "k1"}) as srv:
        httpx.get(srv.url + "/health")
        srv.kill()          # SIGKILL (crash test) ...
        srv.start()         # ... and start again: same port, same database
    # leaving the block: SIGTERM, then SIGKILL after `stop_timeout` seconds

The server's output goes to `srv.log_path`; `srv.log_tail()` shows the end (use it in assert
messages). Starting takes a few seconds (torch import + tiny model), so share one server per
module with a module-scoped fixture where tests allow it (`server_fixture` below builds one).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx
from util_zygote import ForkedProcess, forkable, zygote

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

ROOT = Path(__file__).resolve().parents[1]
_Self = TypeVar("_Self", bound="ServerProcess")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess; start/stop/kill/restart keep the port, database and env."""

    def __init__(self, tmp_dir: str | Path | None = None, *, model: str = "synthetic:tiny",
                 db: str | None = None, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 port: int | None = None, stop_timeout: float = 10.0) -> None:
        self.owns_tmp = tmp_dir is None
        """The directory is ours (made here): `cleanup()` removes it (a bench's states can be GBs)."""
        self.tmp_dir = Path(tmp_dir or tempfile.mkdtemp(prefix="rwkv-srv-"))
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.db = db or str(self.tmp_dir / "tasks.db")
        self.env = dict(env or {})
        self.args = tuple(args)
        self.port = port or free_port()
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.log_path = self.tmp_dir / f"server-{self.port}.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--db", self.db, "--model", self.model, *self.args]

    def start(self, wait: bool = True, timeout: float = 90.0) -> ServerProcess:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("server already running")
        env = {**os.environ, "RWKV_STATS_INTERVAL": "0", "RWKV_DEVICE": "cpu", **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.starts += 1
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            log.write(f"\n===== start #{self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            if forkable(self.env):  # (the same process, ~2.5 s of imports sooner: util_zygote)
                self.proc = zygote().spawn(self.command()[2:], env=env, cwd=str(ROOT), log_path=str(self.log_path))
            else:
                self.proc = subprocess.Popen(self.command(), cwd=str(ROOT), env=env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Block until /health answers 200 (raises with the log tail if the process dies)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc and self.proc.returncode}\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s\n{self.log_tail()}")

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL now (a crash), and reap the process."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        return self.proc.returncode

    def pause(self) -> None:
        """SIGSTOP: the process is frozen (no step, no write) until `resume()`; a test reads what
        it committed and what its clients hold at one moment, then kills or resumes it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self, wait: bool = True, hard: bool = False) -> ServerProcess:
        (self.kill if hard else self.stop)()
        return self.start(wait=wait)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def cleanup(self) -> None:
        """Stop, and remove the temporary directory this object made (none given)."""
        self.stop()
        if self.owns_tmp:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@contextlib.contextmanager
def running_server(tmp_dir: str | Path | None = None, *, wait: bool = True, **kwargs) -> Iterator[ServerProcess]:
    """Start a server, yield it, and stop it (SIGTERM then SIGKILL) however the block ends."""
    srv = ServerProcess(tmp_dir, **kwargs)
    try:
        srv.start(wait=wait)
        yield srv
    finally:
        srv.cleanup()


def server_fixture(scope: str = "module", **kwargs):
    """A pytest fixture yielding a started ServerProcess, e.g.
    `server = server_fixture(env={"RWKV_MAX_BATCH": "8"})` at module level."""
    import pytest

    @pytest.fixture(scope=scope)
    def _server(tmp_path_factory) -> Iterator[ServerProcess]:
        with running_server(tmp_path_factory.mktemp("server"), **kwargs) as srv:
            yield srv

    return _server


def sdk(server: ServerProcess, *, key: str = "unused", timeout: float = 60) -> OpenAI:
    """The official OpenAI SDK on a server's /v1, without retries (a test sees every answer)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def async_sdk(server: ServerProcess, *, key: str = "unused", timeout: float = 60) -> AsyncOpenAI:
    """sdk()'s AsyncOpenAI twin."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


@contextlib.contextmanager
def inprocess_server(settings, timeout: float = 120) -> Iterator[tuple[str, object]]:
    """A REAL uvicorn server in THIS process on a free loopback port, for tests that reach into the
    running app (`app.state.services`: make a step fail, stop one engine). Yields (url, app);
    stops the server on leaving."""
    import uvicorn

    from server.api.app import create_app

    app = create_app(settings)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{srv.config.port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.2)
    try:
        yield url, app
    finally:
        srv.should_exit = True
        thread.join(30)


def task_result(c: httpx.Client, task_id: str, until=lambda r: r["finished"], timeout: float = 60) -> dict:
    """A task's get_result (client `c` on the server's root URL), polled until `until` holds
    (default: finished); AssertionError with the last answer after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        r = c.get(f"/v1/tasks/{task_id}/get_result").json()
        if until(r):
            return r
        if time.monotonic() > end:
            raise AssertionError(f"{task_id}: {r}")
        time.sleep(0.05)


def committed_row(db: str | Path, task_id: str) -> dict | None:
    """A task's row as committed in a server's SQLite file (what a SIGKILL leaves), read-only
    while the server runs; None when there is no such row."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
    return None if row is None else dict(row)


def task_ids(server: ServerProcess, key: str = "k1") -> list[str]:
    """The ids of the tasks API key `key` may list (not the rows: their state changes as it is
    written behind), sorted: what a test compares before and after a refused request."""
    import httpx

    r = httpx.get(server.url + "/v1/tasks/list", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return sorted(t["task_id"] for t in r.json()["tasks"])


def wait_committed(db: str | Path, task_id: str, until: Callable[[dict], bool] | None = None,
                   timeout: float = 60) -> dict:
    """A task's committed row (committed_row) once `until(row)` holds; by default once a progress
    row of the running task has landed (the row holds output text). A test that kills the server
    to check what a crash keeps waits for this, not for a fixed time: progress rows come about
    once a second and states are written behind, and a loaded machine may commit either late."""
    until = until or (lambda r: r["completion_tokens"] > 0 and r["text"].strip() != "")
    end = time.monotonic() + timeout
    while True:
        row = committed_row(db, task_id)
        if row is not None and until(row):
            return row
        if time.monotonic() > end:
            raise AssertionError(f"{task_id}: the committed row never got there in {timeout}s: {row}")
        time.sleep(0.05)


def serve_until(args: list[str], pattern: str, timeout: float = 90, env: dict[str, str] | None = None,
                ) -> tuple[re.Match | None, str]:
    """Start `serve ARGS`, read its log until `pattern` matches a line (or it exits, or the time
    is up), stop it; (the match, the log read). `env`: variables beside the process's own."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu", "RWKV_STATS_INTERVAL": "0", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *args], cwd=ROOT, env=full,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()  # read by a thread: a quiet server blocks no test

    def pump() -> None:
        for line in proc.stderr or ():
            lines.put(line)

    seen, match, deadline = [], None, time.monotonic() + timeout
    try:  # (from here on: whatever fails, the server is stopped)
        threading.Thread(target=pump, daemon=True).start()
        while match is None and time.monotonic() < deadline and (proc.poll() is None or not lines.empty()):
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=0.2))
                match = re.search(pattern, seen[-1])
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        proc.kill()
        proc.wait()
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    return match, "".join(seen)
