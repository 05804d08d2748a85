"""minLength / maxLength beside a JSON-schema string `format` (server/engine/formats.py
format_pattern, docs/agents.md "String formats") or a `pattern` (server/engine/pattern_lengths.py):
xgrammar drops lengths beside a format it knows and beside a pattern, so lengths every string of
the format or pattern has are dropped here, a uri / iri gets a pattern bounded by its maxLength
(pydantic's HttpUrl: minLength 1, maxLength 2083), a pattern with one repetition of a piece of
fixed width gets that repetition bounded, and the rest is a 400 that says what is not enforced.
Unit level (the patterns, random walks of the compiled grammars against the reference
validators, every short string against the bounded pattern) and through the OpenAI SDK's
structured outputs against a real server."""

from __future__ import annotations

import json
import random
import re

import pytest
from test_formats import BYTES, valid, walks
from util_server import sdk, server_fixture

from server.engine.formats import EXACT_FORMATS, FORMAT_WIDTHS
from server.engine.grammar import GrammarCompiler, check_schema
from server.engine.types import GrammarSpec
from server.tokenizer import get_tokenizer

try:
    from re import _parser as re_parser  # Python 3.11+
except ImportError:  # pragma: no cover - 3.10
    import sre_parse as re_parser  # type: ignore[no-redef]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(get_tokenizer().token_table)


@pytest.fixture(scope="module")
def byte_compiler():
    """A vocabulary of the 256 bytes (token 256: the end), as test_formats walks them."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(BYTES)] + [b""], xgr.VocabType.RAW,
                             vocab_size=BYTES + 1, stop_token_ids=[BYTES])  # fmt: skip
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def widths(pattern: str) -> tuple[int, int | None]:
    lo, hi = re_parser.parse(pattern).getwidth()
    return lo, (hi if hi < re_parser.MAXREPEAT else None)


def string(fmt: str, **bounds) -> str:
    """The schema text of a `fmt` string with lengths, as the engine compiles it."""
    return check_schema(json.dumps({"type": "string", "format": fmt, **bounds}))


def test_format_widths_are_those_of_the_patterns():
    assert {f: widths(p) for f, p in EXACT_FORMATS.items()} == {f: FORMAT_WIDTHS[f] for f in EXACT_FORMATS}


@pytest.mark.parametrize("fmt, bounds", [
    ("uri", {"minLength": 1}), ("email", {"maxLength": 254}), ("hostname", {"minLength": 1, "maxLength": 253}),
    ("date", {"minLength": 10, "maxLength": 10}), ("ipv4", {"maxLength": 15}), ("uuid", {"minLength": 36}),
    ("json-pointer", {"minLength": 0}),
])  # fmt: skip
def test_lengths_every_string_of_a_format_has_are_taken_as_they_are(fmt, bounds):
    """pydantic's AnyUrl (minLength 1), EmailStr with max_length=254, ...: the lengths hold for
    every string the format's grammar writes, so the grammar is the format's own."""
    out = json.loads(string(fmt, **bounds))
    assert "minLength" not in out and "maxLength" not in out
    assert out == ({"type": "string", "pattern": EXACT_FORMATS[fmt]} if fmt in EXACT_FORMATS else
                   {"type": "string", "format": fmt})  # fmt: skip


URL_LENGTHS = [2, 3, 15, 16, 40, 100, 150, 255, 600, 1024, 2083, 100000]


@pytest.mark.parametrize("n", URL_LENGTHS)
def test_a_length_bounded_uri_writes_valid_uris_within_the_bound(byte_compiler, n):
    """A uri with maxLength n (pydantic's HttpUrl: minLength 1, maxLength 2083) compiles as a
    pattern none of whose strings is longer than n (Python's `re` reads its widths): 40 random
    walks and one that never ends before the grammar makes it (the longest it finds) write valid
    uris of at most n characters that match the pattern."""
    import xgrammar as xgr

    source = string("uri", minLength=1, maxLength=n)
    pattern = json.loads(source)["pattern"]
    assert widths(pattern)[0] == 2 and widths(pattern)[1] <= n
    grammar = byte_compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    texts = list(walks(grammar, 40, random.Random(n)))
    m, out, rng, mask = xgr.GrammarMatcher(grammar), b"", random.Random(-n), xgr.allocate_token_bitmask(1, BYTES + 1)
    while True:  # the longest walk: end only where nothing else is allowed
        m.fill_next_token_bitmask(mask)
        words = mask[0].tolist()
        allowed = [t for t in range(BYTES) if words[t // 32] >> (t % 32) & 1]
        if not allowed:
            break
        token = rng.choice([t for t in allowed if t != ord('"')] or allowed)
        assert m.accept_token(token)
        out += bytes([token])
    texts.append(json.loads(out))
    assert max(len(t) for t in texts) <= n and (n < 255 or max(len(t) for t in texts) > 100)
    assert [t for t in texts if not valid("uri", t) or not re.fullmatch(pattern, t)] == []


@pytest.mark.parametrize("n, fits", [(2083, ["https://example.com/a/b?q=1&r=%20#f", "mailto:a@b.co", "file:///tmp/x",
                                             "http://[::1]:8080/", "h2c://x", "http://ex.com/a?b?c#d?e/f", "a:"]),
                                     (40, ["https://ex.com/a/b?q=1", "mailto:a@b.co", "a:"])])  # fmt: skip
def test_a_length_bounded_uri_takes_common_uris_and_nothing_longer(compiler, n, fits):
    import xgrammar as xgr

    grammar = compiler.compile(GrammarSpec.json_schema({"type": "string", "format": "uri", "maxLength": n})).grammar

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar)
        return m.accept_string(json.dumps(text)) and m.accept_token(0)

    assert [t for t in fits if not accepts(t)] == []
    assert not accepts("https://example.com/" + "a" * (n - 19)) and not accepts("http://x/ y")


@pytest.mark.parametrize("fmt, bounds, says", [
    ("hostname", {"maxLength": 20}, 'maxLength 20 beside format "hostname" is not enforced: its strings run up to '
                                    '253 characters, and only "uri" and "iri" have a pattern bounded'),
    ("uri", {"minLength": 3}, 'minLength 3 beside format "uri" is not enforced: its shortest strings are 2'),
    ("uri", {"maxLength": 1}, 'maxLength 1 beside format "uri": no such string is shorter than 2 characters'),
    ("uri-reference", {"maxLength": 50}, 'maxLength 50 beside format "uri-reference" is not enforced: its strings '
                                         'run any length'),
    ("email", {"maxLength": 64}, 'maxLength 64 beside format "email" is not enforced: its strings run up to 243'),
    ("uri", {"maxLength": 2.5}, 'minLength / maxLength beside format "uri" must be counts'),
])  # fmt: skip
def test_lengths_a_format_cannot_carry_are_refused_saying_what(fmt, bounds, says):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt, **bounds}}}
    with pytest.raises(ValueError, match=f"at #/properties/v: {re.escape(says)}"):
        check_schema(json.dumps(schema))


# --- beside a pattern (server/engine/pattern_lengths.py) -------------------------------------
def bounded(pattern: str, **bounds) -> dict:
    """The string schema of `pattern` with lengths, as the engine compiles it."""
    return json.loads(check_schema(json.dumps({"type": "string", "pattern": pattern, **bounds})))


@pytest.mark.parametrize("pattern, bounds, out", [
    ("^[a-z]+$", {"maxLength": 20}, "^[a-z]{1,20}$"),  # pydantic's constr(pattern=..., max_length=20)
    ("^[a-z0-9-]*$", {"minLength": 3, "maxLength": 64}, "^[a-z0-9-]{3,64}$"),
    ("^[A-Z]{2}-[0-9]+$", {"maxLength": 8}, "^[A-Z]{2}-[0-9]{1,5}$"),
    ("^\\d{3}(-\\d{4})*$", {"minLength": 4, "maxLength": 13}, "^\\d{3}(-\\d{4}){1,2}$"),
    ("[a-z]+\\.txt", {"minLength": 6}, "[a-z]{2,}\\.txt"),  # unanchored: the library matches it whole
    ("^[0-9]{5}$", {"minLength": 5, "maxLength": 5}, "^[0-9]{5}$"),  # lengths its strings all have: as it is
    ("^(a|bc)$", {"maxLength": 2}, "^(a|bc)$"),
    ("^x(?:ab|cd){0,200}$", {"maxLength": 11}, "^x(?:ab|cd){0,5}$"),
])  # fmt: skip
def test_lengths_beside_a_pattern_bound_its_one_repetition(pattern, bounds, out):
    """A pattern with one part of variable length, a repetition of a piece of fixed width, gets
    that repetition's count from the lengths (the lengths go); lengths every string of the
    pattern has are dropped. Both were a 400."""
    assert bounded(pattern, **bounds) == {"type": "string", "pattern": out}


@pytest.mark.parametrize("pattern, least, most, alphabet, longest", [
    ("^[ab]+$", 2, 4, "ab", 6), ("[ab]*c", 0, 3, "abc", 5), ("^(ab)*c$", 2, 6, "abc", 7),
    ("^x(ab){0,3}$", 3, 5, "xab", 7),
    ("^.+$", 0, 3, "aé😀", 5), ("^\\d{2}-\\d+$", 5, 6, "1-", 8), ("^(?:ab|cd)+$", 1, 4, "abcd", 5),
    ("^[ab]*$", 3, None, "ab", 6), ("^(a|b)c+$", 0, 4, "abc", 6),
])  # fmt: skip
def test_a_bounded_pattern_takes_exactly_the_patterns_strings_of_those_lengths(byte_compiler, pattern, least, most,
                                                                            alphabet, longest):  # fmt: skip
    """Every string over a small alphabet up to `longest` characters (non-ASCII ones too: a
    pattern's `.` is one character): the grammar compiled from the pattern with its lengths
    takes exactly those the pattern's own grammar takes that have such a length."""
    import itertools

    import xgrammar as xgr

    def grammar(schema: dict):
        return byte_compiler.compile_json_schema(check_schema(json.dumps(schema)), any_whitespace=False)

    lengths = {"minLength": least, **({"maxLength": most} if most is not None else {})}
    both = grammar({"type": "string", "pattern": pattern, **lengths}), grammar({"type": "string", "pattern": pattern})

    def takes(g, text: str) -> bool:
        m = xgr.GrammarMatcher(g)
        return m.accept_string(json.dumps(text, ensure_ascii=False)) and m.accept_token(BYTES)

    texts = ["".join(t) for n in range(longest + 1) for t in itertools.product(alphabet, repeat=n)]
    wrong = [t for t in texts if takes(both[0], t) != (takes(both[1], t) and least <= len(t) <= (most or len(t)))]
    assert wrong == [] and any(takes(both[0], t) for t in texts)


@pytest.mark.parametrize("pattern, bounds, says", [
    ("^[a-z]+-[a-z]+$", {"maxLength": 9}, "it has 2 parts of variable length"),
    ("^(ab|c)+$", {"maxLength": 9}, "it has a repetition of a piece of variable width"),
    ("^a+|b$", {"maxLength": 9}, "it has alternatives (`|`) at the top"),
    ("^(?=a)[a-z]+$", {"maxLength": 9}, "it has `(?=` (a lookaround or a named group)"),
    ("^(a)\\1+$", {"maxLength": 9}, "it has the escape `\\1`"),
    ("^x(ab+)?$", {"maxLength": 9}, "it has a `?` after a group that ends in a repetition"),
    ("^a{,5}$", {"maxLength": 9}, "it has a `{` that is no quantifier"),
    ("^[0-9]{5}$", {"maxLength": 4}, "no string of the pattern has 0 to 4 characters: its strings have 5 to 5"),
    ("^(ab)+$", {"minLength": 3, "maxLength": 3},
     "no string of the pattern has 3 to 3 characters: its strings have 0 + 2k"),
    ("^[a-z]+$", {"maxLength": 5000}, "they make its `[a-z]+` `{1,5000}`, which compiles slowly"),
    ("^(?:..)*$", {"maxLength": 200}, "they make its `(?:..)*` `{0,100}`, which compiles slowly"),
    ("^[a-z]+$", {"maxLength": 2.5}, "minLength / maxLength beside a pattern must be counts"),
])  # fmt: skip
def test_lengths_a_pattern_cannot_carry_are_refused_saying_what(pattern, bounds, says):
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern, **bounds}}}
    with pytest.raises(ValueError, match=f"at #/properties/v: .*{re.escape(says)}"):
        check_schema(json.dumps(schema))


def test_lengths_beside_a_pattern_and_a_format_are_refused():
    """The library keeps one of a pattern and a format it knows, and drops the lengths."""
    with pytest.raises(ValueError, match='beside a pattern and format "email" are not enforced'):
        check_schema(json.dumps({"type": "string", "pattern": "^a+@b$", "format": "email", "maxLength": 9}))
    assert bounded("^[a-z]+$", format="password", maxLength=9)["pattern"] == "^[a-z]{1,9}$"  # an annotation


# --- through the OpenAI SDK against a real server ---------------------------------------------
server = server_fixture()
USER = [{"role": "user", "content": "A link?"}]


def test_an_sdk_structured_output_with_an_httpurl_field_is_written_within_its_bounds(server):
    """client.chat.completions.parse(response_format=Link) with a pydantic HttpUrl field (its
    schema: format uri, minLength 1, maxLength 2083) was a 400. Now the random model writes until
    the grammar ends the document: a valid uri of at most 2083 characters and a title of at most
    40. (The raw response: pydantic's HttpUrl also wants an http(s) scheme, which the schema does
    not say, and the random model writes any scheme.)"""
    from pydantic import BaseModel, Field, HttpUrl

    class Link(BaseModel):
        url: HttpUrl
        title: str = Field(max_length=40)

    for seed in (1, 2):
        raw = sdk(server).chat.completions.with_raw_response.parse(
            model="m", messages=USER, response_format=Link, max_tokens=3000, extra_body={"seed": seed}
        )
        choice = raw.http_response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        out = json.loads(choice["message"]["content"])
        assert set(out) == {"url", "title"} and len(out["title"]) <= 40
        assert 2 <= len(out["url"]) <= 2083 and valid("uri", out["url"]), out["url"]


def test_an_sdk_structured_output_with_a_pattern_and_lengths_is_written_within_them(server):
    """pydantic's Field(pattern=..., max_length=...) (the schema: pattern, minLength, maxLength)
    was a 400. Now the random model's output parses into the model: each field matches its
    pattern and has its lengths."""
    from pydantic import BaseModel, Field

    class Code(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{2}-[0-9]+$", max_length=8)
        slug: str = Field(pattern=r"^[a-z0-9-]+$", min_length=3, max_length=12)

    for seed in (1, 2):
        out = sdk(server).chat.completions.parse(
            model="m", messages=USER, response_format=Code, max_tokens=200, extra_body={"seed": seed}
        )
        code = out.choices[0].message.parsed
        assert code is not None and re.fullmatch(r"[A-Z]{2}-[0-9]{1,5}", code.code), code
        assert re.fullmatch("[a-z0-9-]{3,12}", code.slug), code


def test_an_sdk_schema_whose_lengths_a_format_cannot_carry_is_a_400_saying_what(server):
    import openai
    from pydantic import BaseModel, Field

    class Server(BaseModel):
        host: str = Field(max_length=20, json_schema_extra={"format": "hostname"})

    with pytest.raises(openai.BadRequestError) as err:
        sdk(server).chat.completions.parse(model="m", messages=USER, response_format=Server, max_tokens=10)
    assert err.value.code == "invalid_schema" and err.value.param == "response_format"
    assert 'maxLength 20 beside format "hostname" is not enforced: its strings run up to 253' in err.value.message
