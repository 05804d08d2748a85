"""The engine: continuous batching over a slot pool, on-device sampling, the in-process API.

    from server.engine import Engine, SamplingParams
    engine = Engine(model, tokenizer, settings).start()
    result = engine.submit("Hello", SamplingParams(max_tokens=16)).result()

Modules, in the order a request meets them:
  types.py      parameters in, events and results out (plain data); protocol.py: the typed seams
  engine.py     the API (submit, abort, generate, stats) and the loop; `Engine.step` is one step
  sequence.py   a request as the scheduler sees it (token ids, progress)
  scheduler.py  decides each step (plan.py: the plan, its output and Finished records, plain data)
  runner.py     executes a plan on the device over the slot pool (torch); sampler.py: sampling;
                logprobs.py: logprobs of the rows that ask
  grammar.py    constrained decoding: GrammarSpec compiled by xgrammar; constraints.py: per-row masks
  output.py     text (text.py: detokenizer, stop strings), events, results, delivery
  handle.py     RequestHandle: a request seen from its caller; Deliveries: one wake-up per loop
  stats.py      rates and totals
Only runner.py and sampler.py import torch (the engine builds its runner at start(); grammar.py
loads xgrammar, which imports torch, on the first grammar compiled). docs/agents.md: grammars
and logprobs.
"""

from .engine import Engine
from .handle import RequestHandle
from .types import (
    ABORT,
    EOS_TOKEN,
    ERROR,
    LENGTH,
    STOP,
    EngineDeadError,
    EngineError,
    EngineStats,
    Event,
    GrammarSpec,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    Result,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "ABORT",
    "EOS_TOKEN",
    "ERROR",
    "LENGTH",
    "STOP",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "Event",
    "GrammarSpec",
    "PromptTooLongError",
    "QueueFullError",
    "RequestFailedError",
    "RequestHandle",
    "Result",
    "SamplingParams",
    "TokenLogprob",
]  # fmt: skip
