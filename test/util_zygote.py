"""A fork server for the tests' server processes: `serve` started in ~1 s instead of ~4.

Every `python -m server.cli serve` spends ~2.5 s of CPU importing torch, FastAPI, SQLAlchemy,
Alembic and the server's own modules before it does anything, and the suite starts a few hundred
servers on a CPU-bound machine. So each test process keeps one helper process (the zygote) that
imports those modules once, single-threaded, and forks it for every server start. The child is
then what `python -m server.cli serve ...` would be: its own session (setsid), the asked-for
working directory, environment, argv and log file as stdout and stderr, `server.cli` run as
`__main__`, and the interpreter's normal exit (atexit handlers, exit code, death by signal).

`spawn()` returns a `ForkedProcess`, a `subprocess.Popen` look-alike (pid, poll, wait, send_signal,
terminate, kill, returncode). The zygote is the server's parent: it reaps it and reports the exit
status back over its stdout, so the test process reads the same return codes as with Popen (a
SIGTERM-ed server: -15).

Used by `util_server.ServerProcess` under pytest, where the start's environment changes nothing that
is read at import time (only RWKV_ variables: see `forkable`); RWKV_TEST_FORK_SERVERS=0 turns it off
for a run. The benchmarks' servers are started fresh, as users start them.

Run as a script, this file is the zygote itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = (  # what `serve` imports (its route modules, uvicorn's loop and protocols), not what it runs
    "torch", "numpy", "fastapi", "sqlalchemy", "aiosqlite", "alembic", "orjson", "httpx", "uvicorn",
    "uvicorn.loops.uvloop", "uvicorn.lifespan.on", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl", "server.cli", "server.api.app", "server.api.ops",
    "server.api.tasks.routes", "server.api.openai.routes", "server.api.responses.routes",
    "server.api.lightning.routes", "server.api.states.routes", "server.webui.routes", "server.engine.runner",
    "server.tasks.imports", "server.tasks.migrate", "server.model.synthetic",
)


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a start with these extra variables may be forked from the zygote: RWKV_ settings are
    read when the server starts; anything else (PYTHONPATH, OMP_*, ...) may act at import time.
    Under pytest only: the benchmarks (test/bench/) start their servers as users do."""
    if os.environ.get("RWKV_TEST_FORK_SERVERS", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if "pytest" not in sys.modules:
        return False
    return all(k.startswith("RWKV_") for k in env)


class ForkedProcess:
    """One server forked by the zygote; the subset of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None
        """Set by the zygote's reader thread when the zygote reaps the child."""

    def poll(self) -> int | None:
        return self.zygote.exit_code(self, timeout=0)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.exit_code(self, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (the pid is not reused while the zygote has not reaped it)
            with contextlib.suppress(ProcessLookupError):  # reaped just now, as Popen allows
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: starts the zygote, asks it for forks, collects exit codes."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=str(ROOT), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, start_new_session=True)  # fmt: skip
        # (a session of its own: a Ctrl-C of the test run leaves it to reap what the tests stop)
        self.spawn_lock = threading.Lock()
        self.changed = threading.Condition()
        self.replies: list[ForkedProcess | str] = []  # a child, or why none was forked
        self.live: dict[int, ForkedProcess] = {}  # children not reaped yet, by pid
        self.gone = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        """The zygote's messages, in its order: a child's pid always before its exit."""
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                msg = json.loads(line)
                with self.changed:
                    if "exit" in msg:  # (the child's object holds it: a later child may get its pid)
                        self.live.pop(msg["exit"]).returncode = msg["code"]
                    elif "pid" in msg:
                        child = self.live[msg["pid"]] = ForkedProcess(self, msg["pid"], msg["args"])
                        self.replies.append(child)
                    else:
                        self.replies.append(msg["error"])
                    self.changed.notify_all()
        finally:
            with self.changed:
                self.gone = True
                self.changed.notify_all()

    def spawn(self, argv: list[str], *, env: Mapping[str, str], cwd: str, log_path: str) -> ForkedProcess:
        """Fork a child running `python -m <argv>` (argv[0] the module) with exactly `env`."""
        request = {"argv": argv, "env": dict(env), "cwd": cwd, "log": log_path}
        with self.spawn_lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            with self.changed:
                if not self.changed.wait_for(lambda: self.replies or self.gone, timeout=120) or not self.replies:
                    self.proc.kill()  # (a late answer would be taken for the next start's: a new zygote then)
                    raise RuntimeError("the test servers' zygote did not answer (see the test's stderr)")
                reply = self.replies.pop(0)
        if isinstance(reply, str):
            raise RuntimeError(f"the zygote could not fork: {reply}")
        return reply

    def exit_code(self, child: ForkedProcess, timeout: float | None) -> int | None:
        """The child's exit code once it ended (None: still running after `timeout` seconds)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            self.changed.wait_for(lambda: child.returncode is not None or self.gone, timeout=timeout)
            if child.returncode is not None or not self.gone:
                return child.returncode
        # The zygote died (killed with the test run, say): its children went to init, which reaps
        # them, and their exit codes are lost. Running or not is still known.
        while _running(child.pid):
            if end is not None and time.monotonic() >= end:
                return None
            time.sleep(0.05)
        child.returncode = LOST
        return LOST


LOST = -256
"""The exit code given for a child that ended after its zygote died (its own code is unknown)."""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This test process's zygote, started on first use (it ends when its stdin closes: with us)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.gone:
            _zygote = Zygote()
        return _zygote


# ---- the zygote process ----


def _child(request: dict, wakeup: tuple[int, int], filters: list) -> None:
    """In the forked child: become `python -m ARGV` and run it. Never returns: the module's own
    SystemExit (or uncaught exception) ends the interpreter as it would have ended a fresh one."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    warnings.filters[:] = filters  # a fresh interpreter's
    for fd in wakeup:
        os.close(fd)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    sys.modules.pop(request["argv"][0], None)  # preloaded; `python -m` runs a module not yet imported
    runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _serve() -> None:
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, "the zygote must fork from a single Python thread"
    # Python 3.12+ warns at each fork of a process with other OS threads: numpy's OpenBLAS pool,
    # whose own fork handler makes that safe. The children get the filters as they were.
    filters = warnings.filters[:]
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready, _, _ = select.select([0, wakeup[0]], [], [])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)  # the signals' bytes (any left wake the next select)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            os.write(1, (json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n").encode())
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                return  # the test process is gone; the servers it started stop with their tests
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    os.write(1, (json.dumps({"error": str(e)}) + "\n").encode())
                    continue
                if pid == 0:
                    _child(request, wakeup, filters)
                os.write(1, (json.dumps({"pid": pid, "args": ["python", "-m", *request["argv"]]}) + "\n").encode())


if __name__ == "__main__":
    _serve()
