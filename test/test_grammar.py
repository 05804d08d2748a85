"""Constrained decoding (server.engine.grammar + the engine) on the tiny random-weight model,
where only the constraint can make the output valid: JSON schemas, JSON objects, regexes,
triggers, grammar ends and failures, bad grammars, and that unconstrained rows of the same
batch are unaffected."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from server.config import Settings
from server.engine import Engine, SamplingParams
from server.engine.grammar import LIBRARY_CACHE_BYTES, GrammarCompiler, TriggerGuard, check_schema, pack_bits
from server.engine.sampler import apply_token_bitmask
from server.engine.types import GrammarSpec
from server.model import load_model
from server.tokenizer import get_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    e = Engine(load_model("synthetic:tiny"), tok, Settings(max_batch=16, step_token_budget=64, prefill_chunk=16,
                                                           stats_interval=0.0)).start()  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.token_table)


# --- compiling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("yaml", "a: 1"), "invalid grammar kind"),
    (GrammarSpec("regex", ""), "needs a source"),
    (GrammarSpec("json_schema", "{not json"), "not JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "a schema is a JSON object"),
    (GrammarSpec("json_schema", '{"type": "strin"}'), "strin"),
    (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
    (GrammarSpec("regex", "[a-"), "Unclosed"),
    (GrammarSpec("ebnf", "root ::= foo"), "foo"),
    (GrammarSpec("regex", "a", trigger="x" * 65), "trigger"),
    (GrammarSpec("any_of", "[]"), "1 to 8 alternatives"),
    (GrammarSpec("any_of", '{"kind": "regex"}'), "1 to 8 alternatives"),
    (GrammarSpec("any_of", '[{"kind": "regex", "source": "a", "prefix": 1}]'), "an any_of alternative is"),
    (GrammarSpec("any_of", '[{"kind": "regex", "source": "a", "trigger": "x"}]'), "an any_of alternative is"),
    (GrammarSpec("any_of", '[{"kind": "any_of", "source": "[]"}]'), "cannot be an any_of"),
    (GrammarSpec("any_of", '[{"kind": "regex", "source": "a"}, {"kind": "regex", "source": "[a-"}]'), "Unclosed"),
    (GrammarSpec("any_of", '[{"kind": "json_schema", "source": "{not json"}]'), "not JSON"),
])  # fmt: skip
def test_bad_grammars_raise_a_clear_value_error(compiler, spec, words):
    with pytest.raises(ValueError, match=words) as ei:
        compiler.compile(spec)
    assert "/project/cpp" not in str(ei.value) and "Check failed" not in str(ei.value)


CALLS = {"type": "array", "minItems": 1, "maxItems": 2, "items": {
    "type": "object", "properties": {"name": {"const": "f"}, "arguments": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}}  # fmt: skip
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
EITHER = GrammarSpec.any_of([("<tool_call>", GrammarSpec.json_schema(CALLS)), ("", GrammarSpec.json_schema(ANSWER))])


@pytest.mark.parametrize("text, ok", [
    ('<tool_call>[{"name": "f", "arguments": {}}]', True),
    ('{"answer": 3}', True),
    ('<tool_call>{"answer": 3}', False),  # a prefix belongs to its own alternative
    ('[{"name": "f", "arguments": {}}]', False),  # ... and that alternative needs it
    ('{"answer": "3"}', False),
    ("hello", False),
])  # fmt: skip
def test_any_of_takes_each_alternative_with_its_prefix_and_nothing_else(compiler, text, ok):
    import xgrammar as xgr

    compiled = compiler.compile(EITHER)
    matcher = xgr.GrammarMatcher(compiled.grammar)
    assert (matcher.accept_string(text) and matcher.accept_token(0)) is ok  # then EOS: the language ends there
    assert compiled.ban is not None  # JSON behind a plain prefix: control bytes stay banned
    assert compiler.compile(GrammarSpec.any_of([("", GrammarSpec("regex", "a+"))])).ban is None


def test_recursive_schemas_are_refused_others_pass():
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}
    with pytest.raises(ValueError, match="recursive"):
        check_schema(json.dumps({"$defs": {"node": node}, "$ref": "#/$defs/node"}))
    with pytest.raises(ValueError, match="recursive"):
        check_schema(json.dumps({"type": "object", "properties": {"self": {"$ref": "#"}}}))
    shared = {"$defs": {"pt": {"type": "integer"}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}}  # fmt: skip
    check_schema(json.dumps(shared))  # the same definition twice is not recursion
    # a pointer through an array's index (QA: the check stepped through objects only, so these passed)
    loop = {"type": "object", "properties": {"n": {"$ref": "#/properties/v/anyOf/0"}}}
    with pytest.raises(ValueError, match="recursive"):
        check_schema(json.dumps({"type": "object", "properties": {"v": {"anyOf": [loop, {"type": "null"}]}}}))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/items/anyOf/0"}}}}
    with pytest.raises(ValueError, match="recursive"):  # where the tools' grammar puts each tool's schema
        check_schema(json.dumps({"type": "array", "items": {"anyOf": [tree, {"type": "null"}]}}))
    ok = {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#/prefixItems/0"}], "items": False}
    check_schema(json.dumps(ok))  # a pointer into an array that is no cycle


@pytest.mark.parametrize("schema, at", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "at #: uniqueItems"),  # pydantic's set[int]
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+-[a-z]+$", "maxLength": 9}}},
     "at #/properties/code: minLength / maxLength beside this pattern are not enforced: it has 2 parts of variable "
     "length"),  # pydantic's constr(pattern=..., max_length=9); "^[a-z]+$" is taken: test_format_lengths
    ({"$defs": {"Id": {"type": "string", "format": "uuid", "minLength": 40}}, "$ref": "#/$defs/Id"},
     'at #/\\$defs/Id: minLength 40 beside format "uuid" is not enforced'),  # (36 would be every uuid: taken)
])
def test_keywords_the_decoder_would_ignore_are_refused(schema, at):
    """xgrammar ignores uniqueItems, and lengths beside a pattern or format (it logs a warning
    and drops them): an output could then fail the schema, so the schema is refused, naming where
    (but for lengths a pattern's or a format's strings all have, or that a pattern can carry:
    test_format_lengths)."""
    with pytest.raises(ValueError, match=at):
        check_schema(json.dumps(schema))


@pytest.mark.parametrize("pattern, raw", [
    ('^a"b$', '"'), ("^a\\\\b$", "\\"), ("^\\x22$", '"'), ("^x\\u005C$", "\\"), ('^\\"$', '"'),
    ("^[^,]*$", None), ('^[a"]+$', None), ("^[\\\\x]$", None), ("^\\d+\\.\\d+$", None), ("^\\x41$", None),
    ("^[]\"]$", '"'),  # ECMA-262: "[]" is an empty class, the quote after it is outside
])  # fmt: skip
def test_a_pattern_that_writes_a_quote_or_backslash_is_refused(compiler, pattern, raw):
    """xgrammar matches a `pattern` against the string's JSON text: a quote or backslash the
    pattern writes itself goes out unescaped (`^a"b$` wrote `"a"b"`, invalid JSON; `^a\\\\b$` wrote
    `"a\\b"`, a backspace), so such a schema is refused, naming where. Inside a class both are left
    out by the library (checked: no raw quote written), so those patterns pass."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"]}
    if raw is not None:
        with pytest.raises(ValueError, match="at #/properties/v: the pattern writes"):
            check_schema(json.dumps(schema))
        return
    check_schema(json.dumps(schema))
    grammar = compiler.compile(GrammarSpec.json_schema(schema)).grammar
    for text in ('{"v": "a"}', '{"v": "a""}', '{"v": "\\"}', '{"v": "\\\\"}', '{"v": "x\\"}'):
        m = xgr.GrammarMatcher(grammar)
        if m.accept_string(text) and m.accept_token(0):
            json.loads(text)  # whatever it takes is JSON


@pytest.mark.parametrize("text, ok", [
    ("1.2.3.4", True), ("255.255.255.255", True), ("0.0.0.0", True),
    ("132.96.008.216", False), ("01.2.3.4", False), ("256.1.1.1", False),  # the library's format let the first two by
])  # fmt: skip
def test_an_ipv4_format_takes_only_addresses_that_validate(compiler, text, ok):
    """format ipv4 compiles as an exact pattern (xgrammar's allows leading zeros, which pydantic's
    IPv4Address, Python's ipaddress and jsonschema refuse), alone and as an any_of alternative."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]}
    either = GrammarSpec.any_of([("<x>", GrammarSpec.json_schema(ANSWER)), ("", GrammarSpec.json_schema(schema))])
    for spec in (GrammarSpec.json_schema(schema), either):
        matcher = xgr.GrammarMatcher(compiler.compile(spec).grammar)
        assert (matcher.accept_string('{"ip": "%s"}' % text) and matcher.accept_token(0)) is ok, spec.kind


def test_date_formats_take_only_dates_that_exist(compiler):
    """format date / date-time compile as exact patterns (xgrammar's took any day up to 31 in every
    month, "2024-02-30", which pydantic's date refuses): for a spread of days of every month of
    common, leap and century years, the grammar accepts exactly what Python's date accepts."""
    import datetime

    import xgrammar as xgr

    def accepts(fmt: str, text: str) -> bool:
        spec = GrammarSpec.json_schema({"type": "string", "format": fmt})
        matcher = xgr.GrammarMatcher(compiler.compile(spec).grammar)
        return matcher.accept_string(json.dumps(text)) and matcher.accept_token(0)

    def exists(text: str) -> bool:
        try:
            datetime.date.fromisoformat(text)
            return True
        except ValueError:
            return False

    for year in ("2023", "2024", "1900", "2000", "0004"):
        for month in range(1, 13):
            for day in (1, 28, 29, 30, 31):
                d = f"{year}-{month:02d}-{day:02d}"
                assert accepts("date", d) is exists(d), d
    assert accepts("date", "0000-01-01") is False and accepts("date", "2024-13-01") is False
    assert accepts("date-time", "2024-02-29T23:59:59.5+05:30") and not accepts("date-time", "2023-02-29T10:00:00Z")
    assert accepts("date-time", "2024-04-30T00:00:00Z") and not accepts("date-time", "2024-04-31T00:00:00Z")


def test_the_same_words_as_names_or_data_are_no_keywords():
    named = {"type": "object", "properties": {"format": {"type": "string"}, "maxLength": {"type": "integer"},
                                               "uniqueItems": {"type": "boolean"}}}
    check_schema(json.dumps(named))  # properties called so
    check_schema(json.dumps({"const": {"uniqueItems": True, "pattern": "x", "maxLength": 1}}))  # a value
    check_schema(json.dumps({"type": "string", "pattern": "^[a-z]{1,3}$"}))  # the length in the pattern
    check_schema(json.dumps({"type": "string", "maxLength": 3}))


def test_long_and_fanning_ref_chains_are_checked_in_linear_time():
    # a chain of 5,000 $defs (past Python's recursion limit), and 60 defs each referring to the
    # next twice (2^60 paths: a walk of every path never ends); one ref back to the start recurses
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)} | {"d5000": {"type": "integer"}}
    check_schema(json.dumps({"$defs": chain, "$ref": "#/$defs/d0"}))
    fan = {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(60)}
    fan["d60"] = {"type": "integer"}
    check_schema(json.dumps({"$defs": fan, "$ref": "#/$defs/d0"}))
    fan["d60"] = {"$ref": "#/$defs/d0"}
    with pytest.raises(ValueError, match="recursive"):
        check_schema(json.dumps({"$defs": fan, "$ref": "#/$defs/d0"}))


def test_compiled_grammars_are_cached_by_spec_and_bounded(tok):
    comp = GrammarCompiler(tok.token_table, cache_size=2)
    a = comp.compile(GrammarSpec("regex", "[0-9]+"))
    assert comp.compile(GrammarSpec("regex", "[0-9]+")) is a
    comp.compile(GrammarSpec("regex", "x"))
    comp.compile(GrammarSpec("regex", "y"))
    assert comp.compile(GrammarSpec("regex", "[0-9]+")) is not a  # evicted (LRU of 2)


def test_the_library_keeps_each_rules_token_masks_for_later_grammars(tok):
    """xgrammar's own cache is on and bounded: a format's pattern is one rule (or a few shared
    ones), whose token masks (about 0.3 s of CPU for hostname, 0.3 s for email) later grammars
    with the same rule reuse instead of building them again (figures: docs/agents.md "String
    formats"; no timing here)."""
    comp = GrammarCompiler(tok.token_table)
    comp.compile(GrammarSpec.json_schema({"type": "string", "format": "ipv4"}))
    library = comp._xgr_compiler()
    assert library.cache_limit_bytes == LIBRARY_CACHE_BYTES
    assert 0 < library.get_cache_size_bytes() <= LIBRARY_CACHE_BYTES


def test_submit_refuses_a_bad_grammar_and_changes_nothing(engine):
    before = engine.stats()
    with pytest.raises(ValueError, match="recursive"):
        engine.submit("x", SamplingParams(grammar=GrammarSpec("json_schema", '{"properties": {"a": {"$ref": "#"}}}')))
    assert engine.stats().waiting == before.waiting and engine.stats().running == before.running


# --- the mask pieces ---------------------------------------------------------------------------
def test_apply_token_bitmask_matches_a_dense_reference():
    g = torch.Generator().manual_seed(0)
    V, B = 100, 5
    logits = torch.randn(B, V, generator=g)
    allowed = torch.rand(3, V, generator=g) < 0.3
    bitmask = torch.stack([pack_bits(a) for a in allowed])  # (3, 4)
    rows = torch.tensor([4, 0, 2])
    out = logits.clone()
    apply_token_bitmask(out, bitmask, rows)
    ref = logits.clone()
    for j, r in enumerate(rows.tolist()):
        ref[r][~allowed[j]] = float("-inf")
    assert torch.equal(out, ref)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows not listed are untouched


def test_trigger_guard_forbids_exactly_the_tokens_that_run_past_the_trigger():
    table = [b"", b"a", b"<", b"c", b">", b"<c", b"<c>", b"c>x", b">x", b"x<c>", b"b"]
    g = TriggerGuard(b"<c>", table)
    assert g._forbid.get(0) is None  # "x<c>" ends with the trigger: allowed
    assert g._forbid.get(1) == [7]  # "<" matched: "c>x" would complete it and go on
    assert g._forbid.get(2) == [8]  # "<c" matched: ">x"
    assert g.step(0, b"a") == (0, None)
    assert g.step(0, b"<") == (1, None)
    assert g.step(1, b"c") == (2, None)
    assert g.step(2, b">") == (0, b"")  # completed on the token's end
    assert g.step(0, b"x<c>") == (0, b"")
    assert g.step(1, b"<") == (1, None)  # "<<": the last "<" may still start it
    assert g.step(2, b">x") == (0, b"x")  # (a forbidden token: its tail goes to the grammar)
    row = g.mask_row(2)
    allowed = [(int(row[t >> 5]) >> (t & 31)) & 1 for t in range(len(table))]
    assert [t for t, a in enumerate(allowed) if not a] == [8]
    assert g.mask_row(0) is None  # nothing forbidden: no mask at all


# --- the engine --------------------------------------------------------------------------------
def test_fifty_schema_constrained_generations_all_validate(engine):
    spec = GrammarSpec.json_schema(SCHEMA)
    handles = [engine.submit("Profile:", SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=spec))
               for s in range(50)]  # fmt: skip
    results = [h.result(300) for h in handles]
    texts = set()
    for r in results:
        assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
        texts.add(r.text)
    assert len(texts) > 10  # different seeds, different documents: the model samples, the mask only prunes


def test_any_of_generations_each_follow_one_alternative(engine):
    handles = [engine.submit("Answer:", SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=EITHER))
               for s in range(24)]  # fmt: skip
    for r in (h.result(300) for h in handles):
        assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
        if r.text.startswith("<tool_call>"):
            jsonschema.validate(json.loads(r.text.removeprefix("<tool_call>")), CALLS)
        else:
            jsonschema.validate(json.loads(r.text), ANSWER)


def test_json_object_output_always_parses(engine):
    handles = [engine.submit("Data:", SamplingParams(max_tokens=300, seed=s, grammar=GrammarSpec("json_object")))
               for s in range(12)]  # fmt: skip
    for h in handles:
        r = h.result(300)
        assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
        assert isinstance(json.loads(r.text), dict)


def test_eos_is_allowed_exactly_where_the_grammar_may_end(engine):
    spec = GrammarSpec("regex", "(ab){1,3}")
    texts = {engine.submit("x", SamplingParams(max_tokens=50, seed=s, grammar=spec)).result(60).text for s in range(16)}
    assert texts <= {"ab", "abab", "ababab"} and texts
    r = engine.submit("x", SamplingParams(max_tokens=50, seed=1, ignore_eos=True, grammar=GrammarSpec("regex", "ab")))
    res = r.result(60)
    assert (res.text, res.finish_reason, res.pending_tokens) == ("ab", "stop", [])  # EOS ends it, not fed


def test_max_tokens_cuts_a_constrained_output(engine):
    r = engine.submit("x", SamplingParams(max_tokens=3, seed=0, grammar=GrammarSpec.json_schema(SCHEMA))).result(60)
    assert r.finish_reason == "length" and len(r.token_ids) == 3 and r.text.startswith("{")


def test_a_constrained_row_leaves_the_unconstrained_rows_of_its_batch_unchanged(engine):
    free = [SamplingParams(max_tokens=24, seed=100 + i) for i in range(5)]
    alone = [h.result(120) for h in [engine.submit("Once upon a time", p) for p in free]]
    spec = GrammarSpec.json_schema(SCHEMA)
    mixed = [engine.submit("Once upon a time", p) for p in free[:2]]
    mixed.append(engine.submit("Profile:", SamplingParams(max_tokens=200, seed=7, grammar=spec)))
    mixed += [engine.submit("Once upon a time", p) for p in free[2:]]
    res = [h.result(120) for h in mixed]
    constrained = res.pop(2)
    jsonschema.validate(json.loads(constrained.text), SCHEMA)
    assert [r.token_ids for r in res] == [r.token_ids for r in alone]


def test_a_trigger_lets_free_text_run_until_it_appears(engine, tok):
    """Trigger "e": free text (no token with an "e" before its last byte) until a token ends
    with "e"; then three digits and EOS."""
    spec = GrammarSpec("regex", "[0-9]{3}", trigger="e")
    fired = 0
    for s in range(12):
        r = engine.submit("List:", SamplingParams(max_tokens=60, seed=s, top_p=1.0, grammar=spec)).result(120)
        head, sep, tail = r.text.partition("e")
        if r.finish_reason == "stop":
            fired += 1
            assert sep and len(tail) == 3 and tail.isdigit(), r.text
        else:
            assert r.finish_reason == "length" and not sep, r.text  # never fired: free text only
        for t in r.token_ids:  # the trigger always ends a token
            b = tok.token_bytes(t)
            assert b"e" not in b[:-1], (b, r.text)
    assert fired >= 1


def test_a_grammar_that_allows_no_token_ends_its_row_with_an_error(engine):
    class NoToken:  # the library's batch fill, allowing nothing
        def batch_fill_next_token_bitmask(self, matchers, bitmask, indices):
            bitmask[: len(matchers)] = 0

    spec = GrammarSpec("regex", "[a-z]+")
    engine.compile_grammar(spec)
    cons = engine.constraints
    saved, cons._batch = cons._batch, NoToken()
    try:
        bad = engine.submit("x", SamplingParams(max_tokens=20, seed=1, grammar=spec))
        ok = engine.submit("x", SamplingParams(max_tokens=20, seed=1))
        r = bad.result(60)
        assert r.finish_reason == "error" and "allows no token" in r.error
        assert ok.result(60).finish_reason == "length"  # the batch went on
    finally:
        cons._batch = saved
    assert engine.submit("x", SamplingParams(max_tokens=20, seed=1, grammar=spec)).result(60).finish_reason in ("stop", "length")
