"""The engine: continuous batching over a slot pool, on-device sampling, the in-process API.

    from server.engine import Engine, SamplingParams
    engine = Engine(model, tokenizer, settings).start()
    result = engine.submit("Hello", SamplingParams(max_tokens=16)).result()

See engine.py for the API and the state contract (Result.state + Result.pending_tokens),
scheduler.py for the step plan, sampler.py for the sampling formula.
`import server.engine` and `server.engine.scheduler` do not import torch (Engine loads lazily).
"""

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
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    Result,
    SamplingParams,
)

__all__ = [
    "Engine", "RequestHandle", "SamplingParams", "Event", "Result", "EngineStats", "EngineError",
    "QueueFullError", "PromptTooLongError", "EngineDeadError", "RequestFailedError",
    "STOP", "LENGTH", "ABORT", "ERROR", "EOS_TOKEN",
]  # fmt: skip


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "RequestHandle":
        from .handle import RequestHandle

        return RequestHandle
    raise AttributeError(f"module 'server.engine' has no attribute {name!r}")
