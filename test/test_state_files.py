"""RWKV-7 state files: reading and validation (server.model.state_file), a tuned state loaded with
--state and used on /v1/completions and by a fork, equal to the `rwkv` package's RWKV_x070 run
from the same state; uploads, listing, deletion and every kind of bad input over HTTP."""

from __future__ import annotations

import importlib
import io
import os
import random
import socket
import sys
import time

import httpx
import pytest
import torch
from util_server import ServerProcess, committed_row, running_server

from server.model.state import State
from server.model.state_file import StateFileError, read_state_file, write_state_file
from server.model.synthetic import PRESETS, save_synthetic
from server.tokenizer import get_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the rwkv package's TorchScript
SEED = 5
"""Seed of the synthetic checkpoint and the random state (chosen with wide greedy margins: the
test checks that every one of the 16 oracle steps has a top-two gap above MARGIN)."""
MARGIN = 1e-3
PROMPT = [510, 4411, 33, 11, 3319, 59, 261]
SHAPE = PRESETS["tiny"]


def random_state_dict(shape=SHAPE, seed: int = SEED, dtype=torch.bfloat16, layers: int | None = None,
                      heads: int | None = None, head_size: int | None = None) -> dict[str, torch.Tensor]:
    """A tuned-state-like file: one (H, N, N) tensor per layer, as RWKV-PEFT writes it (bf16)."""
    g = torch.Generator().manual_seed(seed)
    H, N = heads or shape.n_head, head_size or shape.head_size
    return {f"blocks.{i}.att.time_state": (torch.randn(H, N, N, generator=g) * 0.5).to(dtype)
            for i in range(layers or shape.n_layer)}


def _save(sd, path) -> str:
    torch.save(sd, path)
    return str(path)


def _bytes(sd) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


# --- reading and validation --------------------------------------------------------------------
def test_plain_file_reads_as_is_with_zero_shifts():
    sd = random_state_dict()
    sf = read_state_file(_bytes(sd), SHAPE, wkv_dtype=torch.float32)
    assert not sf.full and sf.pending == [] and sf.dtype == "bfloat16"
    for i in range(SHAPE.n_layer):  # no transpose: [h, i, j] as in the file, cast exactly
        assert torch.equal(sf.state.wkv[i, 0], sd[f"blocks.{i}.att.time_state"].float())
    assert sf.state.att_shift.abs().max() == 0 and sf.state.ffn_shift.abs().max() == 0
    assert sf.state.wkv.shape == (SHAPE.n_layer, 1, SHAPE.n_head, SHAPE.head_size, SHAPE.head_size)


def test_full_export_round_trip_is_bit_exact_and_plain_has_layer_keys_only():
    st = State.zeros(SHAPE, 1)
    g = torch.Generator().manual_seed(1)
    for t in st.tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    full = write_state_file(st, pending=[7, 261], meta={"signature": SHAPE.signature()})
    back = read_state_file(full, SHAPE)
    assert back.full and back.pending == [7, 261] and back.meta["signature"] == SHAPE.signature()
    assert all(torch.equal(a, b) for a, b in zip(back.state.tensors(), st.tensors()))
    plain = torch.load(io.BytesIO(write_state_file(st, full=False)), weights_only=True)
    # RWKV-Runner's check: as many keys as layers, shape[0] * shape[1] of the first == C
    assert len(plain) == SHAPE.n_layer
    first = plain["blocks.0.att.time_state"]
    assert first.shape[0] * first.shape[1] == SHAPE.n_embd


def _bad_files(tmp_path):
    ckpt = tmp_path / "model.pth"
    save_synthetic("tiny", str(ckpt), dtype=torch.float32)
    good = _bytes(random_state_dict())
    nan = random_state_dict(dtype=torch.float32)
    nan["blocks.1.att.time_state"][0, 0, 0] = float("nan")
    other = State.zeros(PRESETS["0.1b"], 1)
    huge = random_state_dict(dtype=torch.float64)  # finite in float64, infinite in the state's float32
    huge["blocks.0.att.time_state"][0, 0, 0] = 1e300
    export = torch.load(io.BytesIO(write_state_file(State.zeros(SHAPE, 1))), weights_only=True)
    huge_shift = {**export, "rwkv_server.att_shift": export["rwkv_server.att_shift"].double()}
    huge_shift["rwkv_server.att_shift"][0, 0] = -1e300
    no_meta = {k: v for k, v in export.items() if k != "rwkv_server.meta"}
    return {
        "checkpoint": (ckpt.read_bytes(), "model checkpoint (it has the key 'emb.weight')"),
        "truncated": (good[: len(good) // 2], "cannot be read as a torch state file"),
        "garbage": (b"not a torch file at all", "cannot be read as a torch state file"),
        "more layers": (_bytes(random_state_dict(layers=12)), "has layers up to 11"),
        "fewer layers": (_bytes(random_state_dict(layers=1)), "missing key 'blocks.1.att.time_state'"),
        "heads": (_bytes(random_state_dict(heads=4)), "'blocks.0.att.time_state' has shape (4, 64, 64)"),
        "head size": (_bytes(random_state_dict(head_size=32)), "has shape (2, 32, 32)"),
        "unknown key": (_bytes({**random_state_dict(), "blocks.0.att.x": torch.zeros(1)}), "unexpected key"),
        "int dtype": (_bytes({k: v.to(torch.int32) for k, v in random_state_dict().items()}), "dtype torch.int32"),
        "nan": (_bytes(nan), "NaN or infinite"),
        "past float32": (_bytes(huge), "'blocks.*.att.time_state' holds values too large for the state's"),
        "shift past float32": (_bytes(huge_shift), "'rwkv_server.att_shift' holds values too large"),
        "export without its meta": (_bytes(no_meta), "but not 'rwkv_server.meta' (a damaged export)"),
        "a list": (_bytes([torch.zeros(2)]), "not a state file"),
        "other model export": (write_state_file(other, meta={"signature": PRESETS["0.1b"].signature()}),
                               "has layers up to 11"),
    }


def test_bad_files_are_refused_naming_the_file_and_key(tmp_path):
    files = _bad_files(tmp_path)
    files["random bytes"] = (bytes(random.Random(5).getrandbits(8) for _ in range(3000)), "cannot be read as a")
    for what, (data, message) in files.items():
        with pytest.raises(StateFileError) as info:
            read_state_file(data, SHAPE, source="the file 'x.pth'")
        assert message in str(info.value) and "the file 'x.pth'" in str(info.value), what
        assert "weights_only" not in str(info.value), (what, str(info.value))  # not torch's advice


def test_pending_tokens_past_the_limit_are_refused():
    """A run feeds a state's pending tokens first, as history that --max-prompt-tokens does not
    count: a file may not bring more of them than that bound."""
    st = State.zeros(SHAPE, 1)
    full = write_state_file(st, pending=[5] * 10, meta={"signature": SHAPE.signature()})
    assert read_state_file(full, SHAPE, max_pending=10).pending == [5] * 10
    with pytest.raises(StateFileError, match=r"holds 10 pending tokens, more than .*--max-prompt-tokens \(9\)"):
        read_state_file(full, SHAPE, max_pending=9)


def test_state_settings_and_their_checks_before_start(tmp_path):
    from server.checks import state_files_problem
    from server.config import Settings

    f = _save(random_state_dict(), tmp_path / "s,1.pth")  # a comma in a path
    s = Settings.from_env({"RWKV_STATES": f"a={f},b={f}\nc={f}"})
    assert s.state_files() == [("a", f), ("b", f), ("c", f)] and state_files_problem(s) is None
    assert "given more than once" in state_files_problem(Settings(states=f"a={f},a={f}"))
    assert "no path separators" in state_files_problem(Settings(states=f"x/y={f}"))
    assert "no such file" in state_files_problem(Settings(states="a=/nonexistent.pth"))
    assert "unnamed template" in state_files_problem(Settings(states=f"TMPL_{'ab' * 16}={f}"))
    assert "not NAME=PATH" in state_files_problem(Settings(states="justapath.pth"))


def test_a_path_that_does_not_exist():
    with pytest.raises(StateFileError, match="no such file"):
        read_state_file("/nonexistent/state.pth", SHAPE)


# --- the tuned state against the rwkv package -----------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("statefiles")
    ckpt = d / "tiny.pth"
    save_synthetic(f"tiny:{SEED}", str(ckpt), dtype=torch.float32)
    return ckpt, _save(random_state_dict(), d / "tuned.pth")


def _oracle_module():
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")  # read at import time
    if "rwkv.model" in sys.modules:
        return importlib.reload(sys.modules["rwkv.model"])
    return importlib.import_module("rwkv.model")


@pytest.fixture(scope="module")
def oracle(files):
    """16 greedy tokens of the rwkv package from the tuned state (its own layout: per layer
    [att shift (C), wkv (H, N, N), ffn shift (C)]; the file's tensor as is, zero shifts)."""
    ckpt, state_path = files
    ref = _oracle_module().RWKV_x070(str(ckpt)[: -len(".pth")], "cpu fp32")
    sd = torch.load(state_path, weights_only=True)
    state = ref.generate_zero_state()
    for i in range(SHAPE.n_layer):
        state[3 * i + 1] = sd[f"blocks.{i}.att.time_state"].float().clone()
    logits, state = ref.forward(PROMPT, state)
    out, margins = [], []
    for _ in range(16):
        top = torch.topk(logits.float(), 2).values
        margins.append(((top[0] - top[1]) / top.abs().max()).item())
        tok = int(logits.argmax())
        out.append(tok)
        logits, state = ref.forward([tok], state)
    assert min(margins) > MARGIN, f"seed {SEED}: a greedy step has a top-two gap of {min(margins):.2e}"
    return out


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    ckpt, state_path = files
    with running_server(tmp_path_factory.mktemp("server"), model=str(ckpt),
                        args=("--state", f"tuned={state_path}")) as srv:
        yield srv


GREEDY = {"max_tokens": 16, "temperature": 0, "presence_penalty": 0, "ignore_eos": True}


def test_engine_from_the_file_equals_the_rwkv_package(files, oracle):
    from server.config import Settings
    from server.engine import Engine, SamplingParams
    from server.model import load_model

    ckpt, state_path = files
    model = load_model(str(ckpt))
    eng = Engine(model, get_tokenizer(), Settings(device="cpu", stats_interval=0)).start()
    try:
        sf = read_state_file(state_path, model.shape)
        params = SamplingParams(max_tokens=16, temperature=0, presence_penalty=0, repetition_penalty=0,
                                ignore_eos=True)
        res = eng.submit(PROMPT, params, init_state=sf.state).result(60)
        assert res.token_ids == oracle
    finally:
        eng.shutdown()


def test_completions_with_the_state_equal_the_rwkv_package(server, oracle):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": PROMPT, "state": "tuned", "frequency_penalty": 0, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == get_tokenizer().decode(oracle)
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "frequency_penalty": 0, **GREEDY},
                       timeout=60).json()
    assert plain["choices"][0]["text"] != r.json()["choices"][0]["text"]  # the state made the difference


def test_fork_of_the_state_template_equals_the_rwkv_package(server, oracle):
    r = httpx.post(server.url + "/v1/tasks/_tuned/fork",
                   json={"prompt": PROMPT, "repetition_penalty": 0, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    tid = r.json()["task_id"]
    deadline = time.monotonic() + 60
    while not (res := httpx.get(f"{server.url}/v1/tasks/{tid}/get_result").json())["finished"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert res["result"] == get_tokenizer().decode(oracle)


def test_a_fork_of_a_tuned_state_without_a_prompt_has_nothing_to_feed(server):
    """A tuned state has no pending token: a fork without a prompt ends at once, with no output."""
    r = httpx.post(server.url + "/v1/tasks/_tuned/fork", json={"max_tokens": 4})
    assert r.status_code == 200, r.text
    res = httpx.get(f"{server.url}/v1/tasks/{r.json()['task_id']}/get_result").json()
    assert res["finished"] and res["result"] == "" and res["completion_tokens"] == 0


def test_chat_with_the_state_starts_from_it(server):
    msgs = [{"role": "user", "content": "Hello"}]
    body = {"messages": msgs, "temperature": 0, "max_tokens": 8, "presence_penalty": 0, "frequency_penalty": 0}
    with_state = httpx.post(server.url + "/v1/chat/completions", json={**body, "state": "tuned"}, timeout=60).json()
    without = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert with_state["choices"][0]["message"]["content"] != without["choices"][0]["message"]["content"]
    assert with_state["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]


# --- upload, list, delete, bad input over HTTP -----------------------------------------------------
def _states(server) -> list[str]:
    return [s["name"] for s in httpx.get(server.url + "/v1/states").json()["data"]]


def test_upload_list_use_delete(server, oracle):
    data = _bytes(random_state_dict())  # the same state, uploaded under another name
    r = httpx.post(server.url + "/v1/states/mine", content=data, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert r.json()["template_id"] == "_mine" and r.json()["format"] == "rwkv" and r.json()["dtype"] == "bfloat16"
    assert set(_states(server)) >= {"tuned", "mine"}
    origins = {s["name"]: s["origin"] for s in httpx.get(server.url + "/v1/states").json()["data"]}
    assert origins["tuned"] == "operator" and origins["mine"] == "upload"
    out = httpx.post(server.url + "/v1/completions",
                     json={"prompt": PROMPT, "state": "mine", "frequency_penalty": 0, **GREEDY}, timeout=60)
    assert out.json()["choices"][0]["text"] == get_tokenizer().decode(oracle)
    assert httpx.delete(server.url + "/v1/states/mine").status_code == 200
    assert "mine" not in _states(server)
    assert httpx.get(server.url + "/v1/states/mine").status_code == 404


def test_a_state_that_overflows_the_model_fails_its_own_requests_only(server):
    """Finite values so large that the model's activations overflow (1e30 in an fp32 state): each
    request from it fails with a message that says so, requests beside it in the same steps
    finish, and the engine lives on (the torch sampler used to fail every row of the step, and
    three such steps killed the engine for every user: QA)."""
    import concurrent.futures

    sd = {k: torch.full_like(v, 1e30, dtype=torch.float32) for k, v in random_state_dict().items()}
    assert httpx.post(server.url + "/v1/states/boom", content=_bytes(sd)).status_code == 201
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3}

        def post(state):
            return httpx.post(server.url + "/v1/completions", json={**body, **state}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(post, {"state": "boom"} if i % 2 else {}) for i in range(8)]
            answers = [j.result() for j in jobs]
        for i, r in enumerate(answers):
            if i % 2:
                _error(r, 500, "logits became NaN or infinite for this request")
            else:
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        assert post({}).status_code == 200
    finally:
        httpx.delete(server.url + "/v1/states/boom")


def _error(r: httpx.Response, status: int, text: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and set(err) == {"message", "type", "param", "code"}, err
    return err


def test_bad_uploads_are_refused_and_nothing_is_stored(server, tmp_path):
    before = _states(server)
    for what, (data, message) in _bad_files(tmp_path).items():
        r = httpx.post(server.url + f"/v1/states/bad_{what.replace(' ', '_')}", content=data)
        err = _error(r, 422, message)
        assert err["param"] == "file" and "state file 'bad_" in err["message"], what
    _error(httpx.post(server.url + "/v1/states/tuned", content=_bytes(random_state_dict())), 409, "already exists")
    _error(httpx.post(server.url + "/v1/states/a%2Fb", content=b"x"), 422, "no path separators")
    _error(httpx.post(server.url + "/v1/states/.hidden", content=b"x"), 422, "state name")
    _error(httpx.post(server.url + "/v1/states/TMPL_" + "0" * 32, content=b"x"), 422, "unnamed template")
    _error(httpx.post(server.url + "/v1/states/empty", content=b""), 422, "empty body")
    _error(httpx.post(server.url + "/v1/states/form", files={"file": ("s.pth", b"abc")}), 415, "raw request body")
    long = write_state_file(State.zeros(SHAPE, 1), pending=[5] * 65_537, meta={"signature": SHAPE.signature()})
    _error(httpx.post(server.url + "/v1/states/long", content=long), 422, "65537 pending tokens, more than")
    assert _states(server) == before
    assert httpx.get(server.url + "/health").status_code == 200


def test_oversized_uploads_are_refused_early_and_while_streaming(tmp_path):
    with running_server(tmp_path, env={"RWKV_STATE_UPLOAD_BYTES": "100000"}) as srv:
        big = b"\0" * 10_000_000
        r = httpx.post(srv.url + "/v1/states/big", content=big)  # refused by Content-Length
        assert r.status_code == 413 and "exceeds the limit of 100000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: refused while the body streams
            for _ in range(100):
                yield b"\0" * 100_000

        r = httpx.post(srv.url + "/v1/states/big", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        assert httpx.get(srv.url + "/v1/states").json()["data"] == []
        assert httpx.get(srv.url + "/health").status_code == 200
        # a client that leaves mid-upload: nothing stored, and no server error logged for it
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/states/half HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"400\r\n" + b"\0" * 1024 + b"\r\n")
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while "/v1/states/half" not in srv.log_tail(50) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "unhandled error" not in srv.log_tail(200) and " 500" not in srv.log_tail(200)
        assert httpx.get(srv.url + "/v1/states").json()["data"] == []


def test_unknown_state_in_requests_is_an_openai_404(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = _error(httpx.post(server.url + path, json={**body, "state": "nope", "max_tokens": 2}), 404, "'nope'")
        assert err["param"] == "state" and err["code"] == "state_not_found"
    err = _error(httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "state": "a/b"}), 400, "state name")
    assert err["param"] == "state"


def test_the_operator_states_follow_the_command_line_across_restarts(files, tmp_path):
    ckpt, state_path = files
    srv = running_server(tmp_path, model=str(ckpt), args=("--state", f"a={state_path}", "--state", f"b={state_path}"))
    with srv as proc:
        assert sorted(_states(proc)) == ["a", "b"]
        assert httpx.post(proc.url + "/v1/states/up", content=_bytes(random_state_dict())).status_code == 201
        proc.args = ("--state", f"b={state_path}", "--state", f"c={state_path}")
        proc.restart()
        assert sorted(_states(proc)) == ["b", "c", "up"]  # a is gone, b replaced, the upload kept
        r = httpx.delete(proc.url + "/v1/states/a")
        assert r.status_code == 404


def test_a_bad_state_file_stops_the_start_naming_it(files, tmp_path):
    """...and the start changes no template: the good file named before it made none (it was
    left in the database, for the replicas to see)."""
    ckpt, state_path = files
    bad = _save(random_state_dict(heads=4), tmp_path / "wrong.pth")
    args = ("--state", f"good={state_path}", "--state", f"wrong={bad}")
    srv = running_server(tmp_path, model=str(ckpt), args=args, wait=False)
    with srv as proc:
        assert proc.proc.wait(timeout=120) != 0
        log, db = proc.log_tail(30), proc.db
    assert f"--state wrong={bad}" in log and "'blocks.0.att.time_state' has shape (4, 64, 64)" in log
    assert committed_row(db, "_good") is None


def test_a_replica_started_without_the_states_keeps_the_others(files, tmp_path):
    """Two servers on one database: the one started without --state keeps the operator
    templates the other serves (it deleted them as 'no longer named')."""
    ckpt, state_path = files
    db = str(tmp_path / "shared.db")
    a = ServerProcess(tmp_path / "a", model=str(ckpt), db=db, args=("--state", f"op={state_path}"))
    b = ServerProcess(tmp_path / "b", model=str(ckpt), db=db)
    try:
        a.start()
        b.start()
        assert _states(a) == _states(b) == ["op"]
        assert "not named here are kept" in b.log_tail(200)
    finally:
        b.cleanup()
        a.cleanup()
