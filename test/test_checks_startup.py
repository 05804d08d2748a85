"""Start-up checks of the settings that used to pass them and fail later (or never): float settings
below 0, NaN or infinite; --prefill-chunk and --lease-timeout at 0; --state-store-dtype outside its
choices; an unknown synthetic preset; an explicit --few-shot file that cannot be read. Each ends
before the port is bound with one `rwkv-server: ...` line naming the flag and status 2. A few-shot
file that goes missing after the start answers 500 (the server's fault), not a client 400."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_cli_startup import one_line  # status 2 and one rwkv-server line
from util_server import inprocess_server

from server.api.errors import ApiError
from server.api.services import Services
from server.checks import few_shot_problem, model_problem, numbers_problem, serve_problem, settings_problem
from server.config import CHOICES, Settings

ROOT = Path(__file__).resolve().parents[1]


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "RWKV_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", *args], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip




# --- numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value,line", [
    ("stats_interval", -1.0, "--stats-interval -1.0: must be 0 or more"),
    ("header_timeout", -1.0, "--header-timeout -1.0: must be 0 or more"),
    ("header_timeout", float("nan"), "--header-timeout nan: must be a finite number"),
    ("body_timeout", float("nan"), "--body-timeout nan: must be a finite number"),
    ("body_timeout", float("inf"), "--body-timeout inf: must be a finite number"),
    ("tmp_task_ttl", -1.0, "--tmp-task-ttl -1.0: must be 0 or more"),
    ("db_busy_timeout", -0.5, "--db-busy-timeout -0.5: must be 0 or more"),
    ("debug_load_delay", float("-inf"), "--debug-load-delay -inf: must be a finite number"),
    ("lease_timeout", 0.0, "--lease-timeout 0.0: must be more than 0"),
    ("lease_timeout", -5.0, "--lease-timeout -5.0: must be more than 0"),
    ("prefill_chunk", 0, "--prefill-chunk 0: must be more than 0"),
    ("max_body_bytes", 0, "--max-body-bytes 0: must be more than 0"),  # 0 would refuse every request
    ("max_prompt_tokens", 0, "--max-prompt-tokens 0: must be more than 0"),
])  # fmt: skip
def test_numbers_problem_refuses_numbers_out_of_range(name, value, line):
    assert numbers_problem(Settings(**{name: value})) == line


@pytest.mark.parametrize("name,value", [
    ("stats_interval", 0.0), ("header_timeout", 0.0), ("body_timeout", 0.0), ("tmp_task_ttl", 0.0),
    ("db_busy_timeout", 0.0), ("debug_load_delay", 0.0), ("lease_timeout", 0.5), ("prefill_chunk", 1),
    ("max_batch", 0), ("max_queue", 0), ("max_body_bytes", 1), ("max_prompt_tokens", 1),
])  # fmt: skip
def test_numbers_problem_takes_the_documented_edges(name, value):
    assert numbers_problem(Settings(**{name: value})) is None


@pytest.mark.parametrize("args,env,expect", [
    (["--header-timeout", "nan"], {}, "--header-timeout nan: must be a finite number"),
    (["--stats-interval", "-1"], {}, "--stats-interval -1.0: must be 0 or more"),
    (["--lease-timeout", "0"], {}, "--lease-timeout 0.0: must be more than 0"),
    ([], {"RWKV_PREFILL_CHUNK": "0"}, "--prefill-chunk 0: must be more than 0"),
    (["--max-body-bytes", "0"], {}, "--max-body-bytes 0: must be more than 0"),
    ([], {"RWKV_MAX_PROMPT_TOKENS": "0"}, "--max-prompt-tokens 0: must be more than 0"),
])  # fmt: skip
def test_a_number_out_of_range_stops_the_start_before_binding(tmp_path, args, env, expect):
    assert one_line(run_serve(*args, "--db", str(tmp_path / "t.db"), env=env)) == f"rwkv-server: {expect}"


# --- choices ---------------------------------------------------------------------------------------


def test_the_state_store_dtype_choices_are_the_task_stores():
    from server.tasks.config import STORE_DTYPES

    assert set(CHOICES["state_store_dtype"]) == set(STORE_DTYPES)


def test_a_state_store_dtype_outside_its_choices_stops_the_start(tmp_path):
    line = "rwkv-server: --state-store-dtype 'fp8': use one of native, fp16"
    assert one_line(run_serve("--db", str(tmp_path / "t.db"), env={"RWKV_STATE_STORE_DTYPE": "fp8"})) == line
    r = run_serve("--state-store-dtype", "bf16", "--db", str(tmp_path / "t.db"))  # argparse's own choices
    assert r.returncode == 2 and "--state-store-dtype: invalid choice: 'bf16'" in r.stderr, r.stderr


# --- the synthetic model ---------------------------------------------------------------------------


@pytest.mark.parametrize("model,expect", [
    ("synthetic:tiny", None), ("synthetic:tiny:3", None), ("synthetic:L2-C128", None),
    ("synthetic:huge", "--model 'synthetic:huge': unknown synthetic preset 'huge'"),
    ("synthetic:tiny:x", "--model 'synthetic:tiny:x': bad seed 'x'"),
    ("synthetic:", "--model 'synthetic:': unknown synthetic preset ''"),
    ("synthetic:tiny:1:2", "--model 'synthetic:tiny:1:2': bad synthetic spec"),
    ("synthetic:L0-C0", "--model 'synthetic:L0-C0': a model needs a layer"),
])  # fmt: skip
def test_model_problem_parses_a_synthetic_spec(model, expect):
    problem = model_problem(model)
    assert (problem is None) == (expect is None), problem
    assert expect is None or (problem is not None and problem.startswith(expect) and "\n" not in problem)


def test_the_help_says_what_max_queue_0_means():
    from server.config import field_docs

    assert "0: no bound" in field_docs()["max_queue"]


def test_model_problem_names_a_folder(tmp_path):
    line = f"--model {str(tmp_path)!r}: is a folder (give an RWKV-7 .pth file or synthetic:<preset>)"
    assert model_problem(str(tmp_path)) == line
    assert "no such file" in (model_problem(str(tmp_path / "none.pth")) or "")


def test_state_file_messages(tmp_path):
    state = tmp_path / "s.pth"
    state.write_bytes(b"x")
    assert settings_problem(Settings(device="cpu", states="bad")) == "--state: 'bad' is not NAME=PATH"
    line = settings_problem(Settings(device="cpu", states=f".a={state}"))
    assert line is not None and "starting with a letter or digit" in line, line
    assert settings_problem(Settings(device="cpu", states=f"a={tmp_path}")) == f"--state a={tmp_path}: is a folder"


def test_device_is_not_checked_when_devices_names_the_engines():
    import torch

    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert settings_problem(Settings(devices="cpu,cpu", device=missing)) is None
    assert (settings_problem(Settings(device=missing)) or "").startswith(f"--device {missing!r}")


def test_the_log_level_flag_takes_any_case(tmp_path):
    # past the flag parsing: the port's check is what stops it
    one_line(run_serve("--log-level", "DEBUG", "--port", "99999", "--db", str(tmp_path / "t.db")), "--port 99999")
    r = run_serve("--log-level", "loud", "--db", str(tmp_path / "t.db"))
    assert r.returncode == 2 and "invalid choice: 'loud'" in r.stderr, r.stderr


def test_a_bad_variable_stops_serve_only(tmp_path):
    env = {"RWKV_MAX_BATCH": "1.5"}
    line = "rwkv-server: bad environment: RWKV_MAX_BATCH='1.5' is not a valid whole number"
    assert one_line(run_serve("--db", str(tmp_path / "t.db"), env=env)) == line
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    for args in (["--help"], ["serve", "--help"], ["synth", "tiny", str(tmp_path / "x.pth")]):
        r = subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=full_env,
                           capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert r.returncode == 0, (args, r.stderr[-2000:])
        if args[0] == "serve":  # the help names the bad value as the one in effect
            assert "now: RWKV_MAX_BATCH='1.5' is not a valid whole number" in " ".join(r.stdout.split())
    r = subprocess.run([sys.executable, "-m", "server.cli", "generate", "hi"], cwd=ROOT, env=full_env,
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    one_line(r, "rwkv-server generate: bad environment: RWKV_MAX_BATCH='1.5'")  # generate runs an engine
    # a flag given wins over the variable: the bad value is never used
    one_line(run_serve("--max-batch", "4", "--port", "99999", "--db", str(tmp_path / "t.db"), env=env), "--port 99999")


def test_an_unknown_synthetic_preset_stops_the_start_before_binding(tmp_path):
    assert settings_problem(Settings(model="synthetic:huge", device="cpu")) is not None
    one_line(run_serve("--model", "synthetic:huge", "--db", str(tmp_path / "t.db")),
             "--model 'synthetic:huge'", "unknown synthetic preset")  # fmt: skip


# --- the few-shot file -----------------------------------------------------------------------------


def test_few_shot_problem(tmp_path):
    good, latin = tmp_path / "shots.txt", tmp_path / "latin.txt"
    good.write_text("User: hi\n\nAssistant: hello\n", encoding="utf-8")
    latin.write_bytes(b"User: caf\xe9\n")
    assert few_shot_problem("") is None and few_shot_problem(str(good)) is None
    missing = tmp_path / "none.txt"
    assert few_shot_problem(str(missing)) == f"--few-shot {missing}: cannot read it (No such file or directory)"
    assert few_shot_problem(str(tmp_path)) == f"--few-shot {tmp_path}: cannot read it (Is a directory)"
    assert few_shot_problem(str(latin)) == f"--few-shot {latin}: cannot read it (not UTF-8 text)"


def test_the_default_few_shot_file_is_not_a_start_up_condition(tmp_path):
    assert serve_problem(Settings(port=0, db=str(tmp_path / "t.db"))) is None  # few_shot "": few_shot.txt, read later


def test_a_missing_few_shot_file_stops_the_start_before_binding(tmp_path):
    missing = tmp_path / "none.txt"
    r = run_serve("--few-shot", str(missing), "--db", str(tmp_path / "t.db"))
    one_line(r, f"--few-shot {missing}: cannot read it (No such file or directory)")


def test_a_few_shot_file_gone_after_the_start_is_a_server_error(tmp_path):
    shots = tmp_path / "shots.txt"
    sv = Services(Settings(few_shot=str(shots)), None, None, None, None, None)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as err:
        sv.few_shot()
    assert err.value.status == 500 and err.value.code == "few_shot_unavailable" and str(shots) in err.value.message
    shots.write_text("User: hi\n\nAssistant: hello\n", encoding="utf-8")
    assert sv.few_shot() == "User: hi\n\nAssistant: hello\n\n"  # read once it is back


def test_a_chat_request_with_the_few_shot_file_gone_answers_500(tmp_path):
    shots = tmp_path / "shots.txt"
    shots.write_text("User: hi\n\nAssistant: hello\n", encoding="utf-8")
    settings = Settings(device="cpu", port=0, db=str(tmp_path / "t.db"), few_shot=str(shots), stats_interval=0)
    with inprocess_server(settings) as (url, _app):
        shots.unlink()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "few_shot": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "few_shot_unavailable" and str(shots) in r.json()["error"]["message"]
