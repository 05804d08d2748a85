"""JSON-schema keywords the constrained decoder (xgrammar) would silently ignore
(server/engine/schema_keywords.py, schema_checks.py; docs/agents.md): each is refused, naming
its JSON pointer and the keyword, or rewritten into keywords the library reads. A rewrite is
checked by random walks of the compiled grammar (the bytes as vocabulary, control bytes masked
as the decoder masks them inside JSON): every output validates against the ORIGINAL schema,
while the original compiled as it is writes outputs that do not (the rewrite is needed).
Pydantic's schemas pass unchanged and compile."""

from __future__ import annotations

import json
import random
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from server.engine.schema_checks import check_schema

BYTES = 256  # the vocabulary of conftest.byte_compiler: the 256 bytes; token 256 is the end


def walks(grammar, n: int, rng: random.Random):
    """n outputs of the grammar, each byte drawn among those it allows but control bytes (the
    decoder masks them inside JSON), printable ASCII where it allows one, ending where it may
    with a drawn probability (closing what is open past 100 bytes); ("DEADEND", bytes) where
    nothing is allowed, ("BADJSON", bytes) for text json refuses."""
    import torch
    import xgrammar as xgr

    mask, shifts = xgr.allocate_token_bitmask(1, BYTES + 1), torch.arange(32, dtype=torch.int32)
    for _ in range(n):
        m, out, stop = xgr.GrammarMatcher(grammar), b"", rng.choice([0.02, 0.1, 0.3, 0.7])
        while True:
            m.fill_next_token_bitmask(mask)
            bits = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[: BYTES + 1]
            allowed = [t for t in bits.nonzero().flatten().tolist() if t >= 0x20]
            if not allowed:
                yield ("DEADEND", out)
                break
            if BYTES in allowed and (len(allowed) == 1 or rng.random() < stop or len(out) > 200):
                try:
                    yield json.loads(out)
                except ValueError:
                    yield ("BADJSON", out)
                break
            printable = [t for t in allowed if t < 0x7F]
            closing = [t for t in printable if t in b'"]}'] if len(out) > 100 else []  # toward the end
            token = rng.choice(closing or printable or [t for t in allowed if t != BYTES])
            assert m.accept_token(token)
            out += bytes([token])


def invalid(byte_compiler, source: str, schema: dict, n: int, seed: str) -> list:
    """The outputs of n walks of `source` compiled as the server compiles it that fail `schema`."""
    grammar = byte_compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    check = jsonschema.Draft202012Validator(schema)
    return [v for v in walks(grammar, n, random.Random(seed)) if isinstance(v, tuple) or not check.is_valid(v)]


def obj(**props) -> dict:  # an object schema with these required properties
    return {"type": "object", "properties": props, "required": list(props)}


INT, STR = {"type": "integer"}, {"type": "string"}
DEFS = {"i": INT, "s": STR, "ai": {"anyOf": [INT]}}
REFUSED = [
    (obj(a={"type": "integer", "not": {"const": 1}}), "#/properties/a", "not is not enforced"),
    ({"not": {}}, "#", "not is not enforced"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "#",
     "if is not enforced: write the cases as anyOf"),
    ({"type": "array", "items": INT, "contains": {"const": 7}}, "#", "contains is not enforced"),
    ({"type": "array", "items": INT, "minContains": 2}, "#", "minContains is not enforced"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}, "#",
     "dependentRequired is not enforced"),
    ({"type": "object", "properties": {"a": INT}, "dependentSchemas": {"a": {"required": ["b"]}}}, "#",
     "dependentSchemas is not enforced"),
    ({"type": "object", "properties": {"a": INT}, "dependencies": {"a": ["b"]}}, "#", "dependencies is not enforced"),
    (obj(a={"type": "number", "multipleOf": 0.5}), "#/properties/a", "multipleOf is not enforced on a number"),
    (obj(a={"type": ["integer", "number"], "multipleOf": 2}), "#/properties/a",
     "multipleOf is not enforced on a number"),
    (obj(a={"type": "integer", "multipleOf": 2, "minimum": 1}), "#/properties/a", "multipleOf beside one bound"),
    (obj(a={"type": "number", "multipleOf": 1}), "#/properties/a", "multipleOf is not enforced on a number"),
    (obj(a={"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 10_000}), "#/properties/a",
     "bounds over 10,000 integers apart"),
    (obj(a={"type": "integer", "multipleOf": 1.5}), "#/properties/a", "multipleOf 1.5 is not enforced"),
    (obj(a={"type": "integer", "multipleOf": 2048}), "#/properties/a", "multipleOf 2048 is not enforced"),
    ({"allOf": [obj(a=INT), obj(b=INT)]}, "#", "allOf with more than one member"),
    (obj(a={"anyOf": []}), "#/properties/a", "an empty anyOf"),
    (obj(a={"oneOf": []}), "#/properties/a", "an empty oneOf"),
    (obj(a={"allOf": []}), "#/properties/a", "an empty allOf"),
    ({"oneOf": [obj(a=INT), obj(a={"type": "number"})]}, "#", "oneOf is read as anyOf"),
    ({"oneOf": [{"enum": ["a", "b"]}, {"const": "b"}]}, "#", "oneOf is read as anyOf"),
    ({"oneOf": [obj(a=INT), obj(b=INT)]}, "#", "oneOf is read as anyOf"),
    ({"$defs": DEFS, **obj(a={"$ref": "#/$defs/i", "minimum": 5})}, "#/properties/a", "minimum beside $ref"),
    ({"$defs": DEFS, **obj(a={"$ref": "#/$defs/i", "type": "string"})}, "#/properties/a", "type beside $ref"),
    ({"$defs": DEFS, **obj(a={"$ref": "#/$defs/ai", "type": "integer"})}, "#/properties/a", "type beside $ref"),
    ({"type": "object", "properties": {"a": INT}, "anyOf": [{"required": ["b"]}, {"required": ["c"]}]}, "#",
     "properties beside anyOf is not enforced"),
    (obj(a={"oneOf": [INT, STR], "minimum": 3}), "#/properties/a", "minimum beside oneOf"),
    (obj(a={"const": 5, "maximum": 3}), "#/properties/a", "maximum beside const"),
    (obj(a={"enum": ["x", "yy"], "type": "string", "maxLength": 1}), "#/properties/a", "maxLength beside enum"),
    (obj(a={"type": "string", "const": 1}), "#/properties/a", "const 1 is not of type string"),
    (obj(a={"type": "string", "enum": [1, 2]}), "#/properties/a", "no value of enum is of type string"),
    ({"type": "object", "properties": {"b": INT}, "required": ["a"], "additionalProperties": False}, "#",
     "required 'a' has no property, and additionalProperties: false"),
    ({"type": "object", "properties": {"b": INT}, "required": ["a"], "unevaluatedProperties": False}, "#",
     "required 'a' has no property, and unevaluatedProperties: false"),
    ({"type": "object", "required": ["ab"], "patternProperties": {"^a": INT, "b$": STR}}, "#",
     "several patternProperties match it"),
    ({"$defs": DEFS, **obj(a={"type": "number", "anyOf": [{"$ref": "#/$defs/ai"}]})}, "#/properties/a",
     "type beside anyOf is not enforced (only the anyOf is read), and a branch is a $ref"),
    (obj(a={"type": "string", "anyOf": [INT, {"const": 1}]}), "#/properties/a", "no value of type string passes"),
    (obj(a={"maximum": 7}), "#/properties/a", "maximum without a type"),
    ({"anyOf": [{"required": ["b"]}, {"required": ["c"]}]}, "#/anyOf/", "required without a type"),
    (obj(a={"format": "date"}), "#/properties/a", "format without a type"),
    ({"$defs": DEFS, "$dynamicRef": "#/$defs/i"}, "#", "$dynamicRef is not enforced"),
    ({"$defs": {"i": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "#", "$ref '#x' is not followed"),
    (obj(a={"$ref": "https://example.com/a.json"}), "#/properties/a", "is not followed"),
    ({"$defs": DEFS, "x-defs": {"A": {"$ref": "#/$defs/i", "minimum": 3}}, **obj(a={"$ref": "#/x-defs/A"})},
     "#/x-defs/A", "minimum beside $ref"),  # an annotation's value a $ref leads to is read
    # names not declared may repeat: a minProperties only they reach is not enforced (QA wrote {"x": 3, "x": 3})
    ({"type": "object", "patternProperties": {"^x$": INT}, "additionalProperties": False, "minProperties": 2},
     "#", "minProperties 2 is not enforced past 1"),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "minProperties": 2}, "#", "minProperties 2"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": INT,
      "minProperties": 3}, "#", "lower minProperties to 2"),
    (obj(a={"type": "object", "unevaluatedProperties": STR, "minProperties": 2}), "#/properties/a", "past 1"),
]  # fmt: skip


@pytest.mark.parametrize("schema, at, why", REFUSED)
def test_keywords_the_decoder_would_ignore_are_refused_naming_where(schema, at, why):
    with pytest.raises(ValueError) as e:
        check_schema(json.dumps(schema))
    assert f"invalid json_schema grammar: at {at}" in str(e.value) and why in str(e.value), str(e.value)


REWRITTEN = [
    {"type": "object", "required": ["a"]},
    {"type": "object", "properties": {"b": INT}, "required": ["a", "b"]},
    {"type": "object", "properties": {"b": INT}, "required": ["a"], "additionalProperties": STR},
    {"type": "object", "required": ["xa"], "patternProperties": {"^x": INT}, "additionalProperties": False},
    {"type": ["object", "null"], "properties": {}, "required": ["a"], "unevaluatedProperties": INT},
    obj(a={"type": "integer", "anyOf": [{"minimum": 10}, {"maximum": -10}]}),
    {"type": "object", "anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
    obj(a={"type": ["string", "null"], "anyOf": [INT, {"type": ["string", "integer"], "minLength": 2},
                                               {"const": 1}, {"enum": ["x", 2, None]}]}),
    {"$defs": DEFS, **obj(a={"type": ["integer", "boolean"],
                           "oneOf": [{"$ref": "#/$defs/i"}, {"$ref": "#/$defs/s"}, {"enum": [True, "x"]}]})},
    obj(a={"type": "string", "allOf": [{"maxLength": 3}]}),
    obj(a={"type": "string", "enum": ["a", 1, "b", None]}),
]  # fmt: skip


@pytest.mark.parametrize("schema", REWRITTEN)
def test_rewritten_schemas_write_only_outputs_the_original_takes(byte_compiler, schema):
    """A required name without its property gets one (additionalProperties' schema, the
    matching patternProperties', or {}); a type beside anyOf / oneOf / allOf goes into each
    branch (a branch no value of it passes goes); enum values not of the type go. Each output of
    the rewritten grammar validates against the original; the original alone writes some that do
    not."""
    source = check_schema(json.dumps(schema))
    assert source != json.dumps(schema)
    assert invalid(byte_compiler, source, schema, 100, source) == []
    assert invalid(byte_compiler, json.dumps(schema), schema, 30, source) != []


@pytest.mark.parametrize("schema", [
    {"oneOf": [obj(a=INT), STR, {"type": "array"}]},
    {"oneOf": [{"const": True}, {"const": 1}, {"enum": ["1", None]}]},
    {"$defs": DEFS, "oneOf": [{"$ref": "#/$defs/i"}, {"$ref": "#/$defs/s"}, {"type": "null"}]},
    obj(a={"type": "integer", "multipleOf": 3}),
    obj(a={"type": ["integer", "null"], "multipleOf": 4, "minimum": -20, "exclusiveMaximum": 20}),
    obj(a={"type": "integer", "multipleOf": 1, "minimum": 3}),
    {"$defs": DEFS, **obj(a={"$ref": "#/$defs/i", "type": "number", "description": "x", "x-extra": {"minimum": 1}})},
    obj(a={"type": "string", "const": "x", "title": "t"}),
    {**obj(**{"not": INT, "if": STR, "contains": {"const": {"not": 1, "if": [2]}}}), "x-meta": {"not": {}, "if": {}}},
    # minProperties within the required properties and one more name: one extra name is apart from them
    {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": INT, "minProperties": 2},
    {"type": "object", "additionalProperties": INT, "minProperties": 1},
    {"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "minProperties": 3, "additionalProperties": False},
])  # fmt: skip
def test_what_the_decoder_reads_passes_as_it_is(byte_compiler, schema):
    """Disjoint oneOf branches (types, values), integer multipleOf (no bound or both), a type
    beside $ref or const that says nothing more, keywords' names as property names, in data or
    in an annotation's value (not read): unchanged, and every output validates."""
    source = check_schema(json.dumps(schema))
    assert source == json.dumps(schema)
    assert invalid(byte_compiler, source, schema, 60, source) == []


PATTERNS_REFUSED = [
    ("^\\t$", "'\\t'"), ("^\t$", "'\\t'"), ("^a\\nb$", "'\\n'"), ("^\\x1f$", "'\\x1f'"), ("^\\u000A$", "'\\n'"),
    ("^\\cJ$", "'\\n'"), ("^a\\0$", "'\\x00'"), ("^[\\x01-\\x1f]+$", "[\\x01-\\x1f]"), ("^[\\t\\n]$", "[\\t\\n]"),
    ("^[\\b]$", "[\\b]"), ("^[\\t-\\r]$", "[\\t-\\r]"),
    ('^["]$', '["]'), ("^[\\\\]$", "[\\\\]"), ('^["\\n]$', '["\\n]'),  # a quote or backslash alone: written raw
]  # fmt: skip


@pytest.mark.parametrize("pattern, part", PATTERNS_REFUSED)
def test_a_pattern_that_can_only_write_a_control_character_is_refused(byte_compiler, pattern, part):
    """The decoder masks raw control bytes inside JSON, and the library matches a pattern
    against the raw JSON text: a pattern's control character, outside a class or in a class of
    nothing else, is never written (the walk dead-ends: an HTTP 500 mid-generation); a class of
    only a quote or a backslash writes it raw. Refused, naming where and what."""
    schema = obj(v={"type": "string", "pattern": pattern})
    with pytest.raises(ValueError) as e:
        check_schema(json.dumps(schema))
    assert "at #/properties/v: the pattern writes a" in str(e.value) and f"({part}:" in str(e.value), str(e.value)
    bad = invalid(byte_compiler, json.dumps(schema), schema, 5, pattern)
    assert len(bad) == 5 and all(b[0] in ("DEADEND", "BADJSON") for b in bad)


@pytest.mark.parametrize("pattern", [
    "^[\\s\\S]{3}$", "^[^\\n]{2,4}$", "^[\\t ]{2}$", "^\\s+$", "^.{2}$", "^[\\x00-a]$", "^[\\n-]$",
    "^a\\.\\d\\w$", "^[^\\x20-\\x7e]$",
])  # fmt: skip
def test_a_pattern_whose_classes_have_other_members_passes(byte_compiler, pattern):
    schema = obj(v={"type": "string", "pattern": pattern})
    source = check_schema(json.dumps(schema))
    assert invalid(byte_compiler, source, schema, 30, pattern) == []


# --- pydantic's schemas --------------------------------------------------------------------------
class Inner(BaseModel):
    x: int
    y: str | None = None


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: Annotated[int, Field(ge=0, le=9)]


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: bool


class Lizard(BaseModel):
    pet_type: Literal["lizard", "gecko"]
    scales: int = 3


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["a", "b"] = Field(description="which")
    size: Annotated[int, Field(ge=2, le=100, multiple_of=2)]
    ratio: Annotated[float, Field(gt=0, lt=1.5)]
    name: Annotated[str, Field(min_length=2, max_length=5)]


class Every(BaseModel):
    a: int
    b: int | None = None
    c: Inner
    d: Inner | None = None
    e: Inner = Field(description="an inner one")
    f: Cat | Dog | Lizard = Field(discriminator="pet_type")
    g: Annotated[Cat | Dog, Field(discriminator="pet_type")] | None = None
    h: list[int]
    i: dict[str, int]
    j: int | str
    k: tuple[int, str]
    m: list[Cat | Dog] = Field(default_factory=list)
    n: Literal[1]
    o: list[Inner] | None = None


@pytest.mark.parametrize("model", [Inner, Cat, Lizard, Shape, Every])
def test_pydantic_schemas_pass_unchanged_and_validate(byte_compiler, model):
    """Optional fields (anyOf with null, default, title), nested models ($ref, with a
    description beside), Literal (const / enum with type), discriminated unions (oneOf of $refs
    with a discriminator: exclusive by the const of a required property), lists, dicts, tuples,
    bounded integers with multipleOf: nothing to refuse or rewrite, and every output validates."""
    schema = model.model_json_schema()
    source = check_schema(json.dumps(schema))
    assert source == json.dumps(schema)
    assert invalid(byte_compiler, source, schema, 40, model.__name__) == []


def test_pydantic_multiple_of_beside_one_bound_is_refused():
    """conint(ge=1, multiple_of=2): the library drops a multipleOf beside one bound (it writes 3)."""

    class Even(BaseModel):
        n: Annotated[int, Field(ge=1, multiple_of=2)]

    with pytest.raises(ValueError, match="at #/properties/n: multipleOf beside one bound"):
        check_schema(json.dumps(Even.model_json_schema()))
