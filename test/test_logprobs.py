"""Logprobs (SamplingParams.logprobs / prompt_logprobs) against the `rwkv` package's logits
(the oracle, cpu fp32, on a synthetic checkpoint): each reported value is log_softmax of the
reference logits of that position within 1e-4; only rows that ask pay; grammar rows report the
model's unmasked distribution."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from server.config import Settings
from server.engine import Engine, SamplingParams
from server.engine.types import GrammarSpec
from server.model import load_model
from server.model.synthetic import save_synthetic
from server.tokenizer import get_tokenizer

TOL = 1e-4
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp") / "model.pth"
    save_synthetic("tiny", str(path), dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    mod = importlib.reload(sys.modules["rwkv.model"]) if "rwkv.model" in sys.modules else importlib.import_module("rwkv.model")
    return mod.RWKV_x070(checkpoint[: -len(".pth")], "cpu fp32")


@pytest.fixture(scope="module")
def engine(checkpoint):
    e = Engine(load_model(checkpoint), get_tokenizer(), Settings(max_batch=8, step_token_budget=48, prefill_chunk=16,
                                                                 stats_interval=0.0)).start()  # fmt: skip
    yield e
    e.shutdown()


def ref_logprobs(oracle, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the reference logits after each prefix: row j = after tokens[: j + 1]."""
    out, state = [], None
    for t in tokens:
        logits, state = oracle.forward([t], state)
        out.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(out)  # (T, V)


def check(value, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert value.token == token
    assert abs(value.logprob - ref_row[token].item()) < TOL
    assert len(value.top) == k
    ref_v = ref_row.topk(k).values.tolist() if k else []
    for (tid, lp), rv in zip(value.top, ref_v):
        assert abs(lp - rv) < TOL and abs(ref_row[tid].item() - lp) < TOL
    assert all(a[1] >= b[1] for a, b in zip(value.top, value.top[1:]))


PROMPT = [5, 300, 65000, 17, 17, 9, 1234, 42]


def test_generated_logprobs_equal_log_softmax_of_the_reference_logits(engine, oracle):
    r = engine.submit(PROMPT, SamplingParams(max_tokens=6, seed=3, logprobs=5, ignore_eos=True)).result(60)
    assert len(r.logprobs) == len(r.token_ids) == 6
    ref = ref_logprobs(oracle, PROMPT + r.token_ids)
    for i, (tok, value) in enumerate(zip(r.token_ids, r.logprobs)):
        check(value, ref[len(PROMPT) - 1 + i], tok, 5)


def test_prompt_logprobs_score_every_prompt_token_after_the_first(engine, oracle):
    h = engine.submit(PROMPT, SamplingParams(max_tokens=2, seed=1, prompt_logprobs=2, ignore_eos=True))
    events = list(h)
    r = h.result(60)
    assert len(r.prompt_logprobs) == len(PROMPT) - 1 and r.logprobs is None
    ref = ref_logprobs(oracle, PROMPT)
    for j, value in enumerate(r.prompt_logprobs):
        check(value, ref[j], PROMPT[j + 1], 2)
    assert events[0].prompt_logprobs == r.prompt_logprobs
    assert all(ev.prompt_logprobs is None for ev in events[1:])
    # scoring only (max_tokens = 0): the same values, nothing generated
    r0 = engine.submit(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2)).result(60)
    assert r0.token_ids == [] and r0.prompt_logprobs == r.prompt_logprobs


def test_events_carry_one_logprob_per_token(engine):
    h = engine.submit(PROMPT, SamplingParams(max_tokens=5, seed=2, logprobs=0, ignore_eos=True))
    events = list(h)
    got = [v for ev in events for v in ev.logprobs]
    assert [v.token for v in got] == [t for ev in events for t in ev.token_ids] == h.result().token_ids
    assert all(v.top == () for v in got) and got == h.result().logprobs


def test_only_the_rows_that_ask_pay_and_others_are_unchanged(engine):
    plain = [SamplingParams(max_tokens=8, seed=10 + i, ignore_eos=True) for i in range(4)]
    alone = [h.result(60) for h in [engine.submit(PROMPT, p) for p in plain]]
    hs = [engine.submit(PROMPT, p) for p in plain[:2]]
    lp = engine.submit(PROMPT, SamplingParams(max_tokens=8, seed=10, logprobs=3, ignore_eos=True))
    hs += [engine.submit(PROMPT, p) for p in plain[2:]]
    mixed = [h.result(60) for h in hs]
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    assert all(r.logprobs is None and r.prompt_logprobs is None for r in mixed)
    assert lp.result(60).token_ids == alone[0].token_ids  # asking for logprobs changes no token


def test_grammar_rows_report_the_unmasked_distribution(engine, oracle):
    spec = GrammarSpec("regex", "[a-z]{4}")
    r = engine.submit(PROMPT, SamplingParams(max_tokens=10, seed=4, logprobs=3, grammar=spec)).result(60)
    assert r.finish_reason == "stop" and len(r.text) == 4
    ref = ref_logprobs(oracle, PROMPT + r.token_ids)
    for i, (tok, value) in enumerate(zip(r.token_ids, r.logprobs)):
        check(value, ref[len(PROMPT) - 1 + i], tok, 3)  # top alternatives: any token, not only [a-z]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_out_of_range_logprobs_are_refused(engine, field):
    with pytest.raises(ValueError, match=field):
        engine.submit(PROMPT, SamplingParams(**{field: 21}))
