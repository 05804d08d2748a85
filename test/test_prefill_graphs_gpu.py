"""Short prefills as CUDA-graph replays (server.model.prefill_graphs) against the eager forward:
logits and every slot's state, padded and exact length buckets, several sequences on scattered
slots, one graph reused across slots and contents, and what the graphs leave to the eager path."""

from __future__ import annotations

import pytest
import torch

from server.engine.runner import Runner
from server.model import load_model
from server.model.prefill_graphs import PrefillGraphs
from server.model.synthetic import save_synthetic

pytestmark = pytest.mark.gpu

KEEP: list = []
"""Every PrefillGraphs a test made, alive to the end of the process, as a server's are: on the H200
a decode-graph capture later in the same process failed after such graphs had been destroyed."""


def _graphs(model, pool, **kw) -> PrefillGraphs:
    KEEP.append(PrefillGraphs(model, pool, **kw))
    return KEEP[-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "m.pth"
    save_synthetic("synthetic:L4-C512:3", str(path), dtype=torch.float16)
    return load_model(str(path), device="cuda", dtype=torch.float16)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 65536, (n,), generator=g).tolist() for n in lengths]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-3) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(b.float().abs().max().item(), 1e-6), err


@pytest.mark.parametrize("lengths", [(16,), (13,), (100,), (5, 9, 30), (64, 1)])
def test_a_graph_replay_equals_the_eager_forward(model, lengths):
    pool, ref = model.zero_state(6), model.zero_state(6)
    for st in (pool, ref):
        st.wkv[:, 5].fill_(0.25)  # a slot no prompt touches
        model.forward([[7, 8, 9]] * len(lengths), st, slots=list(range(len(lengths))))  # prior history
    graphs = _graphs(model, pool, max_len=512)
    prompts, slots = _prompts(lengths, sum(lengths)), [4, 0, 2][: len(lengths)]
    assert graphs.covers(prompts)
    got = graphs.run(prompts, slots).clone()
    want = model.forward(prompts, ref, slots=slots)
    _close(got, want)
    for a, b in zip(pool.tensors(), ref.tensors()):
        _close(a, b)
    assert torch.equal(pool.wkv[:, 5], ref.wkv[:, 5])


def test_one_graph_serves_other_slots_and_prompts(model):
    pool, ref = model.zero_state(4), model.zero_state(4)
    graphs = _graphs(model, pool, max_len=64)
    for i, (n, slot) in enumerate([(20, 3), (30, 1), (17, 3)]):  # all in the 32-token bucket
        p = _prompts([n], 40 + i)
        _close(graphs.run(p, [slot]).clone(), model.forward(p, ref, slots=[slot]))
    assert list(graphs.graphs) == [(1, 32)]
    for a, b in zip(pool.tensors(), ref.tensors()):
        _close(a, b)


def test_what_the_graphs_leave_to_the_eager_path(model):
    pool = model.zero_state(8)
    graphs = _graphs(model, pool, max_len=128)
    assert not graphs.covers(_prompts([129], 1))  # longer than max_len
    assert not graphs.covers(_prompts([8] * 5, 2))  # more sequences than MAX_BATCH
    assert graphs.covers(_prompts([128] * 4, 3))
    assert not _graphs(model, pool, max_len=0).covers(_prompts([4], 4))
    with pytest.raises(ValueError, match="distinct"):
        graphs.run(_prompts([4, 4], 5), [1, 1])
    with pytest.raises(ValueError, match="token id"):
        graphs.run([[70000]], [0])


def test_the_runner_builds_them_when_asked(model):
    assert Runner(model, 4, cuda_graphs=True, prefill_graph_len=256).prefill_graphs is not None
    assert Runner(model, 4, cuda_graphs=True, prefill_graph_len=0).prefill_graphs is None
    assert Runner(model, 4, cuda_graphs=False, prefill_graph_len=256).prefill_graphs is None


def test_a_failed_capture_leaves_that_shape_eager(model, monkeypatch):
    pool, ref = model.zero_state(2), model.zero_state(2)
    graphs = _graphs(model, pool, max_len=64)
    calls = []

    def fail(B, T):
        calls.append((B, T))
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(graphs, "_capture", fail)
    for seed in (1, 2):  # the second call does not try the capture again
        p = _prompts([20], seed)
        _close(graphs.run(p, [1]), model.forward(p, ref, slots=[1]))
    assert calls == [(1, 32)] and not graphs.graphs
    for a, b in zip(pool.tensors(), ref.tensors()):
        _close(a, b)
