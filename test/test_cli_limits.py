"""Start-up input that used to pass the checks or fail with a traceback: each ends with one line
and status 2 before the model loads (or, where only the loaded model tells, status 1 with one
line), and what the log says at start. The tests run the real CLI: in a subprocess, or through
`main()` in this process (`in_process`) where the refusal comes before anything starts.

A prompt over max_prompt_tokens, max_batch's bound and the slot pool against memory, an empty
--db and an in-memory one, a synthetic seed out of int64, flag abbreviations, files that cannot
be read (permission denied), generate's --max-tokens over RWKV_MAX_TOKENS_LIMIT, RWKV_* variables
that are no setting, --kernels cuda on the CPU, an IPv6 host's URL, quantize on a folder, a plain
pickle's warnings, a pre-quantized file's misshapen codes, a pre-quantized file's CPU warning,
generate's and synth's help, a synthetic checkpoint larger than memory."""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from util_server import serve_until

from server.cli import main

ROOT = Path(__file__).resolve().parents[1]
DROP_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
"""Root without the capabilities that bypass file permissions: a file of mode 000 then refuses it
(setpriv --reuid=nobody would also need the interpreter to be readable by nobody: it often is not)."""


def run_cli(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu", "RWKV_STATS_INTERVAL": "0", **(env or {})}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def one_line(r: subprocess.CompletedProcess, *expect: str, status: int = 2) -> str:
    """The run ended with `status` and one `rwkv-server...` line on stderr holding each of `expect`."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("rwkv-server"), r.stderr[-3000:]
    for text in expect:
        assert text in lines[0], lines[0]
    return lines[0]


def in_process(capsys, *argv: str, status: int = 2) -> str:
    """`main(argv)` in this process ended with `status` and one stderr line: that line."""
    assert main(list(argv)) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rwkv-server"), lines
    return lines[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """tiny.pth (fp32) and its int8 copy q.pth, written by the CLI in this process."""
    d = tmp_path_factory.mktemp("ckpt")
    assert main(["synth", "tiny:1", str(d / "tiny.pth"), "--dtype", "fp32"]) == 0
    assert main(["quantize", str(d / "tiny.pth"), str(d / "q.pth"), "--quant", "int8", "--device", "cpu"]) == 0
    return {"tiny": d / "tiny.pth", "q": d / "q.pth"}


# --- 1. a prompt over max_prompt_tokens -----------------------------------------------------------


def test_a_prompt_over_max_prompt_tokens_is_one_line_before_loading():
    r = run_cli("generate", env={"RWKV_MAX_PROMPT_TOKENS": "2"})  # the default prompt has 8 tokens
    one_line(r, "the prompt has 8 tokens (max 2; RWKV_MAX_PROMPT_TOKENS)")
    assert "SYNTHETIC" not in r.stderr  # refused before the model loads


# --- 2. max_batch's bound, and the slot pool against memory --------------------------------------


@pytest.mark.parametrize("args,env", [
    (["serve", "--max-batch", "1e30"], {}),
    (["serve", "--max-batch", "99999999999999999999"], {}),
    (["generate", "hi"], {"RWKV_MAX_BATCH": "1e30"}),
])  # fmt: skip
def test_max_batch_has_an_upper_bound(tmp_path, args, env):
    if args[0] == "serve":
        args = [*args, "--port", "0", "--db", str(tmp_path / "t.db")]
    one_line(run_cli(*args, env=env), "--max-batch ", "must be at most 65,536")


def test_numbers_problem_bounds_max_batch():
    from server.checks import numbers_problem
    from server.config import Settings

    assert numbers_problem(Settings(max_batch=65_536)) is None
    assert "must be at most 65,536" in (numbers_problem(Settings(max_batch=65_537)) or "")


POOL_TOO_BIG = """
import sys
from server import checks_args
checks_args.physical_memory = lambda: 8 * 1024**2  # a machine of 8 MiB: 64 tiny slots take ~25 MiB
from server.cli import main
sys.exit(main(["generate", "--max-tokens", "1", "hi"]))
"""


def test_a_slot_pool_larger_than_memory_is_refused_before_it_is_allocated():
    r = run_py(POOL_TOO_BIG, env={"RWKV_MAX_BATCH": "64"})
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert line.startswith("rwkv-server generate: could not load the model: ValueError: --max-batch: a slot pool "
                           "of 64 slots would take"), line  # fmt: skip
    assert "more than the 8.0 MiB this machine has" in line, line


# --- 3. the task database: empty, in memory ------------------------------------------------------


@pytest.mark.parametrize("args,env", [(["--db", ""], {}), ([], {"RWKV_DB": ""})])
def test_an_empty_database_is_refused(args, env):
    one_line(run_cli("serve", "--port", "0", *args, env=env, timeout=30), "--db '': empty")


def test_database_problem_refuses_empty():
    from server.checks import database_problem

    assert "empty" in (database_problem("") or "") and "empty" in (database_problem("  ") or "")
    assert database_problem("sqlite://") is None and database_problem(":memory:") is None


def test_an_in_memory_database_and_unknown_variables_are_warned_at_start():
    _, log = serve_until(["--port", "0", "--db", "sqlite://"], r"ready: listening",
                         env={"RWKV_API_KEY": "secret", "RWKV_V7_ON": "1"})  # fmt: skip
    assert "ready: listening" in log, log[-3000:]
    assert re.search(r"WARNING .*--db sqlite://: the task database is in memory: .*\(not persisted\)", log), log
    assert "database   in memory (not persisted; sqlite://)" in log, log
    warned = [line for line in log.splitlines() if "RWKV_API_KEY " in line]
    assert len(warned) == 1 and "RWKV_API_KEY is no setting of this server: ignored (did you mean RWKV_API_KEYS?)" \
        in warned[0], log  # fmt: skip
    assert "secret" not in log and "RWKV_V7_ON" not in log  # the rwkv package's switch is not ours to warn of


def test_settings_tell_an_in_memory_database():
    from server.config import Settings

    for db in (":memory:", "sqlite://", "sqlite+aiosqlite://", "sqlite:///:memory:"):
        assert Settings(db=db).db_in_memory(), db
    for db in ("rwkv_tasks.db", "sqlite:///t.db", "sqlite:////tmp/t.db", "postgresql://u@h/db"):
        assert not Settings(db=db).db_in_memory(), db


# --- 4. a synthetic seed out of range -------------------------------------------------------------


def test_a_synthetic_seed_out_of_range_is_one_line(tmp_path, capsys):
    big = "99999999999999999999999"
    assert "a seed is 0 to 9,223,372,036,854,775,807" in in_process(capsys, "synth", f"tiny:{big}", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    line = in_process(capsys, "generate", "--model", f"synthetic:tiny:{big}", "hi")
    assert line.startswith("rwkv-server generate: --model") and "a seed is 0 to" in line, line


# --- 5. no abbreviated flags -----------------------------------------------------------------------


@pytest.mark.parametrize("args,flag", [
    (["--max-tokens", "10"], "--max-tokens"),  # generate's flag: not serve's --max-tokens-limit
    (["--max-bat", "3"], "--max-bat"),
    (["serve", "--db-busy", "3"], "--db-busy"),
    (["generate", "--max-tok", "3", "hi"], "--max-tok"),
])  # fmt: skip
def test_abbreviated_flags_are_refused(args, flag):
    # (--port 99999 ends an old parser's run at its checks, had it taken the abbreviation)
    line = one_line(run_cli(*args, "--port", "99999", timeout=30), "unrecognized arguments")
    assert flag in line and "--port 99999: not a port" not in line


# --- 6. files that cannot be read -----------------------------------------------------------------


@functools.cache
def unprivileged() -> list[str] | None:
    """The command prefix under which a file of mode 000 cannot be read: none for a user other
    than root, setpriv dropping root's capabilities that bypass permissions, or None."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        locked = Path(d) / "locked"
        locked.write_bytes(b"x")
        locked.chmod(0)
        probe = subprocess.run([*DROP_DAC, sys.executable, "-c", f"open({str(locked)!r}, 'rb')"],
                               capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    return DROP_DAC if "PermissionError" in probe.stderr else None


@pytest.fixture
def unreadable(tmp_path) -> tuple[Path, list[str]]:
    prefix = unprivileged()
    if prefix is None:
        pytest.skip("running as root, and setpriv cannot drop the capabilities that read any file: no way to test "
                    "a file without read permission")  # fmt: skip
    path = tmp_path / "unread.pth"
    path.write_bytes(b"never read")
    path.chmod(0)
    return path, prefix


def test_generate_names_permission_denied(unreadable):
    path, prefix = unreadable
    one_line(run_cli("generate", "--model", str(path), "hi", prefix=prefix), f"--model '{path}'", "permission denied")


def test_serve_checks_the_model_is_readable_before_binding(unreadable, tmp_path):
    path, prefix = unreadable
    r = run_cli("serve", "--model", str(path), "--port", "0", "--db", str(tmp_path / "t.db"), prefix=prefix)
    one_line(r, "cannot read it (permission denied)")


def test_serve_checks_the_state_files_are_readable(unreadable, tmp_path):
    path, prefix = unreadable
    r = run_cli("serve", "--state", f"s={path}", "--port", "0", "--db", str(tmp_path / "t.db"), prefix=prefix)
    one_line(r, f"--state s={path}: cannot read it (permission denied)")


def test_quantize_names_permission_denied(unreadable, tmp_path):
    path, prefix = unreadable
    r = run_cli("quantize", str(path), str(tmp_path / "o.pth"), "--quant", "int8", prefix=prefix)
    one_line(r, f"{path}: cannot read it (permission denied)")


def test_the_checkpoint_reader_names_permission_denied(unreadable):
    path, prefix = unreadable
    code = f"from server.model.checkpoint import read_checkpoint\ntry: read_checkpoint({str(path)!r})\n" \
           "except Exception as e: print(type(e).__name__, e)"  # fmt: skip
    r = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert r.stdout.strip() == f"CheckpointError cannot read '{path}': permission denied", r.stdout + r.stderr


# --- 7. generate holds --max-tokens to RWKV_MAX_TOKENS_LIMIT ---------------------------------------


def test_generate_refuses_max_tokens_over_the_limit():
    one_line(run_cli("generate", "--max-tokens", "10", "hi", env={"RWKV_MAX_TOKENS_LIMIT": "5"}),
             "--max-tokens 10: above the limit of 5 tokens (RWKV_MAX_TOKENS_LIMIT)")  # fmt: skip
    # the default, held to the limit; a misspelt variable beside it is warned of (item 8)
    r = run_cli("generate", "--seed", "1", "hi", env={"RWKV_MAX_TOKENS_LIMIT": "5", "RWKV_MAX_TOKEN_LIMIT": "9"})
    assert r.returncode == 0 and "[5 tokens, finish length" in r.stderr, r.stderr[-3000:]
    assert "RWKV_MAX_TOKEN_LIMIT is no setting of this server: ignored (did you mean RWKV_MAX_TOKENS_LIMIT?)" \
        in r.stderr, r.stderr  # fmt: skip


# --- 8. RWKV_* variables that are no setting -------------------------------------------------------


def test_unknown_variables_are_warned_once_with_the_closest_setting():
    from server.config import warn_unknown_variables

    env = {"RWKV_MAX_BACH": "8", "RWKV_ZZZ_QQQ": "1", "RWKV_PORT": "1", "RWKV_JIT_ON": "0", "PATH": "/bin"}
    assert warn_unknown_variables(env) == [
        "RWKV_MAX_BACH is no setting of this server: ignored (did you mean RWKV_MAX_BATCH?)",
        "RWKV_ZZZ_QQQ is no setting of this server: ignored",
    ]
    assert warn_unknown_variables(env) == []  # once



# --- 9. --kernels cuda on the CPU -----------------------------------------------------------------


def test_kernels_cuda_on_the_cpu_is_refused(tmp_path, capsys, monkeypatch):
    # (a missing key file: an old check's line, had --kernels cuda passed)
    line = in_process(capsys, "serve", "--device", "cpu", "--kernels", "cuda", "--port", "0", "--db",
                      str(tmp_path / "t.db"), "--api-key-file", str(tmp_path / "nokeys"))  # fmt: skip
    assert line == "rwkv-server: --kernels cuda: needs a CUDA device, and this run is on cpu (use --kernels auto or " \
        "torch)"
    monkeypatch.setenv("RWKV_KERNELS", "cuda")
    assert "--kernels cuda: needs a CUDA" in in_process(capsys, "generate", "--device", "cpu", "hi")


# --- 10. an IPv6 host's URL -------------------------------------------------------------------------


def test_an_ipv6_host_is_in_brackets_in_the_url(tmp_path):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    _, log = serve_until(["--host", "::1", "--port", str(port), "--db", str(tmp_path / "t.db")], r"ready: listening")
    assert f"starting on http://[::1]:{port} " in log, log[-3000:]
    assert f"ready: listening on http://[::1]:{port}" in log, log[-3000:]


def test_listen_url():
    from server.config import Settings

    assert Settings(host="::1", port=80).listen_url() == "http://[::1]:80"
    assert Settings(host="0.0.0.0").listen_url(8) == "http://0.0.0.0:8"


# --- 11. messages: a folder, a pickle, misshapen codes, a pre-quantized file's warning ------------


def test_quantize_names_a_folder(tmp_path, capsys):
    (tmp_path / "dir.pth").mkdir()
    line = in_process(capsys, "quantize", str(tmp_path / "dir.pth"), str(tmp_path / "o.pth"), "--quant", "int8")
    assert line == f"rwkv-server: {tmp_path / 'dir.pth'}: is a folder; give the checkpoint file's path"


def test_a_plain_pickle_gives_one_line_without_torch_warnings(tmp_path):
    import pickle

    path = tmp_path / "pickle.pth"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    r = run_cli("generate", "--model", str(path), "hi")
    one_line(r, "could not load the model: CheckpointError: ", status=1)
    assert "Warning" not in r.stderr


KEY = "blocks.0.att.key.weight.q"


def test_misshapen_codes_are_named_as_the_codes(ckpts, tmp_path):
    import torch

    sd = torch.load(ckpts["q"], map_location="cpu", weights_only=True)
    sd[KEY] = sd[KEY][:64].contiguous()  # the scales' length no longer matches: the codes are wrong
    torch.save(sd, tmp_path / "bad.pth")
    line = one_line(run_cli("generate", "--model", str(tmp_path / "bad.pth"), "hi"), status=1)
    assert f"misshapen key '{KEY}': shape (64, 128), expected (128, 128)" in line and ".scale" not in line, line


def test_take_quantized_names_the_codes_and_then_the_scales(ckpts):
    import torch

    from server.model.checkpoint import CheckpointError
    from server.model.qfile import take_quantized

    good = torch.load(ckpts["q"], map_location="cpu", weights_only=True)
    for key, cut, expect in [(KEY, lambda t: t[:, :64], f"misshapen key '{KEY}': shape (128, 64)"),
                             (KEY[:-2] + ".scale", lambda t: t[:5], "weight.scale': torch.float32 (5,), expected")]:
        sd = dict(good)
        sd[key] = cut(sd[key]).contiguous()
        with pytest.raises(CheckpointError, match=re.escape(expect)):
            take_quantized(sd, torch.float32)


def test_a_pre_quantized_file_on_the_cpu_names_no_flag_the_user_never_gave(ckpts):
    r = run_cli("generate", "--model", str(ckpts["q"]), "--max-tokens", "1", "hi")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "int8 weights on cpu: " in r.stderr and "--quant int8" not in r.stderr, r.stderr


# --- 12. help, and a synthetic checkpoint larger than memory ---------------------------------------


def test_generate_help_shows_choices_and_defaults():
    out = " ".join(run_cli("generate", "--help").stdout.split())
    for text in ("--dtype {auto,fp32,fp16,bf16}", "cuda:N", "(default: 32", "(default: 1.0)", "(default: 0.3)"):
        assert text in out, (text, out)


def test_synth_help_names_the_custom_shape():
    out = " ".join(run_cli("synth", "--help").stdout.split())
    assert "L<layers>-C<embd>[-V<vocab>]" in out, out


def test_a_synthetic_checkpoint_larger_than_memory_is_refused(tmp_path, capsys):
    # (a huge vocabulary: an old synth failed at once on its first tensor, not after gigabytes)
    line = in_process(capsys, "synth", "L1-C64-V999999999999", str(tmp_path / "o.pth"))
    assert re.search(r"the checkpoint would be [0-9,.]+ GiB \([0-9,]+ values\), .* this machine has", line), line
    assert not (tmp_path / "o.pth").exists()


def test_synth_problem_sizes_the_shape_without_drawing_it():
    from server.checks_args import physical_memory, synth_problem

    if physical_memory() is None:
        pytest.skip("this system does not say how much memory it has")
    assert synth_problem("tiny", 2) is None
    assert "the checkpoint would be 24,744.2 GiB" in (synth_problem("L1-C1048576-V2", 2) or "")
