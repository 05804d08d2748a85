"""A continue without a new prompt extends its output's text as one run would have written it
(server.tasks.lead): a character split between two runs completes instead of showing U+FFFD
twice, also after a restart, and a stop string that begins at the end of one run and ends in the
continue stops the continue. A real server on a model built here whose greedy output is one emoji
repeated: the world vocabulary writes U+1F99C with three tokens."""

from __future__ import annotations

import httpx
import pytest
import torch
from util_models import silence_blocks
from util_server import running_server, task_result

from server.model.synthetic import synthetic_state_dict
from server.tokenizer import get_tokenizer

PARROT = "\U0001f99c"
GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}


def parrot_checkpoint(path) -> str:
    """synthetic:tiny rewired so that every token's greedy successor walks the emoji's three
    tokens in a cycle: the blocks add nothing (their output projections are zero), so the head
    reads the embedding of the last token alone."""
    a, b, c = get_tokenizer().encode(PARROT)
    sd = synthetic_state_dict("synthetic:tiny")
    emb = torch.zeros_like(sd["emb.weight"])
    emb[:, 3] = 1.0  # every other token: direction 3
    for d, t in enumerate((a, b, c)):
        emb[t] = 0.0
        emb[t, d] = 1.0
    sd["emb.weight"] = emb
    silence_blocks(sd)
    head = torch.zeros_like(sd["head.weight"])
    head[b, 0], head[c, 1], head[a, 2], head[a, 3] = 10.0, 10.0, 10.0, 10.0
    sd["head.weight"] = head
    torch.save(sd, path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parrot")
    with running_server(tmp, model=parrot_checkpoint(tmp / "parrot.pth")) as srv:
        yield srv


def run(c: httpx.Client, tid: str | None, max_tokens: int, **extra) -> dict:
    body = {"max_tokens": max_tokens, **GREEDY, **extra}
    if tid is None:
        tid = c.post("/v1/tasks/create", json={"prompt": "hi", **body}).json()["task_id"]
    else:
        assert c.post(f"/v1/tasks/{tid}/continue", json=body).status_code == 200
    return {**task_result(c, tid), "task_id": tid}


def test_the_model_writes_the_emoji(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert run(c, None, 6)["result"] == PARROT * 2


@pytest.mark.parametrize("first", [1, 2, 4, 5])
def test_a_character_split_between_runs_is_whole(server, first):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        a = run(c, None, first)
        assert a["result"].endswith("\ufffd") and a["finish_reason"] == "length"  # a finished text shows it so
        b = run(c, a["task_id"], 6 - first)
        assert b["result"] == PARROT * 2 and b["completion_tokens"] == 6


def test_a_split_character_completes_after_a_restart(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        tid = run(c, None, 4)["task_id"]
    server.restart()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get(f"/v1/tasks/{tid}/get_result").json()["result"] == PARROT + "\ufffd"
        assert run(c, tid, 5)["result"] == PARROT * 3


def test_a_stop_string_across_a_continue_ends_it(server):
    stop = [PARROT * 2]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        a = run(c, None, 3, stop=stop)
        assert (a["result"], a["finish_reason"]) == (PARROT, "length")  # held back, shown at the end
        b = run(c, a["task_id"], 9)
        assert (b["result"], b["finish_reason"]) == (PARROT, "stop")  # the second one is not shown
        assert b["completion_tokens"] == 6  # it stopped at once

