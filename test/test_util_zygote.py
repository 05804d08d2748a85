"""The tests' fork server (test/util_zygote.py) gives each child what a fresh `python -m MODULE`
would have: its argv, exactly the environment asked for, its working directory and module path,
its own session, stdout and stderr in the log file, no descriptor of the zygote's pipes, and the
exit code a Popen would read (sys.exit's code, 1 after a traceback, -signal after a signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from util_server import ServerProcess
from util_zygote import LOST, ForkedProcess, forkable, zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

PROBE = """
import json, os, sys, time
fds = {}
for f in os.listdir("/proc/self/fd"):
    try:
        fds[f] = os.readlink(f"/proc/self/fd/{f}")
    except OSError:  # the listing's own descriptor
        pass
print(json.dumps({"name": __name__, "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                  "path0": sys.path[0], "sid": os.getsid(0), "pid": os.getpid(), "fds": fds}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("the probe's own error")
if mode == "sleep":
    time.sleep(60)
"""


def spawn(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[ForkedProcess, Path]:
    (tmp_path / "zprobe.py").write_text(PROBE)
    log = tmp_path / f"log-{len(list(tmp_path.glob('log-*')))}.txt"
    proc = zygote().spawn(["zprobe", *args], env=env or {"ONLY": "this"}, cwd=str(tmp_path), log_path=str(log))
    return proc, log


def report(log: Path, timeout: float = 30) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lines = log.read_text().splitlines() if log.exists() else []
        if lines and lines[0].startswith("{"):
            return json.loads(lines[0])
        time.sleep(0.05)
    raise AssertionError(f"the probe wrote no report: {log.read_text() if log.exists() else '(no log)'}")


def test_a_child_is_the_module_run_as_main_in_its_own_world(tmp_path):
    proc, log = spawn(tmp_path, "exit", "3", env={"ONLY": "this", "PATH": os.environ.get("PATH", "")})
    assert proc.wait(timeout=60) == 3
    r = report(log)
    assert r["name"] == "__main__"
    assert r["argv"][1:] == ["exit", "3"]
    assert r["env"] == {"ONLY": "this", "PATH": os.environ.get("PATH", "")}  # nothing of ours or the zygote's
    assert r["cwd"] == str(tmp_path) and r["path0"] == str(tmp_path)
    assert r["sid"] == r["pid"] == proc.pid  # a session of its own, as start_new_session gives
    assert all("pipe:" not in target for target in r["fds"].values()), r["fds"]  # none of the zygote's pipes
    assert r["fds"]["1"] == r["fds"]["2"] == str(log)
    assert "to stderr" in log.read_text()


def test_exit_codes_are_popens(tmp_path):
    raised, log = spawn(tmp_path, "raise")
    assert raised.wait(timeout=60) == 1
    assert "ValueError: the probe's own error" in log.read_text()
    clean, _ = spawn(tmp_path, "done")
    assert clean.wait(timeout=60) == 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        sleeper, log = spawn(tmp_path, "sleep")
        report(log)
        assert sleeper.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.2)
        sleeper.send_signal(sig)
        assert sleeper.wait(timeout=30) == -sig
        assert sleeper.returncode == -sig and sleeper.poll() == -sig


def test_signals_to_an_ended_child_are_no_error(tmp_path):
    ended, _ = spawn(tmp_path, "exit", "0")
    assert ended.wait(timeout=60) == 0
    ended.terminate()
    ended.kill()
    assert ended.returncode == 0


def test_children_outlive_a_dead_zygote_and_can_still_be_stopped(tmp_path):
    sleeper, log = spawn(tmp_path, "sleep")
    report(log)
    old = zygote()
    old.proc.kill()  # as a Ctrl-C of the run or the OOM killer would
    old.proc.wait(timeout=30)
    assert sleeper.poll() is None  # still running: known without the zygote
    sleeper.kill()
    assert sleeper.wait(timeout=30) == LOST  # ended; its code died with the zygote
    assert zygote() is not old  # the next start gets a new zygote
    again, _ = spawn(tmp_path, "exit", "5")
    assert again.wait(timeout=60) == 5


def test_only_rwkv_settings_are_forked():
    assert forkable({"RWKV_MAX_BATCH": "8", "RWKV_API_KEYS": "k"})
    assert not forkable({"PYTHONPATH": "/elsewhere"})
    assert not forkable({"OMP_NUM_THREADS": "1"})


def test_a_benchmark_starts_its_server_fresh():
    code = "import sys; sys.path.insert(0, 'test'); from util_zygote import forkable; print(forkable({}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr


def test_a_server_with_an_import_time_variable_is_started_fresh(tmp_path):
    with ServerProcess(tmp_path / "a", env={"RWKV_MAX_BATCH": "4"}) as forked, \
         ServerProcess(tmp_path / "b", env={"OMP_NUM_THREADS": "1"}) as fresh:  # fmt: skip
        forked.start()
        fresh.start()
        assert isinstance(forked.proc, ForkedProcess)
        assert isinstance(fresh.proc, subprocess.Popen)
        for srv in (forked, fresh):
            srv.stop()
            assert srv.proc is not None and srv.proc.returncode is not None
            assert "Finished server process" in srv.log_tail(), srv.log_tail()
            assert "RuntimeWarning" not in srv.log_path.read_text()  # (runpy's, for a module imported twice)
