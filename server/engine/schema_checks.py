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

    def resolve(ptr: str) -> Any:
        node: Any = schema
        for part in [p for p in ptr[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
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
    (_unwritable), a multipleOf the library drops (_multiple_issue). The keywords it reads another
    way, or not at all: schema_keywords. Refused rather than ignored: a client relies on outputs
    that validate."""
    for node, at in read_schemas(schema, _schema_nodes):
        why = None
        if node.get("uniqueItems") is True:
            why = "uniqueItems is not enforced (use an array without it: a list, not a set)"
        elif issue := (_length_issue(node) if "minLength" in node or "maxLength" in node else None) or (
            _multiple_issue(node)
        ):
            why = issue
        elif node.get("format") == "regex":
            why = 'format "regex" is not enforced (any string would pass: drop it, or give a pattern instead)'
        elif isinstance(node.get("pattern"), str) and (bad := _unwritable(node["pattern"])):
            why = _UNWRITABLE[bad[1]].format(repr(bad[0]) if len(bad[0]) == 1 else bad[0])
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


_CODES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0}
"""Regex escapes of control characters (and \\b inside a class: a word boundary outside)."""
Spans = list[tuple[int, int]]
_DIGITS, _WORD = [(0x30, 0x39)], [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACES = [(9, 13), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
           (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]  # fmt: skip


def _others(spans: Spans) -> Spans:
    """The code points outside sorted `spans` (ranges lo..hi), as sorted disjoint ranges."""
    out, at = [], 0
    for lo, hi in spans:
        out += [(at, lo - 1)] if lo > at else []
        at = max(at, hi + 1)
    return out + ([(at, 0x10FFFF)] if at <= 0x10FFFF else [])


_CATEGORIES = {"d": _DIGITS, "w": _WORD, "s": _SPACES}
_CATEGORIES |= {k.upper(): _others(v) for k, v in _CATEGORIES.items()}


def _atom(pattern: str, i: int, in_class: bool) -> tuple[Spans | None, int]:
    """The code points the character or escape at pattern[i] stands for (None: an assertion or
    a back-reference, or a category outside a class: nothing to check), and the index after it."""
    nxt = pattern[i + 1 : i + 2]
    if pattern[i] != "\\" or not nxt:
        return [(ord(pattern[i]), ord(pattern[i]))], i + 1
    width = {"x": 2, "u": 4}.get(nxt, 0)
    digits = pattern[i + 2 : i + 2 + width]
    if width and len(digits) == width and all(c in "0123456789abcdefABCDEF" for c in digits):
        return [(int(digits, 16), int(digits, 16))], i + 2 + width
    if nxt == "c" and pattern[i + 2 : i + 3].isalpha():
        return [(ord(pattern[i + 2]) % 32, ord(pattern[i + 2]) % 32)], i + 3
    if nxt in _CODES or (nxt == "b" and in_class):
        return [(_CODES.get(nxt, 8), _CODES.get(nxt, 8))], i + 2
    if nxt in _CATEGORIES:
        return (_CATEGORIES[nxt] if in_class else None), i + 2
    return (None if nxt in "bB" or nxt.isdigit() else [(ord(nxt), ord(nxt))]), i + 2


def _single(spans: Spans | None) -> int | None:
    """The one code point of `spans`, or None."""
    return spans[0][0] if spans and len(spans) == 1 and spans[0][0] == spans[0][1] else None


def _class(pattern: str, i: int) -> tuple[Spans, int]:
    """The code points of the character class at pattern[i] ("["), sorted disjoint ranges, and
    the index after it. ECMA-262: the first `]` closes it ("[]" is empty, "[^]" any character)."""
    negated = pattern.startswith("^", i + 1)
    i += 2 if negated else 1
    spans: Spans = []
    while i < len(pattern) and pattern[i] != "]":
        one, i = _atom(pattern, i, True)
        if _single(one) is not None and pattern[i : i + 1] == "-" and pattern[i + 1 : i + 2] not in ("]", ""):
            last, i = _atom(pattern, i + 1, True)
            end = _single(last)
            one = [(_single(one) or 0, end)] if end is not None else (one or []) + [(0x2D, 0x2D)] + (last or [])
        spans += one or []
    spans = _others(sorted(spans))
    return (spans if negated else _others(spans)), i + 1


_UNWRITABLE = {
    "raw": ("the pattern writes a quote or backslash itself ({}: outside a character class, or a class of nothing "
            "else); the decoder matches a pattern against the string's JSON text, so it would go out unescaped "
            "(invalid JSON, or another string: a backslash starts an escape): not supported"),
    "control": ("the pattern writes a control character ({}: outside a character class, or a class of nothing "
                "else); the decoder writes no control character inside a JSON string (they are written escaped, "
                "and the library matches the pattern against the raw text), so this part of the pattern can never "
                "be written: not supported (a class with other members, as [^\\n] or [\\s\\S], is fine)"),
}  # fmt: skip
"""Why a pattern is refused (_unwritable), by what it writes."""


def _unwritable(pattern: str) -> tuple[str, str] | None:
    """(part, why) of the first part of `pattern` the decoder cannot write as it should, or None.
    xgrammar matches a pattern against the JSON text of the string, not its value: a quote or a
    backslash outside a character class goes out unescaped (why "raw"; a class leaves both out,
    but for a class of nothing else); a control character outside a class, or a class of nothing
    else, is never written (why "control"; the decoder masks raw control bytes inside JSON). A
    class with other members is fine: the library, or the mask, leaves those out."""
    i = 0
    while i < len(pattern):
        start = i
        if pattern[i] == "[":
            members, i = _class(pattern, i)
            if members and not any(hi >= 0x20 and {max(lo, 0x20), hi} - {0x22, 0x5C} for lo, hi in members):
                raw = any(lo <= c <= hi for lo, hi in members for c in (0x22, 0x5C))
                return pattern[start:i], "raw" if raw else "control"
            continue
        one, i = _atom(pattern, i, False)
        code = _single(one)
        if code is not None and (code in (0x22, 0x5C) or code < 0x20):
            return chr(code), "raw" if code >= 0x20 else "control"
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
