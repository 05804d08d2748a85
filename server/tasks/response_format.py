"""The checks of a task's `response_format` and the nesting bounds of JSON schemas.

`format_grammar`: the one mapping of OpenAI's response_format onto the engine's GrammarSpec,
its shape checked (server.tasks.params stores and runs it; the OpenAI and task routes check a
request's format with it before anything starts, server.api.grammar). `schema_depth` and
`json_depth`: iterative walks that bound how deep a schema's schemas and a JSON value nest,
shared with a tool's parameters and a call's arguments (server.api.openai.tools). A module of its
own: the schema rules are read as one contract, apart from how a task stores its parameters."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from server.engine.types import GrammarSpec

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
    if known_keys:
        _check_named(inner)
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise ValueError(f"invalid 'response_format': the schema's JSON nests deeper than {MAX_JSON_DEPTH} levels")
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"invalid 'response_format': the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return GrammarSpec.json_schema(json.dumps(schema))  # (key order kept: the output follows the properties' order)


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_named(inner: dict[str, Any]) -> None:
    """The json_schema object's other fields as OpenAI types them: `name` 1 to 64 letters, digits,
    '_' or '-' (optional here), `strict` a boolean, `description` text. (Rows stored before this
    check are read without it: known_keys=False.)"""
    name = inner.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ValueError("invalid 'response_format': json_schema's 'name' must be 1 to 64 letters, digits, '_' or '-'")
    if inner.get("strict") is not None and not isinstance(inner["strict"], bool):
        raise ValueError("invalid 'response_format': json_schema's 'strict' must be true or false")
    if inner.get("description") is not None and not isinstance(inner["description"], str):
        raise ValueError("invalid 'response_format': json_schema's 'description' must be a string")


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
