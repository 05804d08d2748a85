"""The command line: --help lists every Settings flag, env defaults show, synth writes a loadable
.pth, generate prints a continuation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.cli import main
from server.cli_parser import parse_int
from server.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_serve_help_lists_every_setting_with_env_default(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in out, f.name
        assert f"RWKV_{f.name.upper()}" in out, f.name
    assert "--no-cuda-graphs" in out


def test_help_without_subcommand_and_env_defaults():
    r = run_cli("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "synth" in r.stdout and "generate" in r.stdout
    r = run_cli("serve", "--help", env={"RWKV_MAX_BATCH": "7"})
    assert "now: 7" in r.stdout.replace("\n", " ").replace("  ", " ")


def test_help_never_shows_secrets(monkeypatch, capsys):
    """--help output gets pasted into tickets: API keys are never shown, a database URL's
    password is ***; byte sizes read in GiB / MiB beside the number."""
    monkeypatch.setenv("RWKV_API_KEYS", "topsecret123,other-key")
    monkeypatch.setenv("RWKV_DB", "postgresql://user:pw123@db.example/tasks")
    monkeypatch.setenv("RWKV_MAX_BODY_BYTES", str(8 * 1024**2))
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "topsecret123" not in out and "other-key" not in out and "pw123" not in out
    assert "now: (set, not shown)" in out and "postgresql://user:***@db.example/tasks" in out
    assert "now: 8388608 (8 MiB)" in out


def test_bad_flags_and_env_fail_cleanly():
    r = run_cli("--max-batch", "lots")
    assert r.returncode == 2 and "max-batch" in r.stderr
    r = run_cli("serve", env={"RWKV_PORT": "eighty"})
    assert r.returncode == 2 and "RWKV_PORT" in r.stderr


def test_parse_int_sizes():
    assert parse_int("512MiB") == 512 * 1024**2
    assert parse_int("2GiB") == 2 * 1024**3
    assert parse_int("1.5G") == int(1.5 * 1024**3)
    assert parse_int("2e9") == 2_000_000_000 and parse_int("42") == 42


def test_synth_writes_a_loadable_checkpoint(tmp_path, capsys):
    from server.model import load_model

    out = tmp_path / "tiny.pth"
    assert main(["synth", "tiny:2", str(out)]) == 0
    assert "rwkv7-L2-C128" in capsys.readouterr().out
    sd = torch.load(out, map_location="cpu", weights_only=True)
    assert sd["emb.weight"].dtype == torch.bfloat16
    model = load_model(str(out))
    assert model.shape.n_layer == 2 and model.shape.n_embd == 128 and model.name == "tiny.pth"
    logits = model.forward([[1, 2, 3]], model.zero_state(1))
    assert logits.shape == (1, 65536) and torch.isfinite(logits).all()


def test_generate_prints_a_continuation():
    r = run_cli("generate", "--model", "synthetic:tiny", "--max-tokens", "5", "--seed", "1", "Hello there")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello there") and len(r.stdout) > len("Hello there")
    assert "tokens" in r.stderr


def test_serve_with_a_bad_model_exits_with_a_message(tmp_path):
    r = run_cli("serve", "--model", str(tmp_path / "missing.pth"))
    assert r.returncode == 2 and "no such file" in r.stderr
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    r = run_cli("serve", "--model", str(bad), "--port", "0", "--db", str(tmp_path / "t.db"))
    assert r.returncode == 1 and "could not load the model" in r.stderr, r.stderr[-2000:]


def test_model_switches_are_settings_with_env_and_flags():
    """kernels, kernel_cache and the load-delay test hook: typed fields read from RWKV_* like every
    other (nothing below Settings reads the environment), with a closed set of kernel choices."""
    s = Settings.from_env({"RWKV_KERNELS": "torch", "RWKV_KERNEL_CACHE": "/tmp/k", "RWKV_DEBUG_LOAD_DELAY": "1.5"})
    assert (s.kernels, s.kernel_cache, s.debug_load_delay) == ("torch", "/tmp/k", 1.5)
    d = Settings()
    assert (d.kernels, d.kernel_cache, d.debug_load_delay) == ("auto", "~/.cache/rwkv-server/kernels", 0.0)
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--kernels", "fast"])
    assert ei.value.code == 2


def test_load_services_passes_kernels_and_cache_to_the_model(monkeypatch, tmp_path):
    """load_services hands the settings' kernels / kernel_cache to load_model (on cpu the ops are
    pure torch whatever they say; the model keeps what it was asked)."""
    import server.model.loader as model_loader
    from server.api.loading import load_services

    seen = {}
    real = model_loader.load_model

    def spy(spec, **kw):
        seen.update(kw)
        return real(spec, **kw)

    monkeypatch.setattr(model_loader, "load_model", spy)
    monkeypatch.setattr("server.model.load_model", spy)
    settings = Settings(device="cpu", kernels="torch", kernel_cache=str(tmp_path / "kc"), stats_interval=0,
                        db=str(tmp_path / "t.db"))
    sv = load_services(settings)
    try:
        assert seen["kernels"] == "torch" and seen["kernel_cache"] == str(tmp_path / "kc")
    finally:
        sv.engine.shutdown()
    assert not (tmp_path / "kc").exists()  # cpu: nothing built
