"""A fork without a prompt of an output a stop token ended reads the source's pending EOS first; a
fork whose run then meets a stop token at once adds no second EOS: its history and state are
its source's (EOS still pending), as a continue's are (server.tasks.settle._covered). A real
server on a model whose greedy output is "hi", then EOS, and EOS after every EOS
(util_models.walk_checkpoint)."""

from __future__ import annotations

from array import array

import httpx
import pytest
from test_task_continue_text import GREEDY
from util_models import walk_checkpoint
from util_server import committed_row, running_server, task_result

from server.tokenizer import get_tokenizer

HI = get_tokenizer().token_table.index(b"hi")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fork_eos")
    with running_server(tmp, model=walk_checkpoint(tmp / "walk.pth", [HI, 0])) as srv:
        yield srv


def history(server, c: httpx.Client, tid: str, stored: bool = True) -> tuple[list[int], str, int]:
    """(tokens, state id, state_pos) of the task's committed row, once it is finished (its final
    row committed) and, where `stored`, its state is in the database too."""
    task_result(c, tid, until=lambda r: r["finished"] and (r["state"] == "stored" or not stored))
    row = committed_row(server.db, tid)
    assert row is not None
    return array("i", row["tokens"]).tolist(), row["state_id"], row["state_pos"]


def post(c: httpx.Client, path: str, **body) -> str:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["task_id"]


def test_a_fork_of_an_eos_ended_output_that_stops_at_once_adds_no_second_eos(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        src = post(c, "/v1/tasks/create", prompt="x", max_tokens=20, **GREEDY)
        a = task_result(c, src)
        assert (a["result"], a["finish_reason"]) == ("hi", "stop"), a
        kept = history(server, c, src)
        tokens, _, pos = kept
        assert tokens[-3:] == [121, HI, 0] and pos == len(tokens) - 1  # ("x"), "hi", EOS pending
        fork = post(c, f"/v1/tasks/{src}/fork", max_tokens=20)
        f = task_result(c, fork)
        assert (f["result"], f["finish_reason"], f["completion_tokens"]) == ("", "stop", 0), f
        # it read the pending EOS and met EOS: its history and state are its source's
        assert history(server, c, fork) == kept
        # and it goes on from there: the pending EOS and a prompt fed on that state, no rebuild
        g = task_result(c, post(c, f"/v1/tasks/{fork}/continue", prompt="x", max_tokens=1))
        assert (g["result"], g["prompt_tokens"]) == ("hi", 2), g
        assert history(server, c, fork)[0] == [*tokens, 121, HI]


def test_a_tmp_fork_that_stops_at_once_adds_no_second_eos(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        src = post(c, "/v1/tasks/create", prompt="x", max_tokens=20, **GREEDY)
        tokens, _, _ = history(server, c, src)
        fork = post(c, f"/v1/tasks/{src}/fork?tmp=true", max_tokens=20)
        assert task_result(c, fork)["finish_reason"] == "stop"
        # its history, as a prefill-only fork of it (which feeds nothing) stores it
        copy = post(c, f"/v1/tasks/{fork}/fork", max_tokens=0)
        assert history(server, c, copy, stored=False)[0] == tokens
