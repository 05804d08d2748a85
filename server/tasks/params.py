"""Generation parameters of tasks: stored as a plain dict, turned into SamplingParams per run."""

from __future__ import annotations

from typing import Any

from server.engine.types import SamplingParams

PARAM_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "presence_penalty",
              "repetition_penalty", "penalty_decay", "seed", "stop", "stop_token_ids")


def clean_params(raw: dict[str, Any]) -> dict[str, Any]:
    """Keep the known, explicitly given (non-None) parameters, JSON-ready."""
    out: dict[str, Any] = {}
    for k in PARAM_KEYS:
        v = raw.get(k)
        if v is None:
            continue
        if k == "stop":
            v = [v] if isinstance(v, str) else list(v)
        elif k == "stop_token_ids":
            v = [int(x) for x in v]
        out[k] = v
    return out


def sampling_params(params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    d = SamplingParams()
    top_k = int(params.get("top_k", d.top_k))
    return SamplingParams(
        max_tokens=int(params.get("max_tokens", default_max_tokens)),
        temperature=float(params.get("temperature", d.temperature)),
        top_p=float(params.get("top_p", d.top_p)),
        top_k=max(0, top_k),  # the SDK's -1 = no top-k cut = our 0
        presence_penalty=float(params.get("presence_penalty", d.presence_penalty)),
        repetition_penalty=float(params.get("repetition_penalty", d.repetition_penalty)),
        penalty_decay=float(params.get("penalty_decay", d.penalty_decay)),
        seed=params.get("seed"),
        stop=tuple(params.get("stop", ())),
        stop_token_ids=tuple(params.get("stop_token_ids", ())),
    )


def fim_prompt(prefix: str, suffix: str) -> str:
    """The RWKV-7 fill-in-the-middle prompt (docs/task-api.md)."""
    return f"✿prefix✿✿suffix✿{suffix}✿middle✿{prefix}"
