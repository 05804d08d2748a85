"""TaskParams, the typed task parameters (server.tasks.params): held to the one field list at
import, stored as the same JSON as before (key for key, in the same order), and a row an older
server stored loads, runs and saves back unchanged."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, TypedDict

import orjson
import pytest

from server.engine.types import FIELDS, GrammarSpec, SamplingParams, field_kinds
from server.tasks.config import TaskConfig
from server.tasks.manager import TaskManager
from server.tasks.params import PARAM_KEYS, TaskParams, check_task_params, clean_params, sampling_params
from server.tasks.records import TASK, Task
from server.tasks.templates import template_of

from task_fakes import VOCAB, FakeEngine, FakeShape, FakeTokenizer


# --- TaskParams against FIELDS / FIELD_KINDS --------------------------------------------------------
def test_task_params_has_every_field_of_the_one_list_with_its_kinds_type():
    check_task_params()  # what the import ran
    assert tuple(TaskParams.__annotations__) == PARAM_KEYS and PARAM_KEYS[: len(FIELDS)] == FIELDS
    assert TaskParams.__required_keys__ == frozenset()  # every key optional: only what was given is stored


class _NoSeed(TypedDict, total=False):
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    presence_penalty: float
    repetition_penalty: float
    penalty_decay: float
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    response_format: dict[str, Any]
    grammar: dict[str, str]
    hidden_lead: bool
    logprobs: int
    meta: dict[str, Any]


class _StopAsIds(_NoSeed, total=False):
    seed: int
    stop: list[int]


class _Extra(_NoSeed, total=False):
    seed: int
    min_p: float


def test_a_task_params_out_of_step_with_the_field_list_is_refused():
    with pytest.raises(TypeError, match=r"missing \['seed'\]"):
        check_task_params(_NoSeed)
    with pytest.raises(TypeError, match=r"TaskParams\['stop'\] is list\[int\]"):
        check_task_params(_StopAsIds)
    with pytest.raises(TypeError, match=r"extra \['min_p'\]"):
        check_task_params(_Extra)

    @dataclass(frozen=True)
    class WithMinP(SamplingParams):
        min_p: float = 0.0

    # a sampling field added to SamplingParams and FIELDS, not to TaskParams: named
    with pytest.raises(TypeError, match=r"missing \['min_p'\]"):
        check_task_params(TaskParams, field_kinds(WithMinP, (*FIELDS, "min_p")))
    check_task_params(_Extra, field_kinds(WithMinP, (*FIELDS, "min_p")))  # ... and with its key, accepted


def test_the_import_itself_refuses_a_field_list_task_params_lacks():
    """The check runs when server.tasks.params is imported, not only in tests."""
    code = ("import server.engine.types as t; t.FIELD_KINDS['min_p'] = 'float'\n"
            "import server.tasks.params")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "TypeError" in r.stderr and "missing ['min_p']" in r.stderr, r.stderr[-2000:]


# --- the stored form -------------------------------------------------------------------------------
def test_clean_params_writes_the_stored_json_of_before():
    """A plain dict, keys in FIELDS' order then the rest as they were added: the params column's
    text is byte for byte what earlier servers wrote for the same request."""
    raw = {"meta": {"b": 1, "a": [2]}, "stop": "x", "grammar": {"kind": "regex", "source": "a+"}, "temperature": 0,
           "hidden_lead": True, "max_tokens": 3, "unknown": 1, "seed": None}
    p = clean_params(raw, VOCAB)
    assert type(p) is dict
    assert orjson.dumps(p) == (b'{"max_tokens":3,"temperature":0,"stop":["x"],"grammar":{"kind":"regex","source":"a+"},'
                               b'"response_format":{"type":"text"},"hidden_lead":true,"meta":{"b":1,"a":[2]}}')
    fmt = clean_params({"top_p": 0.5, "response_format": {"type": "json_object"}}, VOCAB)
    assert orjson.dumps(fmt) == b'{"top_p":0.5,"response_format":{"type":"json_object"},"grammar":{}}'


def test_a_template_drops_a_prefill_only_max_tokens_from_a_copy():
    src = Task(id="TASK_x", kind=TASK, params={"max_tokens": 0, "temperature": 0.5, "stop": ["a"]})
    tpl = template_of(src, "_t", None, False)
    assert list(tpl.params.items()) == [("temperature", 0.5), ("stop", ["a"])]
    assert src.params == {"max_tokens": 0, "temperature": 0.5, "stop": ["a"]}  # the source keeps its own
    src.params["max_tokens"] = 4
    assert template_of(src, "_t", None, False).params == src.params


# --- a row an older server stored ------------------------------------------------------------------
OLD_PARAMS = ('{"temperature":0,"top_k":-1,"stop":["\\n\\n"],'
              '"response_format":{"type":"json_object","extra":1},"max_tokens":2}')
"""The params column of a task stored before `grammar`, `hidden_lead` and `meta` existed, and
before a response_format's unknown keys were refused: an integer for a float field, the keys out
of FIELDS' order (max_tokens last)."""


OLD_SAMPLED = (2, 0.0, 0.3, 0, ("\n\n",), GrammarSpec("json_object"))
"""What a run of OLD_PARAMS samples with (_sampled, less the seed): top_p the default, top_k -1
as 0, the stop string a tuple, the format's grammar."""


def _sampled(sp: SamplingParams) -> tuple:
    return sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop, sp.grammar, sp.seed


def _manager(eng: FakeEngine, path) -> TaskManager:
    return TaskManager(eng, FakeTokenizer(), TaskConfig(db=str(path), default_max_tokens=3, tmp_task_ttl=60),
                       FakeShape())


def _column(path, task_id: str) -> str:
    with sqlite3.connect(path) as c:
        return c.execute("select params from tasks where id = ?", (task_id,)).fetchone()[0]


async def test_an_old_stored_row_loads_runs_and_saves_back_unchanged(tmp_path):
    db = tmp_path / "old.db"
    eng = FakeEngine()
    tm = _manager(eng, db)
    await tm.start()
    try:
        tid = (await tm.wait((await tm.create("abc", persistent=True)).id, timeout=10)).id
    finally:
        await tm.close()
    with sqlite3.connect(db) as c:
        c.execute("update tasks set params = ? where id = ?", (OLD_PARAMS, tid))

    tm = _manager(eng, db)  # a new process: the task comes from its row
    await tm.start()
    try:
        t = await tm.get(tid)
        assert list(t.params.items()) == list(orjson.loads(OLD_PARAMS).items())
        fork = await tm.wait((await tm.fork(tid, {"seed": 7})).id, timeout=10)
        assert _sampled(eng.submissions[-1].params) == (*OLD_SAMPLED, 7)  # the old format runs as it did
        assert fork.params == {**orjson.loads(OLD_PARAMS), "seed": 7}
        assert _column(db, fork.id) == OLD_PARAMS[:-1] + ',"seed":7}'
        await tm.wait((await tm.continue_(tid)).id, timeout=10)  # its own row written again
        assert _sampled(eng.submissions[-1].params) == (*OLD_SAMPLED, None)
        assert _column(db, tid) == OLD_PARAMS  # byte for byte
    finally:
        await tm.close()
    assert _sampled(sampling_params(orjson.loads(OLD_PARAMS), 16)) == (*OLD_SAMPLED, None)
