"""Generation parameters of tasks: stored as a plain JSON dict (the names of
`server.engine.types.FIELDS`), checked when a caller gives them, turned into SamplingParams per
run by the one mapping, `SamplingParams.from_fields`."""

from __future__ import annotations

import re
from typing import Any

from server.engine.types import FIELDS, SamplingParams, check_fields
from server.tasks.errors import TaskInvalid

PARAM_KEYS = FIELDS
_INTS = ("max_tokens", "top_k", "seed")
_FLOATS = ("temperature", "top_p", "presence_penalty", "repetition_penalty", "penalty_decay")
_FIELD_IN_MESSAGE = re.compile(r"'(\w+)'")


def clean_params(raw: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The known, explicitly given (non-None) parameters, JSON-ready; TaskInvalid (naming the
    field) for a value of the wrong type or outside the bounds (types.LIMITS, check_fields).
    The HTTP schema checks the same bounds; this guards the callers that bypass it (the
    in-process API), so bad parameters never reach the engine or the store."""
    out: dict[str, Any] = {}
    for k in FIELDS:
        v = raw.get(k)
        if v is None:
            continue
        out[k] = _typed(k, v)
    try:
        check_fields(out, vocab_size)
    except ValueError as exc:
        m = _FIELD_IN_MESSAGE.search(str(exc))
        raise TaskInvalid(str(exc), param=m.group(1) if m else None) from None
    return out


def _typed(k: str, v: Any) -> Any:
    """v as field k's JSON type (ints stay ints for the float fields: the stored form is the
    caller's); TaskInvalid when it is not one."""
    if k in _INTS:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif k in _FLOATS:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif k == "ignore_eos":
        ok = isinstance(v, bool)
    elif k == "stop":
        v = [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else v
        ok = isinstance(v, list) and all(isinstance(s, str) for s in v)
    else:  # stop_token_ids
        v = list(v) if isinstance(v, (list, tuple)) else v
        ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if not ok:
        raise TaskInvalid(f"invalid '{k}': {v!r} has the wrong type", param=k)
    return v


def sampling_params(params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """The SamplingParams of a run of a task with these stored parameters."""
    return SamplingParams.from_fields(params, default_max_tokens)


def fim_prompt(prefix: str, suffix: str) -> str:
    """The RWKV-7 fill-in-the-middle prompt (docs/task-api.md)."""
    return f"✿prefix✿✿suffix✿{suffix}✿middle✿{prefix}"
