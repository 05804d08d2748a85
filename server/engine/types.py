"""Plain data that crosses the engine's boundary: parameters in, events and results out.

No torch import here: the scheduler, the task layer and the API all use these types.
(`Result.state` is a `server.model.state.State`, typed loosely to keep this module light.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# finish reasons
STOP = "stop"  # EOS, a stop token id or a stop string
LENGTH = "length"  # max_tokens reached
ABORT = "abort"  # aborted by request identity (client left, /stop)
ERROR = "error"  # the request failed (the engine survives)

EOS_TOKEN = 0


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence generation parameters (validated by the API layer)."""

    max_tokens: int = 256
    """Tokens to generate; 0 = prefill only (the sequence ends with its state ready)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 0.3
    top_k: int = 0
    """0 = no top-k cut."""
    presence_penalty: float = 0.5
    """Added once to a token's penalty on its first occurrence (RWKV `alpha_presence`)."""
    repetition_penalty: float = 0.5
    """Added to a token's penalty on every later occurrence (RWKV `alpha_frequency`)."""
    penalty_decay: float = 0.996
    """All penalties are multiplied by this before each new token is counted."""
    seed: int | None = None
    """Seed of this sequence's counter-based random stream (None: a random seed)."""
    stop: tuple[str, ...] = ()
    """Stop strings (matched on text across token boundaries, never emitted)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (EOS, id 0, always does unless ignore_eos)."""
    ignore_eos: bool = False


@dataclass(slots=True)
class Event:
    """One step's output for one sequence (delivered once per engine step)."""

    text: str
    """New text since the previous event (UTF-8 safe, stop strings held back)."""
    token_ids: list[int]
    """New token ids since the previous event."""
    n_tokens: int
    """Tokens generated so far by this sequence (after this event)."""
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class Result:
    """Everything about a finished sequence."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    prefill_time: float = 0.0
    """Seconds from submission to the first generated token (or to the end of prefill)."""
    gen_time: float = 0.0
    """Seconds spent generating after the prefill."""
    state: Any = None
    """Final state (a batch-1 `State` on the CPU) when it was asked for, else None."""
    error: str | None = None
    pending_tokens: list[int] = field(default_factory=list)
    """Tokens of prompt + token_ids NOT yet fed into `state` (normally the last generated token;
    empty after a stop token or a prefill-only request). To continue exactly as if the sequence
    had never stopped, submit `pending_tokens + new_prompt_tokens` with `init_state=state`."""

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    slots: int = 0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    step_ms: float = 0.0
    steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(Exception):
    """Base class of errors the engine raises to its callers."""


class QueueFullError(EngineError):
    """The waiting queue is full (HTTP 429)."""


class PromptTooLongError(EngineError):
    """The prompt has more tokens than allowed (HTTP 413)."""


class EngineDeadError(EngineError):
    """The engine loop died; no request can make progress (HTTP 503)."""


class RequestFailedError(EngineError):
    """This request failed inside the engine (others were unaffected)."""
