"""The subcommands' failures after their checks end with one line and a non-zero status, never a
traceback: a generation that fails (`finish error`: a checkpoint with a NaN weight, a failed
engine step), a model that does not fit in memory (generate), an output file torch.save cannot
write (synth, quantize: torch raises RuntimeError, not OSError), `-` as an output path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import main

ROOT = Path(__file__).resolve().parents[1]
HUGE = "synthetic:L2-C128-V999999999999999"  # 5e17 bytes of embeddings: past any address space


def run_py(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def generate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_py(f"import sys; from server.cli import main; sys.exit(main({['generate', *args]!r}))", env)


def last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    assert main(["synth", "tiny:1", str(path), "--dtype", "fp32"]) == 0
    return path


def test_generate_ends_with_status_1_when_the_generation_fails(tiny, tmp_path):
    import torch

    sd = torch.load(tiny, map_location="cpu", weights_only=True)
    sd["blocks.0.att.key.weight"][0, 0] = float("nan")  # loads; every step's logits are NaN
    nan = tmp_path / "nan.pth"
    torch.save(sd, nan)
    r = generate("--model", str(nan), "--max-tokens", "5", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last_line(r).startswith("rwkv-server generate: generation failed: "), r.stderr[-3000:]
    assert "finish error" in r.stderr


FAILING_STEP = """
import sys
from server.engine import runner
def launch(self, plan):
    raise RuntimeError("injected step failure")
runner.Runner.launch = launch
from server.cli import main
sys.exit(main(["generate", "--model", "synthetic:tiny", "--max-tokens", "3", "hi"]))
"""


@pytest.mark.parametrize("level", ["warning", "debug"])
def test_an_engine_error_shows_its_traceback_at_debug_only(level):
    r = run_py(FAILING_STEP, env={"RWKV_LOG_LEVEL": level})
    assert r.returncode == 1, r.stderr[-3000:]
    assert last_line(r).startswith("rwkv-server generate: generation failed: ") and "injected" in last_line(r)
    assert ("Traceback" in r.stderr) == (level == "debug"), r.stderr[-3000:]


def test_generate_reports_a_model_too_large_for_memory_in_one_line():
    r = generate("--model", HUGE, "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = last_line(r)
    assert line.startswith("rwkv-server generate: could not load the model: RuntimeError: "), line
    assert "allocate" in line and "[enforce fail" not in line, line


def test_synth_reports_a_model_too_large_for_memory_in_one_line(tmp_path, capsys, monkeypatch):
    # (synth refuses a checkpoint larger than the machine's memory before drawing it: on a system
    # that does not say its size, the allocation's failure is the line)
    monkeypatch.setattr("server.checks_args.physical_memory", lambda: None)
    assert main(["synth", HUGE.removeprefix("synthetic:"), str(tmp_path / "x.pth")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rwkv-server: synth failed: RuntimeError: "), err
    assert "allocate" in err[0], err


# a path whose folder can be written (the checks pass) but which no file can have: torch.save's
# writer fails with a RuntimeError (the same as /sys/x.pth as root)
def long_name(tmp_path: Path) -> str:
    return str(tmp_path / ("x" * 300 + ".pth"))


def test_synth_reports_a_file_it_cannot_write_in_one_line(tmp_path, capsys):
    out = long_name(tmp_path)
    assert main(["synth", "tiny", out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rwkv-server: cannot write {out}: open file failed with strerror: File name too long"], err


def test_quantize_reports_a_file_it_cannot_write_in_one_line(tiny, tmp_path, capsys):
    out = long_name(tmp_path)
    assert main(["quantize", str(tiny), out, "--quant", "int8", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rwkv-server: cannot write {out}: "), err
    assert "File name too long" in err[0] and "[enforce fail" not in err[0], err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["synth", "quantize"])
def test_a_dash_is_no_output_path(command, tiny, tmp_path, monkeypatch, capsys):
    def argv(out: str) -> list[str]:
        if command == "synth":
            return ["synth", "tiny", out]
        return ["quantize", str(tiny), out, "--quant", "int8", "--device", "cpu"]

    monkeypatch.chdir(tmp_path)
    assert main(argv("-")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rwkv-server: -: ") and "not to standard output" in err[0], err
    assert not (tmp_path / "-").exists()
    assert main(argv("./-")) == 0 and (tmp_path / "-").is_file()  # the way to a file named '-'
