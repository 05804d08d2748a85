"""Start-up checks of `serve` and the other subcommands' argument checks: what cannot work ends
before anything loads with one `rwkv-server: ...` line and status 2 (API keys that give no key,
a port out of range or in use, a task database that cannot be opened, bad synth / quantize /
generate arguments); a database URL's password never reaches the log or an error line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from util_server import serve_until

from server.checks import database_problem, numbers_problem, port_problem
from server.cli import RedactingFormatter, load_failure, main
from server.cli_parser import parse_int, parse_whole
from server.config import Settings, redact_url

ROOT = Path(__file__).resolve().parents[1]
SECRET = "TOPSECRETPW"


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def one_line(r: subprocess.CompletedProcess, *expect: str) -> str:
    """The run ended with status 2 and one `rwkv-server: ...` line holding `expect`, before loading."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("rwkv-server"), r.stderr[-3000:]
    for text in expect:
        assert text in lines[0], lines[0]
    return lines[0]


# --- 1. API keys ----------------------------------------------------------------------------------


def test_a_key_file_without_keys_stops_the_start(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the keys go here\n\n   \n# none yet\n")
    r = run_cli("serve", "--api-key-file", str(keys), "--port", "0", "--db", str(tmp_path / "t.db"))
    one_line(r, "--api-key-file", "holds no key")
    assert "every route is open" not in r.stderr


def test_a_missing_key_file_stops_the_start_without_a_traceback(tmp_path):
    r = run_cli("serve", "--api-key-file", str(tmp_path / "nope"), "--port", "0", "--db", str(tmp_path / "t.db"))
    one_line(r, "--api-key-file", "cannot read it", "No such file")


def test_api_keys_from_the_environment_that_give_no_key_stop_the_start(tmp_path):
    r = run_cli("serve", "--port", "0", "--db", str(tmp_path / "t.db"), env={"RWKV_API_KEYS": " , ,"})
    one_line(r, "--api-keys", "holds no key")


def test_api_key_set(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk1\n\n  k2  \n")
    assert Settings(api_keys="a, b", api_key_file=str(keys)).api_key_set() == {"a", "b", "k1", "k2"}
    assert Settings(api_keys="").api_key_set() == frozenset()  # empty: no keys (routes open)
    assert Settings(api_keys="  ").api_key_set() == frozenset()
    with pytest.raises(ValueError, match="api-keys: holds no key"):
        Settings(api_keys=",").api_key_set()
    keys.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        Settings(api_keys="a", api_key_file=str(keys)).api_key_set()  # the file is refused even so
    with pytest.raises(ValueError, match="cannot read it"):
        Settings(api_key_file=str(tmp_path)).api_key_set()  # a folder
    keys.write_bytes(b"\xff\xfe\x00k")
    with pytest.raises(ValueError, match="not UTF-8"):
        Settings(api_key_file=str(keys)).api_key_set()


# --- 2. the database password ---------------------------------------------------------------------


@pytest.mark.parametrize("url,shown", [
    (f"postgresql://postgres:{SECRET}@db.example/rwkv", "postgresql://postgres:***@db.example/rwkv"),
    (f"postgresql+asyncpg://u:p@ss/{SECRET}@h:5432/db?ssl=1", "postgresql+asyncpg://u:***@h:5432/db?ssl=1"),
    (f"postgresql://h/db?user=u&password={SECRET}&x=1", "postgresql://h/db?user=u&password=***&x=1"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("sqlite:////tmp/a:b@c.db", "sqlite:////tmp/a:b@c.db"),
    ("rwkv_tasks.db", "rwkv_tasks.db"),
])  # fmt: skip
def test_redact_url(url, shown):
    assert redact_url(url) == shown == Settings(db=url).db_shown()


def test_log_lines_hide_database_passwords():
    """Whichever module logs the URL (server.tasks.database logs its async form), in tracebacks too."""
    fmt = RedactingFormatter("%(message)s")
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "task database %s: schema empty -> 0004",
                            (f"postgresql+asyncpg://postgres:{SECRET}@h/db",), None)  # fmt: skip
    assert fmt.format(rec) == "task database postgresql+asyncpg://postgres:***@h/db: schema empty -> 0004"


def test_the_start_up_facts_hide_the_database_password():
    from server.api.loading import facts
    from server.api.services import LoadFacts

    shape = SimpleNamespace(n_layer=2, n_embd=128, n_head=2, head_size=64, vocab_size=65536, ffn_dim=512)
    sv = SimpleNamespace(settings=Settings(device="cpu", db=f"postgresql://postgres:{SECRET}@h/db"), shape=shape,
                         model_id="m", engine=None, facts=LoadFacts(seconds=1.0, device="cpu"))  # fmt: skip
    lines = facts(sv)  # type: ignore[arg-type]
    assert "database   postgresql://postgres:***@h/db" in lines and SECRET not in "\n".join(lines)


def test_the_start_up_facts_name_every_cache_budget():
    """The `caches` line shows each byte budget of docs/deployment.md's Budgets table, and the two
    API caches' (chat prefix: 1/8 of the state LRU's; conversations)."""
    from server.api.loading import facts
    from server.api.services import LoadFacts

    shape = SimpleNamespace(n_layer=2, n_embd=128, n_head=2, head_size=64, vocab_size=65536, ffn_dim=512)
    settings = Settings(device="cpu", state_cache_bytes=3 * 1024**3, tmp_state_bytes=100 * 1024**2,
                        write_behind_bytes=5 * 1024**3, db_budget_bytes=7 * 1024**3,
                        conversation_cache_bytes=9 * 1024**3)  # fmt: skip
    sv = SimpleNamespace(settings=settings, shape=shape, model_id="m", engine=None,
                         facts=LoadFacts(seconds=1.0, device="cpu"))  # fmt: skip
    caches = [line for line in facts(sv) if line.startswith("caches ")]  # type: ignore[arg-type]
    assert caches == ["caches     state LRU 3.0 GiB, TMP states 100.0 MiB, write-behind 5.0 GiB, DB states 7.0 GiB, "
                      "chat prefix 384.0 MiB, conversations 9.0 GiB"], caches  # fmt: skip


def test_a_postgresql_password_is_in_no_log_line(pg_url, tmp_path):  # noqa: F811 - fixture
    """A whole start on PostgreSQL (trust auth: the password is not checked), migrations included."""
    url = pg_url.replace("postgresql+asyncpg://postgres@", f"postgresql://postgres:{SECRET}@")
    match, log = serve_until(["--port", "0", "--db", url], r"ready: listening")
    assert match, log[-3000:]
    assert "database   postgresql://postgres:***@" in log and "schema empty" in log
    assert SECRET not in log


# --- 3. the port's range, --port 0 ----------------------------------------------------------------


def test_parse_int_reads_a_sign():
    assert parse_int("-5") == -5 and parse_int("+7") == 7


def test_integer_flags_take_whole_numbers_and_only_sizes_take_suffixes():
    assert parse_whole("42") == 42 and parse_whole("-5") == -5 and parse_whole("2e3") == 2000
    for raw in ("1.5", "0.5", "18k", "1.5e0", "1e999", "nan", "", "2 GiB"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a whole number"):
            parse_whole(raw)
    assert parse_int("1.5G") == int(1.5 * 1024**3) and parse_int("2e9") == 2 * 10**9  # byte sizes
    for raw in ("1.5", "0.5", "1e999K", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
            parse_int(raw)


@pytest.mark.parametrize("args,expect", [
    (["--max-batch", "1.5"], "argument --max-batch: not a whole number: '1.5'"),
    (["--max-tokens-limit", "0.5"], "argument --max-tokens-limit: not a whole number: '0.5'"),
    (["--port", "18k"], "argument --port: not a whole number: '18k'"),
    (["--state-cache-bytes", "0.5"], "argument --state-cache-bytes: not a byte size: '0.5'"),
])  # fmt: skip
def test_integer_flags_refuse_fractions_and_suffixes_in_one_line(tmp_path, args, expect):
    one_line(run_cli("serve", *args, "--db", str(tmp_path / "t.db")), expect)


@pytest.mark.parametrize("env,expect", [
    ({"RWKV_MAX_BATCH": "1.5e0"}, "RWKV_MAX_BATCH='1.5e0' is not a valid whole number"),
    ({"RWKV_MAX_BATCH": "1e999"}, "RWKV_MAX_BATCH='1e999' is not a valid whole number"),
    ({"RWKV_MAX_BATCH": "2e1"}, None),
    ({"RWKV_DIRECT_STREAM": ""}, "RWKV_DIRECT_STREAM='' is not a valid boolean"),
    ({"RWKV_DIRECT_STREAM": " OFF "}, None),
])  # fmt: skip
def test_environment_integers_are_whole_and_an_empty_boolean_is_refused(env, expect):
    if expect is None:
        Settings.from_env(env)
    else:
        with pytest.raises(ValueError, match=re.escape(expect)):
            Settings.from_env(env)


@pytest.mark.parametrize("args,env", [(["--port", "99999"], {}), (["--port", "-5"], {}), ([], {"RWKV_PORT": "70000"})])
def test_a_port_out_of_range_stops_the_start(tmp_path, args, env):
    r = run_cli("serve", *args, "--db", str(tmp_path / "t.db"), env=env)
    one_line(r, "--port", "not a port (0 to 65535")


def test_numbers_problem():
    assert numbers_problem(Settings()) is None and numbers_problem(Settings(port=0)) is None
    assert numbers_problem(Settings(port=65536)) == "--port 65536: not a port (0 to 65535; 0: any free port)"
    assert numbers_problem(Settings(max_batch=-1)) == "--max-batch -1: must be 0 or more"


def test_port_0_logs_the_port_bound(tmp_path):
    match, log = serve_until(["--port", "0", "--db", str(tmp_path / "t.db")], r"listening on port (\d+) \(--port 0\)")
    assert match, log[-3000:]
    assert f"127.0.0.1:{match[1]}" in log and "http://127.0.0.1:0 " not in log


# --- 4. a port in use -----------------------------------------------------------------------------


def _listener(reuse: bool = True) -> socket.socket:
    s = socket.socket()
    if reuse:  # as uvicorn's (asyncio's) listening socket
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("reuse", [True, False])
def test_port_problem_sees_a_listener(reuse):
    with _listener(reuse) as busy:
        port = busy.getsockname()[1]
        problem = port_problem("127.0.0.1", port) or ""
    assert problem.startswith(f"--port {port}: cannot listen on 127.0.0.1:{port}") and "in use" in problem


def test_the_port_probe_passes_a_port_left_in_time_wait():
    """SO_REUSEADDR as asyncio sets it: a port whose earlier server closed its connections
    (TIME_WAIT: a quick restart) can be listened on, so the probe must not refuse it."""
    srv = _listener()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server's side closes first: its end waits in TIME_WAIT
    time.sleep(0.1)
    cli.close()
    srv.close()
    with socket.socket() as plain:
        try:
            plain.bind(("127.0.0.1", port))
        except OSError:
            pass  # taken for a bind without SO_REUSEADDR
        else:
            pytest.skip("this system lets a port in TIME_WAIT be bound without SO_REUSEADDR")
    assert port_problem("127.0.0.1", port) is None


def test_the_port_probe_is_closed():
    with _listener() as s:
        port = s.getsockname()[1]
    assert port_problem("127.0.0.1", port) is None
    with socket.socket() as again:  # no SO_REUSEADDR: an open probe would hold the port
        again.bind(("127.0.0.1", port))
        again.listen()


def test_a_port_in_use_stops_the_start_before_loading(tmp_path):
    with _listener() as busy:
        t0 = time.monotonic()
        r = run_cli("serve", "--port", str(busy.getsockname()[1]), "--db", str(tmp_path / "t.db"))
    one_line(r, "Address already in use")
    assert "loading" not in r.stderr and time.monotonic() - t0 < 30


def test_a_host_that_does_not_resolve_stops_the_start(tmp_path):
    assert "--host 'no-such-host.invalid'" in (port_problem("no-such-host.invalid", 8000) or "")


# --- 5. the task database -------------------------------------------------------------------------


def test_database_problem(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert database_problem(str(tmp_path / "new" / "deeper" / "t.db")) is None  # plain paths: folders made
    assert "--db '': empty" in (database_problem("") or "") and database_problem("sqlite://") is None
    assert "is a folder" in (database_problem(str(tmp_path)) or "")
    assert f"{afile} is a file, not a folder" in (database_problem(str(afile / "x.db")) or "")
    assert "no folder" in (database_problem(f"sqlite:///{tmp_path}/missing/t.db") or "")
    assert database_problem(f"sqlite:///{tmp_path}/t.db") is None
    mysql = database_problem(f"mysql://u:{SECRET}@h/db") or ""
    assert "unsupported database mysql://" in mysql and "postgresql://" in mysql and SECRET not in mysql
    assert "unsupported" in (database_problem("postgresql+psycopg2://u@h/db") or "")
    pytest.importorskip("asyncpg")
    assert database_problem(f"postgresql://u:{SECRET}@h/db") is None  # reachability: database_open_problem


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_database_folder_without_write_permission(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert "permission denied" in (database_problem(str(ro / "t.db")) or "")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("what,expect", [
    ("folder", "is a folder"), ("under a file", "is a file, not a folder"),
    ("mysql", "unsupported database mysql://"), ("damaged", "damaged"),
])  # fmt: skip
def test_a_database_that_cannot_be_opened_stops_the_start_before_loading(tmp_path, what, expect):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "bad.db").write_bytes(b"this is not a SQLite database" * 200)
    db = {"folder": str(tmp_path), "under a file": str(tmp_path / "afile" / "t.db"),
          "mysql": f"mysql://u:{SECRET}@localhost/db", "damaged": str(tmp_path / "bad.db")}[what]  # fmt: skip
    r = run_cli("serve", "--port", "0", "--db", db)
    line = one_line(r, "--db", expect)
    assert "could not load the model" not in line and "MySQLdb" not in line and SECRET not in r.stderr


def test_an_unreachable_postgresql_stops_the_start_before_loading():
    pytest.importorskip("asyncpg")
    with _listener() as s:  # a port nothing listens on once closed
        port = s.getsockname()[1]
    r = run_cli("serve", "--port", "0", "--db", f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/db")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert line.startswith("rwkv-server: --db postgresql://postgres:***@127.0.0.1:") and "cannot open" in line
    assert "ConnectionRefusedError" in line and SECRET not in r.stderr and "loading" not in r.stderr


def test_load_failure_names_what_failed():
    app = SimpleNamespace(state=SimpleNamespace(load_error=f"OSError: postgresql://u:{SECRET}@h/db"))
    assert load_failure(app) == "could not load the model or start the task store: OSError: postgresql://u:***@h/db"
    app.state.load_stage = "task database"
    assert load_failure(app).startswith("could not open the task database: OSError")
    app.state.load_stage = "model"
    assert load_failure(app).startswith("could not load the model: OSError")


# --- 6. the other subcommands ---------------------------------------------------------------------


@pytest.mark.parametrize("args,expect", [
    (["synth", "bogus", "OUT"], "unknown synthetic preset 'bogus'"),
    (["synth", "tiny:abc", "OUT"], "bad seed 'abc'"),
    (["synth", "tiny", "/nonexistent/x.pth"], "no folder /nonexistent"),
    (["synth", "tiny", "TMP"], "is a folder"),
    (["quantize", "CKPT", "/nonexistent/q.pth", "--quant", "int8"], "no folder /nonexistent"),
    (["quantize", "TMP/missing.pth", "OUT", "--quant", "int8"], "no such checkpoint file"),
    (["quantize", "synthetic:tiny", "OUT", "--quant", "int8"], "rwkv-server synth tiny tiny.pth"),
    (["generate", "--max-tokens", "-3", "hi"], "--max-tokens -3: must be 0 to 1,048,576 (the API's bounds)"),
    (["generate", "--temperature", "-1", "hi"], "--temperature -1.0: must be 0 to 5 (the API's bounds)"),
    (["generate", "--top-p", "1.5", "hi"], "--top-p 1.5: must be 0 to 1 (the API's bounds)"),
    # the API's bounds (server.engine.types.LIMITS), before the model loads
    (["generate", "--temperature", "nan", "hi"], "--temperature nan: must be a finite number"),
    (["generate", "--temperature", "100", "hi"], "--temperature 100.0: must be 0 to 5"),
    (["generate", "--max-tokens", "2000000", "hi"], "--max-tokens 2000000: must be 0 to 1,048,576"),
    (["generate", "--seed", "-1", "hi"], "--seed -1: must be 0 to 9,223,372,036,854,775,807"),
    (["generate", "--stop", "", "hi"], "--stop: each stop string has 1 to 256 characters"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "--model", "TMP/missing.pth", ""], "the prompt is empty"),  # before the model too
])  # fmt: skip
def test_subcommand_arguments_fail_with_one_line(tmp_path, capsys, args, expect):
    ckpt = tmp_path / "ckpt.pth"
    ckpt.write_bytes(b"never read: the output is checked first")
    subst = {"OUT": str(tmp_path / "out.pth"), "CKPT": str(ckpt)}
    argv = [subst.get(a, a).replace("TMP", str(tmp_path)) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rwkv-server") and expect in err[0], err
    assert "synthetic:<preset>" not in err[0]
    assert not (tmp_path / "out.pth").exists()


def test_a_checkpoint_that_does_not_load_is_named_as_the_model(tmp_path):
    # past the checks, the app records which step failed: the last line says the model, not
    # "the model or the task store"
    bad = tmp_path / "broken.pth"
    bad.write_bytes(b"not a checkpoint")
    r = run_cli("serve", "--port", "0", "--model", str(bad), "--db", str(tmp_path / "t.db"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("rwkv-server: could not load the model: "), r.stderr[-2000:]


def test_a_checkpoint_that_generate_cannot_load_ends_it_with_one_line(tmp_path):
    import torch

    fake, state, broken = tmp_path / "fake.safetensors", tmp_path / "state.pth", tmp_path / "broken.pth"
    fake.write_bytes(b"{}")
    torch.save({"blocks.0.att.time_state": torch.zeros(2, 4, 4)}, state)  # a state file, not a model
    broken.write_bytes(b"not a checkpoint")
    for path, why in ((fake, "unsupported checkpoint format"), (state, "not an RWKV-7 checkpoint"),
                      (broken, "cannot read")):  # fmt: skip
        r = run_cli("generate", "--model", str(path), "hi")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith("rwkv-server generate: could not load the model: "), lines
        assert why in lines[0], lines[0]


def test_port_0_logs_the_port_it_bound_when_ready(tmp_path):
    m, log = serve_until(["--port", "0", "--db", str(tmp_path / "t.db")], r"ready: listening on http://[^:]+:(\d+)")
    assert m is not None and int(m.group(1)) > 0, log[-2000:]
