"""The runner's CUDA-graph logic on the CPU: `DecodeGraphs` with its graphs replaced by eager
replays of the same bodies (same static inputs and outputs, same self-feed), so the graph-mode
paths of runner.launch (bare continuation replays, forward-only replays for steps with grammar
masks or logprobs, `feed`, positions of the last replay) run here and must give exactly what the
plain eager runner gives. The GPU tests check the real graphs (test_engine_gpu.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from server.config import Settings
from server.engine import Engine, GrammarSpec, SamplingParams
from server.engine.plan import bucket_sizes
from server.engine.runner import Runner
from server.model import load_model
from server.model.graphs import DecodeGraphs
from server.tokenizer import get_tokenizer

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
          "required": ["k", "n"], "additionalProperties": False}  # fmt: skip


class _Replay:
    def __init__(self, fn):
        self.replay = fn


class EagerGraphs(DecodeGraphs):
    """Each 'graph' runs its body eagerly on replay into the static outputs made at capture;
    counts the replays by kind."""

    calls: dict[str, int]

    def forward(self, n, token_ids=None, positions=None, commit=None):
        self.calls["forward_cont" if token_ids is None else "forward"] += 1
        return super().forward(n, token_ids, positions, commit)

    def step_cont(self, n):
        self.calls["step_cont"] += 1
        return super().step_cont(n)

    def _warmup(self) -> None:
        self._warm = True

    def _capture(self, b: int) -> None:
        V = self.model.shape.vocab_size
        out = (torch.zeros(b, V, dtype=self.model.dtype), torch.zeros(b, dtype=torch.long))

        def run():
            logits, tok = self._body(b)
            out[0].copy_(logits)
            out[1].copy_(tok)
            torch.clamp(out[1], min=0, out=self.tokens[:b])
            self.positions[:b].add_(1)

        self.graphs[b], self.outputs[b] = _Replay(run), out

    def _capture_forward(self, b: int) -> None:
        logits = torch.zeros(b, self.model.shape.vocab_size, dtype=self.model.dtype)

        def run():
            logits.copy_(self.model.decode(self.tokens[:b], self.pool.view(0, b), raw_logits=True))

        self.fwd_graphs[b], self.fwd_logits[b] = _Replay(run), logits


@pytest.fixture(scope="module")
def model():
    return load_model("synthetic:tiny")


def run(model, reqs, graphs: bool):
    e = Engine(model, get_tokenizer(), Settings(max_batch=8, step_token_budget=64, prefill_chunk=8, stats_interval=0.0))
    e._runner = Runner(model, e.max_batch)
    if graphs:
        g = EagerGraphs(model, e._runner.pool, sampler=e._runner.sampler, buckets=bucket_sizes(e.max_batch))
        g.calls = {"forward": 0, "forward_cont": 0, "step_cont": 0}
        g.capture()
        e._runner.graphs = g
        e.defer_delivery = True  # as on CUDA
    e.start()
    try:
        return [h.result(120) for h in [e.submit(p, q) for p, q in reqs]], e
    finally:
        e.shutdown()


def test_graph_mode_with_masks_and_logprobs_equals_eager(model):
    spec = GrammarSpec.json_schema(SCHEMA)
    reqs = []
    for i in range(14):
        params = SamplingParams(max_tokens=[12, 30, 7][i % 3], seed=i, grammar=spec if i % 4 == 1 else None,
                                logprobs=2 if i % 3 == 0 else None, prompt_logprobs=1 if i == 5 else None,
                                temperature=0.0 if i == 6 else 1.0)  # fmt: skip
        reqs.append(([1 + i, 200 + 7 * i, 3000 + i][: 1 + i % 3] * (1 + i % 4), params))
    eager, _ = run(model, reqs, graphs=False)
    graph, e = run(model, reqs, graphs=True)
    assert min(e.runner.graphs.calls.values()) > 0, e.runner.graphs.calls  # every kind of replay ran
    for a, b, (_, q) in zip(eager, graph, reqs):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        for x, y in zip(a.logprobs or [], b.logprobs or []):  # the bucket's padding rows differ: fp noise
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert (a.logprobs is None) == (b.logprobs is None)
        assert [v.token for v in a.prompt_logprobs or []] == [v.token for v in b.prompt_logprobs or []]
        if q.grammar is not None and a.finish_reason == "stop":
            jsonschema.validate(json.loads(a.text), SCHEMA)
    assert any(r.finish_reason == "stop" for r, (_, q) in zip(graph, reqs) if q.grammar is not None)
