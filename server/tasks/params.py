"""Generation parameters of tasks: stored as a plain JSON dict (the names of
`server.engine.types.FIELDS`, and `response_format`), checked when a caller gives them, turned
into SamplingParams per run by the one mapping, `SamplingParams.from_fields`, plus the grammar
of the response format (`format_grammar`: the one mapping of OpenAI's response_format onto the
engine's GrammarSpec, shared by the OpenAI and task routes)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from server.engine.types import FIELDS, GrammarSpec, SamplingParams, check_fields
from server.tasks.errors import TaskInvalid

PARAM_KEYS = (*FIELDS, "response_format")
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a response_format schema (objects and lists) accepted."""
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
    fmt = raw.get("response_format")
    if fmt is not None:
        try:
            format_grammar(fmt)
            out["response_format"] = fmt  # {"type": "text"} too: it overrides a fork source's format
        except ValueError as exc:
            raise TaskInvalid(str(exc), param="response_format") from None
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
    sp = SamplingParams.from_fields(params, default_max_tokens)
    fmt = params.get("response_format")
    return sp if fmt is None else replace(sp, grammar=format_grammar(fmt))


def format_grammar(fmt: Any) -> GrammarSpec | None:
    """The grammar of an OpenAI response_format (None for {"type": "text"}); ValueError saying
    what is wrong with its shape. Whether the schema compiles is the engine's word
    (Engine.compile_grammar), asked by the routes before anything starts.

    {"type": "json_object"}                                  -> GrammarSpec("json_object")
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  -> json_schema
    (the Responses API's flat form {"type": "json_schema", "name", "schema"} is accepted too)"""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ValueError("invalid 'response_format': an object with a 'type' (text, json_object, json_schema)")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ValueError(f"invalid 'response_format': type {kind!r} is not one of text, json_object, json_schema")
    inner = fmt.get("json_schema", fmt)
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("invalid 'response_format': json_schema needs a 'schema' object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"invalid 'response_format': the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return GrammarSpec.json_schema(json.dumps(schema, sort_keys=True))


def _depth(node: Any) -> int:
    """Nesting depth of a JSON value (iterative: a hostile schema cannot exhaust the stack)."""
    deepest, todo = 0, [(node, 1)]
    while todo:
        n, d = todo.pop()
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:
            break
        children = n.values() if isinstance(n, dict) else n if isinstance(n, list) else ()
        todo.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def fim_prompt(prefix: str, suffix: str) -> str:
    """The RWKV-7 fill-in-the-middle prompt (docs/task-api.md)."""
    return f"✿prefix✿✿suffix✿{suffix}✿middle✿{prefix}"
