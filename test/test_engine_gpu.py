"""The engine on CUDA: CUDA-graph decode steps equal eager steps, batching equals running alone,
seeded sampling on the GPU, final states copied out on the side stream."""

from __future__ import annotations

import random

import pytest
import torch

from server.config import Settings
from server.engine import Engine, SamplingParams
from server.engine.types import GrammarSpec
from server.model import load_model
from server.tokenizer import get_tokenizer

pytestmark = pytest.mark.gpu

GREEDY = dict(temperature=0.0, presence_penalty=0.0, repetition_penalty=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("synthetic:L4-C512:3", device="cuda", dtype=torch.float32)


KEEP: list = []


def run_engine(model, reqs, graphs: bool, alone: bool = False, max_batch: int = 16, prefill_graph_len: int = 0,
               captured: list | None = None):  # fmt: skip
    """The engine's results for reqs. prefill_graph_len: 0 by default, so that graphs=True and
    False differ only in the decode step (padded prefill graphs change GEMM shapes, so last bits);
    captured: gets the prefill graphs' (count, length) keys."""
    s = Settings(max_batch=max_batch, step_token_budget=256, prefill_chunk=64, cuda_graphs=graphs, stats_interval=0.0,
                 prefill_graph_len=prefill_graph_len)  # fmt: skip
    e = Engine(model, get_tokenizer(), s).start()
    try:
        if alone:
            return [e.submit(p, q).result(120) for p, q in reqs]
        return [h.result(120) for h in [e.submit(p, q) for p, q in reqs]]
    finally:
        if captured is not None and e._runner.prefill_graphs is not None:  # the runner is private: a test's look
            captured.extend(e._runner.prefill_graphs.graphs)
            KEEP.append(e._runner.prefill_graphs)  # alive to the end, as a server's (test_prefill_graphs_gpu.KEEP)
        e.shutdown()


def requests(n, params_fn):
    rng = random.Random(0)
    return [([rng.randrange(1, 65530) for _ in range(rng.randrange(1, 150))], params_fn(i)) for i in range(n)]


def test_graphs_equal_eager_and_batching_equals_alone(model):
    reqs = requests(40, lambda i: SamplingParams(max_tokens=1 + i % 12, **GREEDY))
    graphs = run_engine(model, reqs, graphs=True)
    eager = run_engine(model, reqs, graphs=False)
    assert [r.token_ids for r in graphs] == [r.token_ids for r in eager]
    for r, (_, q) in zip(graphs, reqs):
        assert r.finish_reason == "length" and r.completion_tokens == q.max_tokens
    alone = run_engine(model, reqs[:8], graphs=True, alone=True)
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, graphs[:8]))
    assert same >= 7  # fp32 GEMMs of different batch sizes may differ in the last bit


def test_seeded_sampling_on_gpu(model):
    reqs = requests(24, lambda i: SamplingParams(max_tokens=8, seed=i, ignore_eos=True))
    a = run_engine(model, reqs, graphs=True)
    b = run_engine(model, reqs, graphs=True, max_batch=4)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b)) >= 22


def test_seeded_sampling_graphs_equal_eager(model):
    """Seeded sampling (positions drive the random stream): the graphs' self-fed continuation
    steps give the tokens the eager path gives with host-side positions."""
    reqs = requests(12, lambda i: SamplingParams(max_tokens=10 + i % 5, seed=100 + i, ignore_eos=True))
    a = run_engine(model, reqs, graphs=True)
    b = run_engine(model, reqs, graphs=False)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b)) >= 11


def test_states_copied_out_and_continued(model):
    e = Engine(model, get_tokenizer(), Settings(max_batch=8, cuda_graphs=True, stats_interval=0.0)).start()
    try:
        a, b = list(range(10, 60)), list(range(200, 230))
        ra = e.submit(a, SamplingParams(max_tokens=0), return_state=True).result(60)
        assert ra.state.device.type == "cpu" and ra.state.wkv.abs().sum() > 0
        rb = e.submit(b, SamplingParams(max_tokens=6, **GREEDY), init_state=ra.state, return_state=True).result(60)
        rab = e.submit(a + b, SamplingParams(max_tokens=6, **GREEDY), return_state=True).result(60)
        assert rb.token_ids == rab.token_ids
        for x, y in zip(rb.state.tensors(), rab.state.tensors()):
            assert torch.allclose(x, y, atol=1e-3, rtol=1e-3)
        more = e.submit(rb.pending_tokens, SamplingParams(max_tokens=4, **GREEDY), init_state=rb.state).result(60)
        whole = e.submit(a + b, SamplingParams(max_tokens=10, **GREEDY)).result(60)
        assert rb.token_ids + more.token_ids == whole.token_ids
    finally:
        e.shutdown()


@pytest.mark.parametrize("graphs", [True, False])
def test_a_state_that_overflows_fails_its_request_alone(model, graphs):
    """A start state with extreme values makes that row's logits NaN: the fused sampler gives it
    NONFINITE_TOKEN, its request ends with the error, and the requests beside it (greedy and
    seeded, in the same steps) give the tokens they give without it."""
    e = Engine(model, get_tokenizer(), Settings(max_batch=8, cuda_graphs=graphs, stats_interval=0.0)).start()
    try:
        st = e.submit(list(range(10, 40)), SamplingParams(max_tokens=0), return_state=True).result(60).state
        for t in st.tensors():
            t.mul_(1e30)
        seeded = dict(seed=1, ignore_eos=True)
        reqs = [(list(range(100 + i, 120 + i)), SamplingParams(max_tokens=12, **(seeded if i % 2 else GREEDY)))
                for i in range(5)]  # fmt: skip
        want = [h.result(60) for h in [e.submit(p, q) for p, q in reqs]]
        for _ in range(2):  # the engine lives on: a second round the same
            handles = [e.submit(p, q) for p, q in reqs[:2]]
            bad = e.submit([5, 6, 7], SamplingParams(max_tokens=12, **GREEDY), init_state=st)
            handles += [e.submit(p, q) for p, q in reqs[2:]]
            got = [h.result(60) for h in handles]
            r = bad.result(60)
            assert r.finish_reason == "error" and "NaN or infinite" in (r.error or ""), r
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
    finally:
        e.shutdown()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}  # fmt: skip


def test_prefill_graphs_in_the_engine(model):
    """With --prefill-graph-len the engine's short prefills replay graphs (chunks of up to 64
    tokens here: the 16- to 64-token buckets, several sequences a step; every graph captured at
    start-up); greedy outputs equal
    the eager prefill's but for rare last-bit flips (a padded GEMM has another shape)."""
    reqs = requests(40, lambda i: SamplingParams(max_tokens=6, **GREEDY))
    keys: list = []
    on = run_engine(model, reqs, graphs=True, prefill_graph_len=512, captured=keys)
    off = run_engine(model, reqs, graphs=True, prefill_graph_len=0)
    assert set(keys) == {(B, T) for B in range(1, 5) for T in (16, 32, 64, 128, 256, 512)}  # at start-up
    same = sum(a.token_ids == b.token_ids for a, b in zip(on, off))
    assert same >= 36, same


def test_grammar_and_logprob_rows_graphs_equal_eager(model):
    """Masked steps (a forward-only graph replay, masks filled on the host meanwhile, eager
    masked sampling) give the same tokens and logprobs as eager steps; free rows are unchanged
    by constrained rows in their batch; constrained outputs validate."""
    import json

    import jsonschema

    spec = GrammarSpec.json_schema(SCHEMA)
    mk = lambda i, g=True: SamplingParams(max_tokens=60, seed=i, grammar=spec if g and i % 4 == 0 else None,  # noqa: E731
                                          logprobs=3 if i % 3 == 0 else None)  # fmt: skip
    reqs = requests(24, mk)
    graphs = run_engine(model, reqs, graphs=True)
    eager = run_engine(model, reqs, graphs=False)
    assert [r.token_ids for r in graphs] == [r.token_ids for r in eager]
    assert [r.finish_reason for r in graphs] == [r.finish_reason for r in eager]
    for a, b in zip(graphs, eager):
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
    for r, (_, q) in zip(graphs, reqs):
        if q.grammar is not None:
            assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
            jsonschema.validate(json.loads(r.text), SCHEMA)
    free = run_engine(model, [(p, mk(i, g=False)) for i, (p, _) in enumerate(reqs)], graphs=True)
    for r, f, (_, q) in zip(graphs, free, reqs):
        if q.grammar is None:
            assert r.token_ids == f.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_copies_equal_their_device_states_byte_for_byte(dtype):
    """Copies through the threads' pinned staging: every state comes back whole, in its dtype and
    shape, under its own id, while later (larger) states grow the staging buffers."""
    from server.engine.copyout import HostCopies
    from server.model.state import State

    copies = HostCopies(torch.device("cuda"), threads=3)
    sent = {}
    try:
        for i in range(24):
            c = 64 + 32 * (i % 5)  # sizes vary, so a thread's staging is reused and grown
            shapes = [(2, 1, c), (2, 1, c), (2, 1, 4, 8, 8)]
            s = State(*(torch.randn(shape, device="cuda").to(dtype) for shape in shapes))
            sent[f"r{i}"] = s
            copies.submit(f"r{i}", s.clone())  # the clone is the copy's own, as the engine's gather
        got = dict(copies.take(wait=True))
    finally:
        copies.close()
    assert set(got) == set(sent)
    for rid, s in sent.items():
        h = got[rid]
        assert h is not None and h.device.type == "cpu"
        for a, b in zip(s.tensors(), h.tensors(), strict=True):
            assert b.dtype == dtype and b.shape == a.shape and not b.is_pinned()
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), rid
