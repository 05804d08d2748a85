"""Generation parameters of tasks: `TaskParams`, stored as a plain JSON dict (the names of
`server.engine.types.FIELDS`, `response_format`, `grammar`, `hidden_lead` and `meta`), made from
what a caller gives (`GivenParams`) by `clean_params`, the one check, and turned into
SamplingParams per run by the one mapping, `SamplingParams.from_fields`,
plus the grammar of the response format (`format_grammar`: the one mapping of OpenAI's
response_format onto the engine's GrammarSpec, shared by the OpenAI and task routes) or the
task's own grammar (`grammar`: a GrammarSpec as {"kind", "source", "trigger"}, the tool-call
grammar of a /v1/responses task). `meta`: a JSON object the route that made the task keeps with
it (the Responses API: its request's instructions, input items and tools); runs never read it.
`hidden_lead` (a bool): the output's leading whitespace is hidden from its reader (a
/v1/responses reply after "Assistant:"), so stop strings are matched from the output's first other
character on (SamplingParams.hidden_lead, for a run whose output holds no other character yet).
All of it lives in the params JSON column: no schema change, older rows read as before."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, TypedDict, cast, get_type_hints

from server.engine.types import FIELD_KINDS, FIELDS, GrammarSpec, SamplingParams, check_fields
from server.tasks.errors import TaskInvalid


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
    meta: dict[str, Any]  # a JSON object of the route that made the task; runs never read it


GivenParams = Mapping[str, object]
"""Parameters as a caller gives them to the task layer (TaskManager.create / fim / fork /
continue_): by TaskParams' names, None or absent = not given, other names dropped; unchecked
(the in-process API bypasses the HTTP schema) until clean_params makes them TaskParams."""
PARAM_KEYS = (*FIELDS, "response_format", "grammar", "hidden_lead", "meta")
"""TaskParams' keys (check_task_params)."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of schemas in a response_format schema: the root is level 1, each schema
inside another (an object's property, an array's items, an anyOf branch, ...) one level more.
The grammar's compile time grows faster than linearly with it (measured with xgrammar: 32
object levels ~20 ms, 200 ~0.75 s, 500 ~18 s), so this bound is what keeps a compile short."""
MAX_JSON_DEPTH = 200
"""Deepest nesting of the schema's JSON document (a 32-level schema needs about 65, plus its
const / enum / default values): a backstop for the recursive code after this check (json.dumps,
the engine's json.loads and the library's parser), which Python's recursion limit (~1000)
would end with a RecursionError, not a ValueError, for an in-process caller's dict; and below
what a task stores (orjson writes at most 255 levels, the task's params around the schema
included). A tool's parameters and a call's arguments are held to it too (server.api.openai.tools)."""
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies")
"""Keywords whose value maps names to schemas one level down."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
"""Keywords whose value is a list of schemas one level down (items: the draft-4 tuple form)."""
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
               "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else")  # fmt: skip
"""Keywords whose value is one schema one level down."""
_DEFINITIONS = ("$defs", "definitions")
"""Keywords whose value maps names to schemas used where referenced: counted from level 1."""
_FORMAT_KEYS = {"type"}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
"""OpenAI's json_schema object (also the flat form's keys beside "type")."""
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
    """out's `grammar`, `hidden_lead` and `meta` from raw. A task has one grammar: a
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
    spec = stored_grammar(params["grammar"]) if params.get("grammar") else None
    if spec is not None:
        return replace(sp, grammar=spec)
    fmt = params.get("response_format")
    # stored before unknown keys were refused: such a format still runs as it did
    return sp if fmt is None else replace(sp, grammar=format_grammar(fmt, known_keys=False))


def format_grammar(fmt: Any, *, known_keys: bool = True) -> GrammarSpec | None:
    """The grammar of an OpenAI response_format (None for {"type": "text"}); ValueError saying
    what is wrong with its shape. Whether the schema compiles is the engine's word
    (Engine.compile_grammar), asked by the routes before anything starts.

    {"type": "json_object"}                                  -> GrammarSpec("json_object")
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  -> json_schema
    (the Responses API's flat form {"type": "json_schema", "name", "schema"} is accepted too)
    known_keys: a key outside these shapes is refused, naming it (the routes' unknown-field
    policy: never silently ignored)."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ValueError("invalid 'response_format': an object with a 'type' (text, json_object, json_schema)")
    kind = fmt["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"invalid 'response_format': type {kind!r} is not one of text, json_object, json_schema")
    if known_keys:
        _check_keys(fmt)
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    inner = fmt.get("json_schema", fmt)
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("invalid 'response_format': json_schema needs a 'schema' object")
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise ValueError(f"invalid 'response_format': the schema's JSON nests deeper than {MAX_JSON_DEPTH} levels")
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"invalid 'response_format': the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return GrammarSpec.json_schema(json.dumps(schema))  # (key order kept: the output follows the properties' order)


def _check_keys(fmt: dict[str, Any]) -> None:
    """ValueError naming the first key of fmt outside OpenAI's shape of its type: "type" alone
    (text, json_object), "type" + "json_schema" {name, description, schema, strict}, or the flat
    form ("type" + the json_schema keys)."""
    inner = fmt.get("json_schema")
    allowed, unknown = _FORMAT_KEYS, []
    if fmt["type"] == "json_schema" and "json_schema" in fmt:
        allowed = _FORMAT_KEYS | {"json_schema"}
        if isinstance(inner, dict):  # not an object: format_grammar says what it needs
            unknown = [f"json_schema.{k}" for k in inner if k not in _JSON_SCHEMA_KEYS]
    elif fmt["type"] == "json_schema":
        allowed = _FORMAT_KEYS | _JSON_SCHEMA_KEYS
    unknown = [k for k in fmt if k not in allowed] + unknown
    if unknown:
        raise ValueError(f"invalid 'response_format': unknown field {unknown[0]!r} (for type {fmt['type']!r})")


def _depth(root: Any, bound: int, children: Callable[[Any, int], Iterable[tuple[Any, int]]]) -> int:
    """The deepest level of a walk from `root` (level 1), where children(node, level) gives a
    node's (child, its level); counted up to bound + 1. Iterative: a hostile value cannot
    exhaust the stack."""
    deepest, todo = 0, [(root, 1)]
    while todo:
        node, level = todo.pop()
        deepest = max(deepest, level)
        if level > bound:
            break
        todo.extend(children(node, level))
    return deepest


def schema_depth(schema: dict[str, Any]) -> int:
    """How deep schemas nest in a JSON schema (MAX_SCHEMA_DEPTH's levels), counted up to
    MAX_SCHEMA_DEPTH + 1 (a tool's parameters are held to the same bound: tools.py)."""
    return _depth(schema, MAX_SCHEMA_DEPTH, _schema_children)


def json_depth(value: Any, bound: int = MAX_JSON_DEPTH) -> int:
    """How deep lists and objects nest in a parsed JSON value (the root: level 1), counted up to
    bound + 1 (iterative: a hostile value cannot exhaust the stack)."""
    return _depth(value, bound, _json_children)


def _json_children(n: Any, d: int) -> Iterable[tuple[Any, int]]:
    children = n.values() if isinstance(n, dict) else n if isinstance(n, list) else ()
    return ((c, d + 1) for c in children if isinstance(c, (dict, list)))


def _schema_children(node: dict[str, Any], level: int) -> Iterable[tuple[Any, int]]:
    """A schema under a subschema keyword of a level-L schema is at L + 1 (a property's schema,
    not the `properties` map, is the next level); values that are data (const, enum, default)
    are none; definitions count from level 1."""
    yield from ((c, level + 1) for c in _subschemas(node, _SCHEMA_MAPS, _SCHEMA_LISTS, _SCHEMA_ONE))
    yield from ((c, 1) for c in _subschemas(node, _DEFINITIONS, (), ()))


def _subschemas(node: dict[str, Any], maps: tuple[str, ...], lists: tuple[str, ...], one: tuple[str, ...]) -> list:
    """The schemas (JSON objects) under node's keywords of each kind."""
    out: list[Any] = []
    for key, value in node.items():
        if key in maps and isinstance(value, dict):
            out.extend(value.values())
        elif key in lists and isinstance(value, list):
            out.extend(value)
        elif key in one:
            out.append(value)
    return [c for c in out if isinstance(c, dict)]


def fim_prompt(prefix: str, suffix: str) -> str:
    """The RWKV-7 fill-in-the-middle prompt (docs/task-api.md)."""
    return f"✿prefix✿✿suffix✿{suffix}✿middle✿{prefix}"
