"""Generation parameters of tasks: `TaskParams`, stored as a plain JSON dict (the names of
`server.engine.types.FIELDS`, `response_format`, `grammar`, `hidden_lead`, `logprobs` and `meta`), made from
what a caller gives (`GivenParams`) by `clean_params`, the one check, and turned into
SamplingParams per run by the one mapping, `SamplingParams.from_fields`, plus the grammar of the
response format (`format_grammar`, server.tasks.response_format: the one mapping of OpenAI's
response_format onto the engine's GrammarSpec, shared by the OpenAI and task routes) or the
task's own grammar (`grammar`: a GrammarSpec as {"kind", "source", "trigger"}, the tool-call
grammar of a /v1/responses task). `meta`: a JSON object the route that made the task keeps with
it (the Responses API: its request's instructions, input items and tools); runs never read it.
`hidden_lead` (a bool): the output's leading whitespace is hidden from its reader (a
/v1/responses reply after "Assistant:"), so stop strings are matched from the output's first other
character on (SamplingParams.hidden_lead, for a run whose output holds no other character yet).
`logprobs` (an int k in [0, 20]): its runs compute every generated token's logprob and its k most
probable alternatives (SamplingParams.logprobs), kept beside the output in memory (Output.logprobs;
a /v1/responses reply with `include: ["message.output_text.logprobs"]`).
All of it lives in the params JSON column: no schema change, older rows read as before."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, TypedDict, cast, get_type_hints

from server.engine.types import FIELD_KINDS, FIELDS, MAX_LOGPROBS, GrammarSpec, SamplingParams, check_fields
from server.tasks.errors import TaskInvalid
from server.tasks.response_format import format_grammar


class TaskParams(TypedDict, total=False):
    """A task's parameters as stored (its params column, key for key) and read: those given, in
    their stored form (clean_params). The sampling fields are FIELDS' names, each of the stored
    type of its kind in types.FIELD_KINDS (`_KINDS`): `check_task_params` holds them to that at
    import, so a FIELDS name missing here, or typed otherwise, fails the import naming it."""

    max_tokens: int
    temperature: float  # (an integer as given: a float field stores the caller's number)
    top_k: int
    top_p: float
    presence_penalty: float
    repetition_penalty: float
    penalty_decay: float
    seed: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    response_format: dict[str, Any]  # OpenAI's, as given ({"type": "text"}: none, over a fork source's)
    grammar: dict[str, str]  # {"kind", "source", "trigger"} (stored_grammar); {}: none, over a source's
    hidden_lead: bool
    logprobs: int  # k alternatives per generated token (SamplingParams.logprobs)
    meta: dict[str, Any]  # a JSON object of the route that made the task; runs never read it


GivenParams = Mapping[str, object]
"""Parameters as a caller gives them to the task layer (TaskManager.create / fim / fork /
continue_): by TaskParams' names, None or absent = not given, other names dropped; unchecked
(the in-process API bypasses the HTTP schema) until clean_params makes them TaskParams."""
PARAM_KEYS = (*FIELDS, "response_format", "grammar", "hidden_lead", "logprobs", "meta")
"""TaskParams' keys (check_task_params)."""
_FIELD_IN_MESSAGE = re.compile(r"'(\w+)'")


def clean_params(raw: GivenParams, vocab_size: int) -> TaskParams:
    """The known, explicitly given (non-None) parameters, JSON-ready; TaskInvalid (naming the
    field) for a value of the wrong type (types.FIELD_KINDS: SamplingParams' field types) or
    outside the bounds (types.LIMITS, check_fields).
    The HTTP schema checks the same bounds; this guards the callers that bypass it (the
    in-process API), so bad parameters never reach the engine or the store. The one place a
    value becomes TaskParams: each is of its key's type once checked (check_task_params)."""
    out: dict[str, Any] = {}
    for k in FIELD_KINDS:  # FIELDS' names
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
    _grammar_and_meta(raw, out)
    try:
        check_fields(out, vocab_size)
    except ValueError as exc:
        m = _FIELD_IN_MESSAGE.search(str(exc))
        raise TaskInvalid(str(exc), param=m.group(1) if m else None) from None
    return cast(TaskParams, out)


def _grammar_and_meta(raw: GivenParams, out: dict[str, Any]) -> None:
    """out's `grammar`, `hidden_lead`, `logprobs` and `meta` from raw. A task has one grammar: a
    response_format given lifts a stored grammar (a fork of a tool-call response with a format
    runs the format), a grammar given lifts a stored format; both (a format other than text) is
    TaskInvalid."""
    spec = raw.get("grammar")
    if spec is not None:
        try:
            stored_grammar(spec)
        except ValueError as exc:
            raise TaskInvalid(f"invalid 'grammar': {exc}", param="grammar") from None
        out["grammar"] = dict(cast("dict[str, str]", spec))  # (stored_grammar refuses any other)
    if spec and "response_format" not in out:
        out["response_format"] = {"type": "text"}
    elif "response_format" in out and spec is None:
        out["grammar"] = {}
    if spec and out["response_format"].get("type") != "text":
        raise TaskInvalid("a task has one grammar: 'grammar' or 'response_format', not both", param="grammar")
    hidden = raw.get("hidden_lead")
    if hidden is not None:
        if not isinstance(hidden, bool):
            raise TaskInvalid("invalid 'hidden_lead': true or false", param="hidden_lead")
        out["hidden_lead"] = hidden
    k = raw.get("logprobs")
    if k is not None:
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS):
            raise TaskInvalid(f"invalid 'logprobs': {k!r} is no integer in [0, {MAX_LOGPROBS}]", param="logprobs")
        out["logprobs"] = k
    meta = raw.get("meta")
    if meta is not None:
        if not isinstance(meta, dict):
            raise TaskInvalid("invalid 'meta': a JSON object", param="meta")
        out["meta"] = meta


def stored_grammar(spec: Any) -> GrammarSpec | None:
    """The GrammarSpec of a stored `grammar` ({"kind", "source", "trigger"}; {}: none); ValueError
    for anything else. Whether it compiles is the engine's word, asked by the route."""
    if not isinstance(spec, dict) or set(spec) - {"kind", "source", "trigger"}:
        raise ValueError('a grammar is {"kind", "source", "trigger"} ({} for none)')
    if not spec:
        return None
    kind, source, trigger = spec.get("kind"), spec.get("source", ""), spec.get("trigger", "")
    if not (isinstance(kind, str) and isinstance(source, str) and isinstance(trigger, str)):
        raise ValueError("a grammar's kind, source and trigger are text")
    out = GrammarSpec(kind, source, trigger)
    out.check()
    return out


def grammar_fields(spec: GrammarSpec | None) -> dict[str, str]:
    """What a task stores of `spec` (its `grammar` parameter; {} for None: given, it
    lifts a fork source's grammar)."""
    return {} if spec is None else {"kind": spec.kind, "source": spec.source, "trigger": spec.trigger}


def _typed(k: str, v: Any) -> Any:
    """v in field k's stored form (ints stay ints for the float fields: the stored form is the
    caller's; a stop string becomes a list of one); TaskInvalid when it is not of k's JSON kind
    (types.FIELD_KINDS, from SamplingParams' field types). A name without a kind is a programming
    error (LookupError), never checked as another field's kind."""
    kind = FIELD_KINDS.get(k)
    if kind is None:
        raise LookupError(f"{k!r} is not a sampling field (server.engine.types.FIELD_KINDS)")
    if kind not in _KINDS:
        raise LookupError(f"sampling field {k!r}: its JSON kind {kind!r} has no check in params._KINDS")
    _, form, ok = _KINDS[kind]
    v = form(v)
    if not ok(v):
        raise TaskInvalid(f"invalid '{k}': {v!r} has the wrong type", param=k)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_list(v: Any) -> Any:
    """A list or tuple as a list (anything else as it is: its check refuses it)."""
    return list(v) if isinstance(v, (list, tuple)) else v


def _as_texts(v: Any) -> Any:
    """Stop strings as a list (one string: a list of one)."""
    return [v] if isinstance(v, str) else _as_list(v)


class _Kind(NamedTuple):
    stored: Any  # the type of a stored value (its TaskParams key's type)
    form: Callable[[Any], Any]  # the stored form of a given value
    ok: Callable[[Any], bool]  # whether that form is of the kind


_KINDS: dict[str, _Kind] = {
    "int": _Kind(int, lambda v: v, _is_int),
    "float": _Kind(float, lambda v: v, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": _Kind(bool, lambda v: v, lambda v: isinstance(v, bool)),
    "texts": _Kind(list[str], _as_texts, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "token_ids": _Kind(list[int], _as_list, lambda v: isinstance(v, list) and all(_is_int(x) for x in v)),
}
"""Each JSON kind of types._JSON_KINDS."""


def check_task_params(td: type = TaskParams, kinds: Mapping[str, str] = FIELD_KINDS) -> None:
    """TypeError unless td's keys are kinds' names (FIELDS) and the rest of PARAM_KEYS, each
    sampling field's of its kind's stored type: run at import, it holds TaskParams to the one
    field list (FIELDS, and FIELD_KINDS from SamplingParams' field types)."""
    hints, keys = get_type_hints(td), (*kinds, *PARAM_KEYS[len(FIELDS) :])
    missing, extra = [k for k in keys if k not in hints], [k for k in hints if k not in keys]
    if missing or extra:
        raise TypeError(f"TaskParams' keys are FIELDS' and {keys[len(kinds) :]}: missing {missing}, extra {extra}")
    for name, kind in kinds.items():
        if hints[name] != _KINDS[kind].stored:
            raise TypeError(f"TaskParams[{name!r}] is {hints[name]}, not its kind's ({kind}) {_KINDS[kind].stored}")


check_task_params()


def sampling_params(params: TaskParams, default_max_tokens: int) -> SamplingParams:
    """The SamplingParams of a run of a task with these stored parameters."""
    sp = SamplingParams.from_fields(params, default_max_tokens)
    if params.get("logprobs") is not None:
        sp = replace(sp, logprobs=params["logprobs"])
    spec = stored_grammar(params["grammar"]) if params.get("grammar") else None
    if spec is not None:
        return replace(sp, grammar=spec)
    fmt = params.get("response_format")
    # stored before unknown keys were refused: such a format still runs as it did
    return sp if fmt is None else replace(sp, grammar=format_grammar(fmt, known_keys=False))


def inherited(params: TaskParams) -> TaskParams:
    """A source's parameters as a fork or a template of it takes them: less `logprobs` (a run's
    cost that only the route that asked reads: a /v1/tasks fork could neither show them nor turn
    them off)."""
    out = params.copy()
    out.pop("logprobs", None)
    return out


def fim_prompt(prefix: str, suffix: str) -> str:
    """The RWKV-7 fill-in-the-middle prompt (docs/task-api.md)."""
    return f"✿prefix✿✿suffix✿{suffix}✿middle✿{prefix}"
