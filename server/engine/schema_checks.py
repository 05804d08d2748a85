"""Checks of a JSON schema before it is compiled into a grammar (GrammarCompiler.compile): a
schema that contains itself (the output would have no bound on its nesting) and keywords the
constrained decoder would silently ignore (an output could then fail the schema). Each is a
ValueError "invalid json_schema grammar: ...", which the routes answer as a 400 invalid_schema.
A format the library matches too loosely, or not at all, is compiled as its exact pattern
instead (formats.EXACT_FORMATS), bounded by the string's minLength / maxLength where it has them
(formats.format_pattern); so is a pattern beside them (pattern_lengths.bounded_pattern)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TypeGuard

from .formats import EXACT_FORMATS, FORMAT_WIDTHS, format_pattern
from .pattern_lengths import bounded_pattern
from .schema_keywords import check_keywords, is_number, read_schemas, types_of
from .schema_patterns import ignored_issue, pattern_issue

__all__ = ["DATA_KEYWORDS", "check_schema"]


def check_schema(source: str) -> str:
    """The schema text to compile: `source`, or it with exact patterns for formats the library
    lets through too much of (exact_formats). ValueError for text that is not a JSON object, a
    schema whose local $refs recurse (a schema that contains itself: the output would have no
    bound on its nesting), or one with a keyword the decoder would ignore (_check_enforced)."""
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"invalid json_schema grammar: not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("invalid json_schema grammar: a schema is a JSON object")

    def refs(node) -> list[str]:  # the local $refs of the schemas in node (not in its data)
        return [r for n, _ in _schema_nodes(node) if isinstance(r := n.get("$ref"), str) and r.startswith("#")]

    def resolve(ptr: str) -> Any:  # through objects' keys and arrays' indices (anyOf/0, prefixItems/1)
        node: Any = schema
        for part in [p for p in ptr[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list):
                node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
            else:
                node = node.get(part) if isinstance(node, dict) else None
        return node

    # depth-first over the $ref graph, iterative and visiting each pointer once (a chain of
    # thousands of $defs, or refs that fan out and meet again, cost linear time, no recursion);
    # a ref to a pointer still on the current path is a cycle
    on_path, done = {"#"}, set()
    stack = [("#", iter(refs(resolve("#"))))]
    while stack:
        ptr, todo = stack[-1]
        r = next(todo, None)
        if r is None:
            stack.pop()
            on_path.discard(ptr)
            done.add(ptr)
        elif r in on_path:
            raise ValueError(f"invalid json_schema grammar: recursive schema ({r!r} refers to itself)")
        elif r not in done:
            on_path.add(r)
            stack.append((r, iter(refs(resolve(r)))))
    changed = check_keywords(schema, _schema_nodes)
    _check_enforced(schema)
    return json.dumps(schema) if rewrite_strings(schema) or changed else source


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas (a "$ref" key there is no reference)."""
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names (any text, "format" too) to schemas."""


def _schema_nodes(schema: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """(node, JSON pointer) of every schema object in `schema` (not of data: const / enum /
    default / examples values; not of the maps of names: properties, $defs, ...), each before
    the schemas inside it (a change made to a node as it comes is seen there)."""
    todo: list[tuple[Any, str, bool]] = [(schema, "#", True)]  # (node, pointer, is a schema)
    while todo:
        node, at, is_schema = todo.pop()
        if isinstance(node, list):
            todo.extend((v, f"{at}/{i}", True) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if is_schema:
            yield node, at
        for k, v in node.items():
            if is_schema and k in DATA_KEYWORDS:
                continue
            ptr = f"{at}/{str(k).replace('~', '~0').replace('/', '~1')}"
            todo.append((v, ptr, not (is_schema and k in _NAMED)))


def _check_enforced(schema: Any) -> None:
    """ValueError naming the first keyword (with its JSON pointer) that the constrained decoder
    would silently ignore, so that an output could fail the schema: `uniqueItems` (xgrammar
    does not track the items), minLength / maxLength beside a `pattern` or a format (it drops
    them) where no pattern bounded by them is written (_length_issue), format "regex" (any
    string: a regex's syntax, with its nested groups, is no regular language, so no pattern
    writes just them), a pattern that writes a quote, a backslash or a control character itself
    or a construct the library ignores or misreads (schema_patterns; a patternProperties key's
    too), a multipleOf the library drops (_multiple_issue). The keywords it reads another
    way, or not at all: schema_keywords. Refused rather than ignored: a client relies on outputs
    that validate."""
    for node, at in read_schemas(schema, _schema_nodes):
        why, keys = None, (p if isinstance(p := node.get("patternProperties"), dict) else {})
        bad = next(((f"{at}/patternProperties/{k.replace('~', '~0').replace('/', '~1')}", b) for k in keys
                    if isinstance(k, str) and (b := ignored_issue(k))), None)  # fmt: skip
        if isinstance(node.get("pattern"), str) and (b := pattern_issue(node["pattern"])):
            bad = at, b
        if node.get("uniqueItems") is True:
            why = "uniqueItems is not enforced (use an array without it: a list, not a set)"
        elif issue := (_length_issue(node) if "minLength" in node or "maxLength" in node else None) or (
            _multiple_issue(node)
        ):
            why = issue
        elif node.get("format") == "regex":
            why = 'format "regex" is not enforced (any string would pass: drop it, or give a pattern instead)'
        elif bad:
            at, why = bad
        if why:
            raise ValueError(f"invalid json_schema grammar: at {at}: {why}")


def _multiple_issue(node: dict[str, Any]) -> str | None:
    """Why a multipleOf would be ignored, or None: on a number always; on an integer unless it is
    an integer up to 1024, with no bounds or both, at most 10,000 integers apart."""
    types, m = types_of(node), node.get("multipleOf")
    if not is_number(m) or types is None or not types & {"integer", "number"} or m <= 0:
        return None  # not a number's; the library refuses m <= 0
    if "number" in types:
        return "multipleOf is not enforced on a number: use type integer and an integer multipleOf, or drop it"
    if not float(m).is_integer() or m > 1024:
        return f"multipleOf {m!r} is not enforced (on an integer, one from 1 to 1024 is): drop it"
    low = [v + d for k, d in (("minimum", 0), ("exclusiveMinimum", 1)) if is_number(v := node.get(k))]
    high = [v - d for k, d in (("maximum", 0), ("exclusiveMaximum", 1)) if is_number(v := node.get(k))]
    if m > 1 and (bool(low) != bool(high) or (low and high and min(high) - max(low) + 1 > 10_000)):  # 1: any
        return ("multipleOf beside one bound, or bounds over 10,000 integers apart, is not enforced: give both "
                "bounds, at most 10,000 integers apart, or none")  # fmt: skip
    return None


def _lengths(node: dict[str, Any]) -> tuple[int, int | None] | None:
    """(minLength, maxLength or None) of a string schema, or None where one is no count."""
    least, most = node.get("minLength", 0), node.get("maxLength")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    return (least, most) if count(least) and (most is None or count(most)) else None


def _length_issue(node: dict[str, Any]) -> str | None:
    """Why the minLength / maxLength of `node` would go unenforced, or None. The library drops
    them beside a pattern and beside a format of FORMAT_WIDTHS; they are enforced there where
    every string has such a length, or where the pattern (pattern_lengths.bounded_pattern) or
    the format's pattern (formats.format_pattern) is bounded by them. Beside another format (an
    annotation to the library) they are enforced as they are."""
    fmt, pattern, bounds = node.get("format"), node.get("pattern"), _lengths(node)
    if "pattern" in node and not isinstance(pattern, str):
        return "a pattern must be a string"
    if "pattern" in node and _known(fmt):
        return f'minLength / maxLength beside a pattern and format "{fmt}" are not enforced (drop the format)'
    if "pattern" not in node and not _known(fmt):
        return None
    if bounds is None:
        what = "a pattern" if "pattern" in node else f'format "{fmt}"'
        return f"minLength / maxLength beside {what} must be counts (non-negative integers)"
    try:
        bounded_pattern(pattern, *bounds) if isinstance(pattern, str) else format_pattern(str(fmt), *bounds)
    except ValueError as exc:
        return str(exc)
    return None


def _known(fmt: Any) -> TypeGuard[str]:
    """Whether `fmt` is a format the library has a grammar of (FORMAT_WIDTHS)."""
    return isinstance(fmt, str) and fmt in FORMAT_WIDTHS


def rewrite_strings(schema: Any) -> bool:
    """Replace, in place, each `format` of EXACT_FORMATS (in a schema without its own pattern) by
    its exact pattern (formats.py), bounded by the schema's minLength / maxLength, and bound a
    pattern beside them (pattern_lengths.py). The lengths go: the pattern carries them, or every
    string has such a length (_check_enforced refused the others). True when a schema changed."""
    changed = False
    for node, _ in read_schemas(schema, _schema_nodes):
        fmt, bounds = node.get("format"), _lengths(node)
        lengths = "minLength" in node or "maxLength" in node
        if isinstance(node.get("pattern"), str) and lengths and bounds is not None and not _known(fmt):
            node["pattern"] = bounded_pattern(node["pattern"], *bounds)
            node.pop("minLength", None)
            node.pop("maxLength", None)
            changed = True
        if not _known(fmt) or "pattern" in node or bounds is None:
            continue
        if fmt in EXACT_FORMATS or lengths:
            pattern = format_pattern(fmt, *bounds)
            node.pop("minLength", None)
            node.pop("maxLength", None)
            if pattern is not None:
                del node["format"]
                node["pattern"] = pattern
            changed = True
    return changed
