"""minLength / maxLength beside a JSON-schema string `format` (server/engine/formats.py
format_pattern, docs/agents.md "String formats"): xgrammar drops lengths beside a format it knows,
so lengths every string of the format has are dropped here, a uri / iri gets a pattern bounded by
its maxLength (pydantic's HttpUrl: minLength 1, maxLength 2083), and the rest is a 400 that says
what is not enforced. Unit level (the patterns, random walks of the compiled grammars against the
reference validators) and through the OpenAI SDK's structured outputs against a real server."""

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


def test_an_sdk_schema_whose_lengths_a_format_cannot_carry_is_a_400_saying_what(server):
    import openai
    from pydantic import BaseModel, Field

    class Server(BaseModel):
        host: str = Field(max_length=20, json_schema_extra={"format": "hostname"})

    with pytest.raises(openai.BadRequestError) as err:
        sdk(server).chat.completions.parse(model="m", messages=USER, response_format=Server, max_tokens=10)
    assert err.value.code == "invalid_schema" and err.value.param == "response_format"
    assert 'maxLength 20 beside format "hostname" is not enforced: its strings run up to 253' in err.value.message
