"""Regex constructs of a JSON-schema `pattern` that xgrammar (0.2.9) silently ignores or misreads
(a warning in its log at most) are refused before the schema is compiled
(server/engine/schema_checks.py, `_ignored`; docs/agents.md): a lookahead `(?=` `(?!` (dropped:
QA got "begj" for `^(?=.*[0-9])[a-z0-9]{1,4}$`, finish_reason "stop"), a lookbehind (the
library refuses it, now with the same message), a possessive quantifier (read as a plain one),
an escaped letter it reads as the letter itself (`\\Z`, `\\A`, `[\\p{L}]`, ...), `\\x` / `\\u`
without their hex digits, a digit escape in a class, and a `^` / `$` it ignores where that
matters. Escaped or class-held look-alikes, and the constructs the library reads as meant
(named groups, `(?:`, a leading `(?i)`, lazy quantifiers, anchors at the edges of groups at the
edges), pass. Each refusal is checked to be needed (the library, given the pattern, accepts a
string Python's `re` refuses) and each pass to be right (the library and `re` agree on every
short string). On a real server: a 400 invalid_schema on /v1/chat/completions
(response_format and tools), a 422 invalid_schema on the task routes, nothing left running."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import pytest
from util_server import server_fixture

from server.engine.schema_checks import check_schema

BYTES = 256  # the vocabulary of conftest.byte_compiler: the 256 bytes; token 256 is the end
QA = "^(?=.*[0-9])[a-z0-9]{1,4}$"  # the pattern QA found

# (pattern, the part the message names, what it says, a string the library takes that `re` does not
# take, or refuses as no regex)
REFUSED = [
    (QA, "(?=...)", "the decoder ignores a lookahead", "begj"),
    ("^(?=a)[a-z]{1,5}$", "(?=...)", "the decoder ignores a lookahead", "bcd"),
    ("^(?!a)[a-z]{1,5}$", "(?!...)", "the decoder ignores a lookahead", "abc"),
    ("^[a-z]{1,3}(?<=a)$", "(?<=...)", "has no lookbehind", None),
    ("^[a-z]{1,3}(?<!a)$", "(?<!...)", "has no lookbehind", None),
    ("^(a(?=c))b$", "(?=...)", "the decoder ignores a lookahead", "ab"),  # nested
    ("^\\\\(?=a)a$", "(?=...)", "the decoder ignores a lookahead", None),  # an escaped backslash, then (?=
    ("^[a-z]*+z$", "*+", "possessive quantifier", "az"),
    ("^a++a$", "++", "possessive quantifier", "aa"),
    ("^a{2}+$", "{2}+", "possessive quantifier", "aaaa"),
    ("^ab\\Z", "\\Z", "an escape the decoder does not read as meant", "abZ"),
    ("\\Aab$", "\\A", "an escape the decoder does not read as meant", "Aab"),
    ("^ab\\z", "\\z", "an escape the decoder does not read as meant", "abz"),
    ("^\\Qa.b\\E$", "\\Q", "an escape the decoder does not read as meant", "Qa.bE"),
    ("^\\h$", "\\h", "an escape the decoder does not read as meant", "h"),
    ("^[\\p{L}]$", "\\p", "an escape the decoder does not read as meant", "p"),
    ("^[\\1-9]$", "\\1", "an escape the decoder does not read as meant", None),  # [1-9] to it, [\x01-9] to `re`
    ("^x\\x{41}$", "\\x", "an escape the decoder does not read as meant", "x" * 42),
    ("^\\u004$", "\\u", "an escape the decoder does not read as meant", "u004"),
    ("^a$b", "'$'", "an anchor", "ab"),
    ("a^b", "'^'", "an anchor", "ab"),
    ("^(?:a|b$)c$", "'$'", "an anchor", "bc"),
    ("^(a$|b)c$", "'$'", "an anchor", "ac"),
    ("^a?^b$", "'^'", "an anchor", "ab"),
    ("^(^a)+$", "in a group repeated by +", "an anchor", "aa"),
]
# patterns the library reads as meant: no refusal (an escaped or class-held "(?=" is no lookahead)
PASSING = ["^\\(?=a\\)b$", "^[(?=a)]b$", "^\\(\\?=a\\)$", "^[(][?][=]a$", "^(?:ab)+$", "^(?P<n>a)b$", "(?i)^ab$",
           "^a+?b{1,2}?$", "(^$|^\\d{3}$)", "(^a|b)c", "^a(b|$)", "^a$|^b$", "^(a$)?$", "^^a$", "^a$$", "^[$^]+$",
           "^\\$\\^$", "^\\.\\-\\/\\+$", "^[a-z]+(?:-[a-z]+)*$", "^(\\+|-)?\\d+$", "^\\u0061\\x62$", "^[\\w-]+$",
           "^\\D\\S\\W$"]  # fmt: skip
ALPHABET = "ab1Z$^(=?"


def schema_of(pattern: str) -> str:
    return json.dumps({"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}})


def library(byte_compiler, pattern: str):
    """The pattern compiled by xgrammar as the server compiles a schema (None: it refuses it)."""
    try:
        return byte_compiler.compile_json_schema(json.dumps({"type": "string", "pattern": pattern}),
                                                 any_whitespace=False, strict_mode=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - its own refusal
        return None


def takes(grammar, text: str) -> bool:
    """Whether the compiled grammar writes `text` (a JSON string) whole, then may end."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(grammar)
    return m.accept_string(json.dumps(text)) and m.accept_token(BYTES)


@pytest.mark.parametrize("pattern, part, says, taken", REFUSED)
def test_a_construct_the_library_ignores_is_refused_naming_where(byte_compiler, pattern, part, says, taken):
    with pytest.raises(ValueError) as err:
        check_schema(schema_of(pattern))
    message = str(err.value)
    assert message.startswith("invalid json_schema grammar: at #/properties/v: the pattern has "), message
    assert part in message and says in message and "not supported" in message, message
    if taken is not None:  # the refusal is needed: the library, left to it, writes a string that fails
        grammar = library(byte_compiler, pattern)
        assert grammar is not None and takes(grammar, taken)
        try:
            assert not re.fullmatch(pattern, taken)
        except re.error:  # `re` has no such escape (\p, \z, \Q, \u004, \x{41})
            pass


@pytest.mark.parametrize("pattern", PASSING)
def test_a_construct_the_library_reads_passes_and_matches_as_re_does(byte_compiler, pattern):
    assert check_schema(schema_of(pattern)) is not None
    grammar = library(byte_compiler, pattern)
    assert grammar is not None
    texts = [""] + ["".join(t) for n in range(1, 4) for t in itertools.product(ALPHABET, repeat=n)]
    wrong = [t for t in texts if takes(grammar, t) != bool(re.fullmatch(pattern, t))]
    assert wrong == [], wrong


def test_a_lookahead_in_a_pattern_properties_key_is_refused():
    """The library matches property names against a patternProperties key, dropping its
    lookahead too ({"b": 1} passes ^(?=a)[a-z]+$ with additionalProperties false)."""
    schema = {"type": "object", "patternProperties": {"^(?=a)[a-z]+$": {"type": "integer"}},
              "additionalProperties": False}  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("at #/patternProperties/^(?=a)[a-z]+$: the pattern has a look")):
        check_schema(json.dumps(schema))
    schema["patternProperties"] = {"^a[a-z]*$": {"type": "integer"}}
    check_schema(json.dumps(schema))


def test_propertynames_and_nested_patterns_are_checked_too():
    with pytest.raises(ValueError, match="at #/propertyNames: the pattern has a lookaround"):
        check_schema(json.dumps({"type": "object", "propertyNames": {"type": "string", "pattern": QA}}))
    nested = {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^(?!x)[a-z]$"}, {"type": "null"}]}}
    with pytest.raises(ValueError, match="at #/items/anyOf/0: the pattern has a lookaround"):
        check_schema(json.dumps(nested))


def test_escapes_the_library_reads_as_control_characters_or_a_quote_are_refused():
    """\\a and \\e are a bell and an escape to the library (never written in JSON); \\u{22} a
    quote (written raw: invalid JSON)."""
    for pattern, says in (("^\\a$", "writes a control character ('\\x07'"), ("^x\\e$", "control character ('\\x1b'"),
                          ("^\\u{22}$", "writes a quote or backslash itself ('\"'")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(says)):
            check_schema(schema_of(pattern))
    check_schema(schema_of("^[\\a\\w]$"))  # a class with other members: fine


# --- a real server ---------------------------------------------------------------------------------
server = server_fixture()
PARAMS = {"type": "object", "properties": {"code": {"type": "string", "pattern": QA}}, "required": ["code"],
          "additionalProperties": False}  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"name": "code", "schema": PARAMS}}
USER = [{"role": "user", "content": "A code?"}]


def test_chat_completions_answer_a_lookahead_with_a_400_invalid_schema(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        tools = [{"type": "function", "function": {"name": "f", "parameters": PARAMS}}]
        for body, param in (({"response_format": FORMAT}, "response_format"), ({"tools": tools}, "tools")):
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 20, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_schema" and param in (err["param"] or ""), err
            assert "properties/code: the pattern has a lookaround ((?=...)" in err["message"], err
        assert c.get("/health").json()["running"] == 0


def test_the_task_routes_answer_a_lookahead_with_a_422(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = c.get("/v1/tasks/list").json()
        for route in ("/v1/tasks/create", "/v1/tasks/tmp"):
            r = c.post(route, json={"prompt": "Code:", "max_tokens": 20, "response_format": FORMAT})
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_schema" and err["param"] == "response_format", err
            assert "the pattern has a lookaround" in err["message"], err
        assert c.get("/v1/tasks/list").json() == before  # no task
        assert c.get("/health").json()["running"] == 0
