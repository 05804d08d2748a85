"""JSON-schema keywords the constrained decoder (xgrammar 0.2.9) would silently ignore: refused,
naming where, or rewritten into keywords it reads (check_keywords; schema_checks.check_schema).
The library reads one keyword of a schema, dropping the others: the first of HEADS it has; else
its `type` (that type's keywords); else an object or an array (_READS) or any value. It never
reads _NEVER, a oneOf's exclusion (read as anyOf), a `required` name without its property.
VALIDATION: the standard keywords (2020-12, draft-7); any other key is an annotation."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from .formats import FORMAT_WIDTHS

__all__ = ["HEADS", "VALIDATION", "check_keywords", "is_number", "read_schemas", "types_of"]

VALIDATION = frozenset({
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies", "prefixItems",
    "items", "additionalItems", "contains", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties",  # the applicators
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired", "format",  # the assertions
    "$ref", "$dynamicRef", "$recursiveRef",
})  # fmt: skip
"""The keywords that constrain a value; every other key of a schema is an annotation."""
HEADS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # read alone, in this order: the first there is
_READS = ("properties", "additionalProperties", "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems")
"""Without a head or a type: an object (the first three) or an array (the others), or any value."""
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_NEVER = {  # the keywords the library never reads: what to do instead
    "not": "drop it, or list the values wanted (enum, anyOf)",
    **dict.fromkeys(("if", "then", "else"), "write the cases as anyOf branches"),
    **dict.fromkeys(("contains", "minContains", "maxContains"), "give the items as prefixItems, or drop it"),
    **dict.fromkeys(("dependentRequired", "dependentSchemas", "dependencies"),
                    "make the properties required, or write the cases as anyOf branches"),
    **dict.fromkeys(("$dynamicRef", "$recursiveRef"), 'use a $ref to a local pointer ("#/$defs/...")'),
}  # fmt: skip
_ONE_OF = ("oneOf is read as anyOf; use anyOf if an output may match several branches, or make the branches' "
           "types differ (or give each its own const of a required property)")  # fmt: skip
Nodes = Callable[[Any], Iterator[tuple[dict[str, Any], str]]]
Sign = tuple[set[str] | None, set[str] | None, dict[str, set[str]]]  # _sign


def read_schemas(schema: Any, nodes: Nodes) -> Iterator[tuple[dict[str, Any], str]]:
    """The (node, JSON pointer) of `nodes(schema)` (each object but data and name maps, before
    those inside it: schema_checks._schema_nodes) the library may read: the root, the schemas in
    a read one's keywords (once the caller is done with it), each $ref's target; no annotation's."""
    read = {id(schema)} | {id(_target(n, schema, 1)) for n, _ in nodes(schema) if "$ref" in n}
    for node, at in nodes(schema):
        if id(node) in read:
            yield node, at
            read.update(map(id, _inside(node)))


def check_keywords(schema: Any, nodes: Nodes) -> bool:
    """Refuse (ValueError "invalid json_schema grammar: at <pointer>: <why>") the first keyword
    the library would ignore (_issue), once those it can read another way are rewritten in
    place: a `type` beside anyOf / oneOf / allOf goes into each branch (_merge_type), a
    `required` name gets its property (_declare), enum values not of the `type` beside them go.
    True when the schema changed."""
    refs = [r for n, _ in nodes(schema) if isinstance(r := n.get("$ref"), str)]
    changed = False
    for node, at in read_schemas(schema, nodes):
        head = next((k for k in HEADS if k in node), None)
        try:
            if head in ("anyOf", "oneOf", "allOf") and "type" in node:
                changed |= _merge_type(node, head, schema, any(r.startswith(f"{at}/{head}/") for r in refs))
            elif head is None and _reads_object(node):
                changed |= _declare(node)
            elif head == "enum" and isinstance(node["enum"], list) and (t := types_of(node)) is not None:
                kept = [v for v in node["enum"] if _value_types(v) & t]
                if not kept:
                    raise ValueError(f"no value of enum is of type {node['type']}: no output can pass")
                changed |= len(kept) < len(node["enum"])
                node["enum"] = kept
            why = _issue(node, head, schema)
        except ValueError as exc:
            why = str(exc)
        if why:
            raise ValueError(f"invalid json_schema grammar: at {at}: {why}")
    return changed


def _issue(node: dict[str, Any], head: str | None, root: Any) -> str | None:
    """Why the library would ignore a keyword of `node` (rewritten), or None."""
    if never := next((k for k in node if k in _NEVER), None):
        return f"{never} is not enforced: {_NEVER[never]}"
    if "$ref" in node and not (isinstance(ref := node["$ref"], str) and (ref == "#" or ref.startswith("#/"))):
        return f'$ref {ref!r} is not followed (the decoder reads it as any value): refer to "#/$defs/..." instead'
    if empty := next((k for k in ("anyOf", "oneOf", "allOf") if node.get(k) == []), None):
        return f"an empty {empty} is not enforced: give it a branch, or drop it"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf with more than one member is not enforced (one is read): merge them into one schema"
    if head is not None:
        return _beside_head(node, head, root)
    if (why := _repeats_issue(node)) is not None:
        return why
    read = [k for k in node if k in VALIDATION and (k != "format" or str(node[k]) in FORMAT_WIDTHS)]
    if "type" in node or any(k in node for k in _READS) or not read:
        return None
    return (f"{' / '.join(read)} without a type is not enforced (the decoder reads a schema with no type, const, "
            "enum, $ref, anyOf, oneOf, allOf, properties or items as any value): add a type")  # fmt: skip


def _repeats_issue(node: dict[str, Any]) -> str | None:
    """A minProperties that only names not declared can reach: the library keeps such names apart
    from the declared ones but not from each other (one may repeat, and a parser keeps one of the
    repeats), so it is enforced up to the required properties and one more name."""
    least, required = node.get("minProperties"), node.get("required")
    if not is_number(least):
        return None
    opened = any(k in node and node[k] is not False for k in ("additionalProperties", "unevaluatedProperties"))
    if not (opened or node.get("patternProperties") or "propertyNames" in node):
        return None
    reach = len(set(map(str, required if isinstance(required, list) else ()))) + 1
    if least <= reach:
        return None
    return (f"minProperties {least} is not enforced past {reach} (the required properties and one more): the names "
            "of properties not declared may repeat in the output, and a parser keeps one; declare the properties "
            f"(properties + required), or lower minProperties to {reach}")  # fmt: skip


def _beside_head(node: dict[str, Any], head: str, root: Any) -> str | None:
    """Why keywords beside the one the library reads (head) would be ignored, or None."""
    beside = " / ".join(k for k in node if k in VALIDATION and k not in (head, "type"))  # a type: below, or merged
    if beside and head in ("const", "enum"):
        return f"{beside} beside {head} is not enforced (the listed values are written): drop it"
    if beside:
        where = {"$ref": "the referenced schema", "allOf": "its member"}.get(head, "each branch")
        return f"{beside} beside {head} is not enforced (only the {head} is read): move it into {where}"
    types = types_of(node)
    if "type" in node and types is None:
        return f"type {node['type']!r} is no JSON type (nor a list of them)"
    if head == "const" and types is not None and not _value_types(node["const"]) & types:
        return f"const {node['const']!r} is not of type {node['type']}: no output can pass"
    if head == "$ref" and types is not None and not _within(_types(node, root), types):
        return "type beside $ref is not enforced (only the $ref is read): put it in the referenced schema"
    if head == "oneOf" and isinstance(node["oneOf"], list) and not _exclusive(node["oneOf"], root):
        return _ONE_OF
    return None


def _merge_type(node: dict[str, Any], head: str, root: Any, pointed_into: bool) -> bool:
    """Move the `type` beside anyOf / oneOf / allOf into each branch (what it means): a branch gets
    it, or the types of both (integer within number), or goes where none is left. A $ref branch
    stays where its types are all the node's, goes where none is; else refused."""
    types, branches = types_of(node), node[head]
    if types is None:
        raise ValueError(f"type {node['type']!r} is no JSON type (nor a list of them)")
    if not isinstance(branches, list):
        return False  # the library refuses it
    kept: list[Any] = []
    for b in branches:
        own = _types(b, root)
        both = types if own is None else _meet(types, own)
        if _within(own, types) or not both:
            kept += [b] if both else []
            continue
        if not isinstance(b, (dict, bool)) or (isinstance(b, dict) and "$ref" in b):
            raise ValueError(f"type beside {head} is not enforced (only the {head} is read), and a branch is a "
                           "$ref: put the type in the referenced schema, or in each branch")  # fmt: skip
        kept.append(b if isinstance(b, dict) else {})
        kept[-1]["type"] = next(iter(both)) if len(both) == 1 else [t for t in _TYPES if t in both]
    if not kept or (head == "allOf" and len(kept) < len(branches)):
        raise ValueError(f"no value of type {node['type']} passes the {head}: no output can pass")
    if pointed_into and len(kept) < len(branches):
        raise ValueError(f"type beside {head} is not enforced, and a $ref points into it: put the type in each branch")
    node[head] = kept
    del node["type"]
    return True


def _inside(node: dict[str, Any]) -> Iterator[Any]:
    """The schemas in the keywords of a schema."""
    for k, v in node.items():
        if k in ("properties", "patternProperties", "dependentSchemas", "dependencies", "$defs", "definitions"):
            yield from v.values() if isinstance(v, dict) else ()
        elif k in VALIDATION:  # a schema, a list of them, or data (never taken for a schema)
            yield from v if isinstance(v, list) else [v]


def _reads_object(node: dict[str, Any]) -> bool:
    """Whether the library reads a schema without a head as an object (as one of its types)."""
    return "object" in (types_of(node) or ()) if "type" in node else any(k in node for k in _READS[:3])


def _declare(node: dict[str, Any]) -> bool:
    """Give each `required` name without a property (the library writes none: the output would
    lack it) the schema it has there: a matching patternProperties', else additionalProperties'
    (unevaluatedProperties'), else {}. Refused where they forbid it, or two patterns match it."""
    names, props, patterns = node.get("required"), node.get("properties", {}), node.get("patternProperties")
    if not isinstance(names, list) or not isinstance(props, dict):
        return False  # the library refuses it
    missing = [n for n in dict.fromkeys(n for n in names if isinstance(n, str)) if n not in props]
    for name in missing:
        try:
            hits = [s for p, s in (patterns if isinstance(patterns, dict) else {}).items() if re.search(p, name)]
        except re.error:
            raise ValueError(f"required {name!r} has no property, and a patternProperties pattern is no regex "
                           "this check reads: declare it in properties") from None  # fmt: skip
        key = next((k for k in ("additionalProperties", "unevaluatedProperties") if k in node), "")
        extra = node.get(key, True)
        if len(hits) > 1 or (not hits and extra is False):
            why = "several patternProperties match it" if hits else f"{key}: false forbids it"
            raise ValueError(f"required {name!r} has no property, and {why}: declare it in properties")
        sub = hits[0] if hits else extra if isinstance(extra, dict) else {}
        node.setdefault("properties", props)[name] = copy.deepcopy(sub)
    return bool(missing)


def types_of(node: dict[str, Any]) -> set[str] | None:
    """The types a schema's `type` names (a type or a list of them), or None: none, or not types."""
    value = node.get("type")
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return set(names) if names and all(isinstance(n, str) and n in _TYPES for n in names) else None


def _target(node: Any, root: Any, hops: int = -1) -> Any:
    """`node`, or where its local $ref leads (through the chain, or `hops` of it); None: nowhere."""
    seen: set[str] = set()
    while hops and isinstance(node, dict) and isinstance(ref := node.get("$ref"), str) and ref not in seen:
        seen.add(ref)
        hops -= 1
        node = root if ref == "#" or ref.startswith("#/") else None
        for part in ref[2:].split("/") if node is not None else ():
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) and part else node
    return node


def _types(node: Any, root: Any) -> set[str] | None:
    """The types of the values a schema (through its $ref) takes, or None: it does not say."""
    node = _target(node, root)
    if not isinstance(node, dict):
        return set() if node is False else None
    types, values = types_of(node), _values(node)
    of_values = None if values is None else set().union(*map(_value_types, values))
    return types if of_values is None else of_values if types is None else types & of_values


def _values(node: dict[str, Any]) -> list[Any] | None:
    """The values a schema's const / enum lists, or None: it has neither."""
    return [node["const"]] if "const" in node else node["enum"] if isinstance(node.get("enum"), list) else None


def _value_types(v: Any) -> set[str]:
    """The types of a JSON value (1 is an integer and a number)."""
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, (int, float)):
        return {"number", "integer"} if isinstance(v, int) or v.is_integer() else {"number"}
    return {k for k, t in (("null", type(None)), ("string", str), ("array", list), ("object", dict)) if type(v) is t}


def _meet(a: set[str], b: set[str]) -> set[str]:
    """The types of the values of both sets (integer within number)."""
    numbers = ("integer" in a and "number" in b) or ("number" in a and "integer" in b)
    return a & b | ({"integer"} if numbers else set())


def _within(a: set[str] | None, b: set[str]) -> bool:
    """Whether every value of types `a` is of types `b` (no: `a` unknown)."""
    return a is not None and all(t in b or (t == "integer" and "number" in b) for t in a)


def is_number(v: Any) -> TypeGuard[float]:
    """Whether `v` is a JSON number (not a boolean)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _key(v: Any) -> str:
    """The JSON text of a value, the same for equal values (1 and 1.0; true is no 1)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (list, dict)):
        items = sorted(v.items()) if isinstance(v, dict) else enumerate(v)
        return ("{%s}" if isinstance(v, dict) else "[%s]") % ",".join(f"{json.dumps(k)}:{_key(x)}" for k, x in items)
    return json.dumps(v)


def _sign(branch: Any, root: Any) -> Sign:
    """(types, const / enum values (_key), {required property: its const / enum values}) of a
    schema (through its $ref; the last for an object schema); None: it does not say."""
    node = _target(branch, root)
    if not isinstance(node, dict):
        return _types(node, root), None, {}
    values, props, required = _values(node), node.get("properties"), node.get("required")
    keys = None if values is None else set(map(_key, values))
    if _types(node, root) != {"object"} or not isinstance(props, dict) or not isinstance(required, list):
        return _types(node, root), keys, {}
    subs = {p: _target(props.get(p), root) for p in required if isinstance(p, str)}
    tags = {p: set(map(_key, vs)) for p, s in subs.items() if isinstance(s, dict) and (vs := _values(s)) is not None}
    return {"object"}, keys, tags


def _exclusive(branches: list[Any], root: Any) -> bool:
    """Whether no value passes two branches, provably: each two have types apart (integer within
    number), const / enum values apart, or a required property's const / enum values apart (a
    discriminator: pydantic's tagged unions). Linear where all are; else by pairs, to 512 branches."""
    signs = [_sign(b, root) for b in branches]
    for group in [[s[1] for s in signs]] + [[s[2].get(p) for s in signs] for p in (signs[0][2] if signs else {})]:
        keys = [k for g in group for k in (g if g is not None else [None])]
        if None not in keys and len(keys) == len(set(keys)):
            return True
    return len(signs) <= 512 and all(_apart(a, b) for i, a in enumerate(signs) for b in signs[i + 1 :])


def _apart(a: Sign, b: Sign) -> bool:
    """Whether no value passes two schemas of these signs (_sign), provably."""
    if a[0] is not None and b[0] is not None and not _meet(a[0], b[0]):
        return True
    if a[1] is not None and b[1] is not None and not a[1] & b[1]:
        return True
    return any(not vs & b[2][p] for p, vs in a[2].items() if p in b[2])
