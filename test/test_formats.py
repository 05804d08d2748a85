"""String formats of JSON schemas (server/engine/formats.py, docs/agents.md "String formats"):
each format xgrammar matches too loosely, or not at all, compiles as a pattern that writes only
valid strings. Checked two ways: edge cases through the engine's compiler (the strings the
library let through are refused, the valid edge cases taken), and random walks of each compiled
grammar, every string of which must pass the reference validators (Python's ipaddress / datetime
/ uuid, pydantic's timedelta, jsonschema's format checker, jsonschema_rs where installed) and
match its pattern as Python's `re` reads it (xgrammar's regex compiler has read some wrongly)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import uuid

import jsonschema
import pytest

from server.engine.grammar import GrammarCompiler, check_schema
from server.engine.types import GrammarSpec
from server.tokenizer import get_tokenizer

try:
    import jsonschema_rs
except ImportError:  # pragma: no cover - installed with schemathesis (the test extra)
    jsonschema_rs = None


def _no_scope(text: str) -> None:
    if ipaddress.IPv6Address(text).scope_id:
        raise ValueError("a zone is no part of an ipv6")


def _timedelta(text: str) -> None:
    from pydantic import TypeAdapter

    TypeAdapter(datetime.timedelta).validate_python(text)


_STDLIB = {
    "ipv4": ipaddress.IPv4Address, "ipv6": _no_scope, "uuid": uuid.UUID, "duration": _timedelta,
    "date": datetime.date.fromisoformat, "time": datetime.time.fromisoformat,
    "date-time": datetime.datetime.fromisoformat,
}  # fmt: skip


def valid(fmt: str, text: str) -> bool:
    """Whether every reference validator installed takes text as a `fmt` string."""
    if not jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(text, fmt):
        return False
    if jsonschema_rs is not None:
        rs = jsonschema_rs.validator_for({"format": fmt}, validate_formats=True)
        if not rs.is_valid(text):
            return False
    try:
        _STDLIB.get(fmt, str)(text)
    except ValueError:  # pydantic's ValidationError is one
        return False
    return True


L63, L61, L30 = "a" * 63, "b" * 61, "c" * 30
HOSTS = ["localhost", "example.com", "a1-b2.example.co.uk", "1host", "x", L63, f"{L63}.{L63}.{L63}.{L61}",
         ".".join([L30] * 8), "abc--d.com"]  # fmt: skip
NOT_HOSTS = ["a" * 64, "ab--cd", "xn--x", "-a", "a-", "a..b", "a.", ".a", "a_b", "", "a b"]
EMAILS = ["a@b.co", "first.last+tag@mail.example.org", "!#$%&'*+/=?^_`{|}~-@example.com", "x" * 32 + "@x.com",
          "a.b.c.d@x.com", f"a@{L63}.{L63}.{'t' * 24}", "a@test.com", "a@x.tests"]  # fmt: skip
NOT_EMAILS = [
    "a@localhost", "a@x.test", "a@x.local", "a@x.invalid", "a@x.arpa", "a@x.123", "a@x.com1",  # EmailStr refuses
    '"a b"@example.com', "a@" + "a" * 64 + ".com", "a@ab--cd.com",  # ... these too, and jsonschema_rs
    "a..b@x.com", ".a@x.com", "a.@x.com", "a@[1.2.3.4]", "a@-x.com", "a@b", "no at sign",
]  # fmt: skip
URIS = ["https://example.com/a/b?q=1&r=%20#f", "mailto:a@b.co", "urn:isbn:0451450523", "file:///tmp/x", "a:",
        "http://[::1]:8080/", "http://[v1.x]/", "http://[1:2:3:4:5:6:1.2.3.4]/", "h2c://x", "http://user:pw@h:80/p",
        "http://ex.com/a?b?c#d?e/f"]  # fmt: skip
NOT_URIS = ["http://x/ y", "http://ex.com/%zz", "http://[1::2::3]/", "http://[::1", "1a:b", "http://a:port",
            "http://ex.com#a#b", "http://ex.com/ü", "http://[::ffff:1.2.3.04]/",
            "http://[fe80::1%25eth0]/"]  # fmt: skip
REFS = ["//host/p", "/a/b", "a/b:c", "?q", "#f", "", "a/./b", "%41", "./a:b", "//[::1]:80"]  # no absolute URI
NOT_REFS = ["a b", "%4", "1http:x", "#a#b", "a:b c", "\\x"]

CASES = {
    "date-time": (
        ["2024-02-29T23:59:59.5+05:30", "2000-01-01T00:00:00Z", "2024-01-01T12:00:00.123456789-00:00"],
        ["2024-01-01T12:00:0055Z",  # the old exact pattern, read wrongly by xgrammar, took this
         "2024-02-30T00:00:00Z", "2024-01-01T12:30:60Z", "2024-01-01T12:00:00", "2024-01-01t12:00:00Z"],
    ),
    "time": (
        ["00:00:00Z", "23:59:59.999+14:00", "12:00:00-00:00", "08:30:06.123456789Z"],
        ["12:30:60Z", "23:59:60Z",  # xgrammar took a leap second at any minute: Python's time refuses every one
         "12:00:0055Z", "12:00:00", "24:00:00Z", "12:00:00+24:00", "12:00Z", "1:00:00Z"],
    ),
    "duration": (
        ["P1D", "PT1H30M", "P1Y2M3DT4H5M6S", "P3W", "P0D", "PT0S", "P999999D", "P1YT1S", "PT36H"],
        ["P1000000000D", "PT99999999999H",  # xgrammar took these: past what Python's timedelta holds
         "P", "PT", "P1DT", "P1.5D", "-P1D", "P1W1D", "P1H", "PT1D"],
    ),
    "ipv6": (
        ["::", "::1", "1::", "1:2:3:4:5:6:7:8", "fe80::1", "1:2:3:4:5:6:1.2.3.4", "::FFFF:192.168.0.1",
         "::ffff:1.2.3.4", "64:ff9b::1.2.3.4", "1:2:3:4:5::1.2.3.4", "::1:2:3:4:5:6:7", "1:2:3:4:5:6:7::",
         "1::2:3:4:5:1.2.3.4"],
        ["::1.2.3.04", "::ffff:01.2.3.4", "::00.0.0.0",  # xgrammar took these leading zeros
         "1::2::3", "1:2:3:4:5:6:7:8:9", "fe80::1%eth0", "12345::", ":1::", "1:::2", "::256.1.1.1", "1:2:3:4:5:6:7::8"],
    ),
    "hostname": (HOSTS, NOT_HOSTS),  # xgrammar took labels over 63 characters and "ab--cd"
    "idn-hostname": (HOSTS, NOT_HOSTS + ["A.com", "any string"]),  # xgrammar took any string
    "email": (EMAILS, NOT_EMAILS),
    "idn-email": (EMAILS, NOT_EMAILS + ["any string"]),
    "uri": (URIS, NOT_URIS + REFS),  # xgrammar refused IP-literal hosts and a digit in a scheme
    "iri": (URIS, NOT_URIS + REFS + ["any string"]),
    "uri-reference": (URIS + REFS, NOT_URIS + NOT_REFS),  # xgrammar refused every absolute URI here
    "iri-reference": (URIS + REFS, NOT_URIS + NOT_REFS),
    "uri-template": (
        ["", "http://x/{a}/y{?q,r}", "{+path}/here", "{#frag}", "{.dom*}", "{/a,b}", "{;p:3}", "{&x}",
         "{a%41.b_1:999}"],
        ["{=a}", "{!a}", "{@a}", "{|a}", "{%41}", "{a:1000}",  # xgrammar took these; jsonschema's checker refuses
         "{}", "{a", "a}", "{a.}", "{a..b}", "x%4", "{a:01}", "a b"],
    ),
    "relative-json-pointer": (
        ["0", "1/a/b~0~1", "0#", "99/x", "2/", "0/a b/"],
        ["100", "101/a",  # xgrammar took these; jsonschema's checker refuses a "0" before a digit
         "01", "-1", "0/a~2", "#", "/a", "0+1/a"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(get_tokenizer().token_table)


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_formats_take_their_valid_edge_cases_and_refuse_the_rest(compiler, fmt):
    """Through the engine's compiler, alone and as an any_of alternative: each valid edge case
    (valid to every reference validator) is written, each invalid one refused, among them the
    strings xgrammar's own format let through."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    either = GrammarSpec.any_of([("<x>", GrammarSpec("regex", "a")), ("", GrammarSpec.json_schema(schema))])
    grammars = [compiler.compile(spec).grammar for spec in (GrammarSpec.json_schema(schema), either)]

    def accepts(text: str) -> bool:
        out = set()
        for g in grammars:
            m = xgr.GrammarMatcher(g)
            out.add(m.accept_string(json.dumps({"v": text}, separators=(", ", ": "))) and m.accept_token(0))
        assert len(out) == 1, text
        return out.pop()

    good, bad = CASES[fmt]
    assert [t for t in good if not valid(fmt, t)] == []  # the table is right
    assert [t for t in good if not accepts(t)] == []
    assert [t for t in bad if accepts(t)] == []


# --- random walks of the compiled grammars ----------------------------------------------------
BYTES = 256  # the vocabulary of conftest.byte_compiler: the 256 bytes; token 256 is the end


def walks(grammar, n: int, rng: random.Random):
    """n strings of the grammar (a JSON string), each byte drawn among those it allows (printable
    ASCII when it allows one), ending where it may with a drawn probability."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, BYTES + 1)
    for _ in range(n):
        m, out, stop = xgr.GrammarMatcher(grammar), b"", rng.choice([0.02, 0.1, 0.3, 0.7])
        while True:
            m.fill_next_token_bitmask(mask)
            words = mask[0].tolist()
            allowed = [t for t in range(BYTES + 1) if words[t // 32] >> (t % 32) & 1]
            if BYTES in allowed and (len(allowed) == 1 or rng.random() < stop or len(out) > 300):
                break
            printable = [t for t in allowed if 0x20 <= t < 0x7F]
            token = rng.choice(printable or [t for t in allowed if t != BYTES])
            assert m.accept_token(token)
            out += bytes([token])
        yield json.loads(out)


FORMATS = [*sorted(CASES), "date", "ipv4", "uuid", "json-pointer"]  # the last two: xgrammar's own, exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_string_a_format_grammar_writes_is_valid(byte_compiler, fmt):
    """200 random walks of the format's compiled grammar (as the server compiles it): every
    string passes the reference validators and, where the format became a pattern, matches it as
    Python's `re` reads it (xgrammar read `(\\.[0-9]+)?` as taking "12:00:0055")."""
    source = check_schema(json.dumps({"type": "string", "format": fmt}))
    grammar = byte_compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    pattern = json.loads(source).get("pattern")
    bad = [t for t in walks(grammar, 200, random.Random(fmt)) if not valid(fmt, t)
           or (pattern and not re.fullmatch(pattern, t))]  # fmt: skip
    assert bad == []


def test_format_regex_is_refused_naming_where():
    """format "regex" is any string to xgrammar, and no pattern writes only regexes (their groups
    nest): refused, as the other keywords the decoder would ignore are."""
    schema = {"type": "object", "properties": {"re": {"type": "string", "format": "regex"}}}
    with pytest.raises(ValueError, match='at #/properties/re: format "regex" is not enforced'):
        check_schema(json.dumps(schema))
    check_schema(json.dumps({"type": "object", "properties": {"regex": {"type": "string", "format": "password"}}}))
