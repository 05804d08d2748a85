"""What the command line checks and interprets before any work: a device this machine lacks ends
at once with one line and status 2 (before the port is bound); the generate prompt's backslash
escapes are interpreted ('-' reads stdin as it is)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.checks import device_problem
from server.cli import prompt_text

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _missing_device() -> str:
    """A CUDA device this machine does not have."""
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def test_a_missing_device_fails_before_binding_with_one_line(tmp_path):
    r = run_cli("serve", "--device", _missing_device(), "--port", "0", "--db", str(tmp_path / "t.db"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rwkv-server: --device"), r.stderr
    assert "starting on" not in r.stderr and "Uvicorn" not in r.stderr  # never got to the server


@pytest.mark.parametrize("device,ok", [("cpu", True), ("auto", True), ("gpu", False), ("mps", False),
                                       ("cuda:99", False)])
def test_device_problem(device, ok):
    problem = device_problem(device)
    assert (problem is None) == ok, problem
    if problem is not None:
        assert repr(device) in problem and "\n" not in problem


def test_generate_checks_the_device_too():
    r = run_cli("generate", "--device", _missing_device(), "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_prompt_escapes():
    assert prompt_text(r"User: Hi\n\nAssistant:") == "User: Hi\n\nAssistant:"
    assert prompt_text(r"tab\there, backslash \\n, \u00e9 and é 世界 🌍") == "tab\there, backslash \\n, é and é 世界 🌍"
    with pytest.raises(ValueError, match="escape"):
        prompt_text("broken \\x4")


def test_generate_interprets_escapes_and_reads_stdin():
    r = run_cli("generate", "--max-tokens", "2", "--seed", "1", r"User: Hi\n\nAssistant:")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("User: Hi\n\nAssistant:")
    r = run_cli("generate", "--max-tokens", "2", "--seed", "1", "-", stdin="Line one\\n\nline two")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Line one\\n\nline two")  # stdin as it is
    r = run_cli("generate", "--help")
    assert "escapes" in r.stdout and "stdin" in r.stdout


@pytest.mark.parametrize("device,state,expect", [("cuda", "auto", "fp16"), ("cuda:1", "auto", "fp16"),
                                                 ("cpu", "auto", "fp32"), ("cuda", "fp32", "fp32"),
                                                 ("cpu", "fp16", "fp16")])  # fmt: skip
def test_state_dtype_auto_is_fp16_on_cuda_only(device, state, expect):
    from server.config import Settings

    s = Settings.from_env({"RWKV_DEVICE": device, "RWKV_STATE_DTYPE": state})
    assert s.state_dtype == state and s.resolved_state_dtype() == expect


@pytest.mark.parametrize("var,value,line", [
    ("RWKV_QUANT", "int4", "--quant 'int4': use one of none, int8, fp8"),
    ("RWKV_SPARSE_FFN", "maybe", "--sparse-ffn 'maybe': use one of auto, on, off"),
    ("RWKV_KERNELS", "triton", "--kernels 'triton': use one of auto, torch, cuda"),
])  # fmt: skip
def test_a_bad_choice_in_the_environment_fails_before_loading(tmp_path, var, value, line):
    env = {**os.environ, "PYTHONPATH": str(ROOT), var: value}
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--db", str(tmp_path / "t.db")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"rwkv-server: {line}"]


def test_the_log_level_from_the_environment_is_read_in_any_case():
    from server.checks import settings_problem
    from server.config import Settings

    assert settings_problem(Settings(log_level="INFO")) is None
    assert "--log-level 'loud'" in (settings_problem(Settings(log_level="loud")) or "")


def test_generate_with_int8_weights_quantizes_at_load():
    """RWKV_QUANT reaches the model (on a CPU the loader warns that 8-bit weights only save
    memory there), and it generates."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_QUANT": "int8"}
    r = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--max-tokens", "4", "--seed", "1", "Hi"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "int8 weights on cpu: " in r.stderr and "[4 tokens, finish length" in r.stderr


def readme_settings_rows() -> dict[str, str]:
    """The meaning column of README.md's settings tables, by field name."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Settings"):text.index("## Routes")]
    rows = re.findall(r"^\| `--([a-z-]+)`.*?\| `RWKV_[A-Z_]+` \| [^|]* \| (.*) \|$", section, re.MULTILINE)
    return {flag.replace("-", "_"): meaning for flag, meaning in rows}


def test_the_readme_settings_table_says_what_help_says():
    """Each setting's row in README.md holds its --help text (server/config.py's docstring) word for word."""
    from server.config import Settings, field_docs

    docs, rows = field_docs(), readme_settings_rows()
    assert set(rows) == {f.name for f in dataclasses.fields(Settings)}
    differ = {name: (rows[name], docs[name]) for name in docs if rows[name] != docs[name]}
    assert not differ, differ


def test_the_quant_help_names_the_int8_head_copy():
    from server.config import field_docs
    from server.model.qlinear import HEAD8_MAX_ROWS

    doc = field_docs()["quant"]
    assert "head stay 16-bit" not in doc and f"int8 copy of it that products of up to {HEAD8_MAX_ROWS} rows read" in doc
