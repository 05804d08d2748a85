"""Host names and e-mail addresses as shared rules (server/engine/formats.py SHARED_RULES,
grammar.json_schema_grammar, docs/agents.md "String formats"): a `hostname` / `email` field
compiles with each label a rule of its own, written once, instead of the pattern that writes out
every copy (a third of the first compile). The language must stay the pattern's: strings in and
out of it, at every bound, are taken or refused alike by the pattern's grammar, by the shared
rules' and by Python's `re`, and so are the masks after every prefix (tokens past a rule's end
included); random walks of either grammar are among the strings tried."""

from __future__ import annotations

import json
import random
import re

import pytest
from test_formats import BYTES, EMAILS, HOSTS, NOT_EMAILS, NOT_HOSTS, walks

from server.engine.formats import EXACT_FORMATS
from server.engine.grammar import GrammarCompiler, check_schema, json_schema_grammar
from server.engine.types import GrammarSpec
from server.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def byte_compiler():
    """A vocabulary of the 256 bytes (token 256: the end), as test_formats walks them."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(BYTES)] + [b""], xgr.VocabType.RAW,
                             vocab_size=BYTES + 1, stop_token_ids=[BYTES])  # fmt: skip
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def L(n: int, ch: str = "a") -> str:
    """A label of n characters."""
    return ch * n


HOST_EDGES = [
    L(63), L(64), f"{L(63)}.{L(63)}.{L(63)}.{L(61)}", f"{L(63)}.{L(63)}.{L(63)}.{L(62)}",  # 253 / 254 characters
    f"{L(62)}.{L(63)}.{L(63)}.{L(62)}", f"{L(63)}.{L(63)}.{L(63)}", f"{L(63)}.{L(64)}", f"{L(61)}.b",
    ".".join([L(30)] * 5), ".".join([L(30)] * 8), ".".join([L(30)] * 9), ".".join([L(30)] * 7 + [L(31)]),
    ".".join([L(31)] + [L(30)] * 4), ".".join("abcdefgh"), ".".join("abcdefghi"), "a.b.c.d", "a.b.c.d.e",
    f"{L(40)}.b.c.d.e", "ab-cd", "ab--cd", "a--b", "abc--d", "a-", "-a", "a.-b", "a-.b", "0", "9-9",
    "A.com", "a.", ".a", "a..b", "", "a_b", "é.com", "a b", "a@b", "xn--x", "x.y-", "ab-c.x-yz.q",
]  # fmt: skip
EMAIL_EDGES = [
    "a@bc.de", "a@b.c", "a@b.cd", f"{L(32, 'x')}@x.com", f"{L(33, 'x')}@x.com", ".".join("x" * 32) + "@x.com",
    ".".join("x" * 33) + "@x.com", "a..b@x.com", ".a@x.com", "a.@x.com", '"a"@x.com', "a@x.y.z.com",
    f"a@{L(63)}.{L(63)}.com", f"a@{L(63)}.{L(63)}.{L(63)}.com", f"a@{L(64)}.com", f"a@{L(30)}.{L(30)}.{L(30)}.com",
    "a@" + ".".join([L(30)] * 5) + ".com", "a@" + ".".join([L(30)] * 6) + ".com", "a@" + ".".join([L(31)] * 4) + ".com",
    f"a@x.{L(24, 't')}", f"a@x.{L(25, 't')}", "a@x.test", "a@x.tes", "a@x.tests", "a@x.localhost", "a@x.localhos",
    "a@x.localhosts", "a@x.onion", "a@x.onions", "a@x.arp", "a@x.arpa", "a@x.co1", "a@x.c-o", "a@x.COM",
    "a@ab--cd.com", "a@a-b.com", "A+B/C=D?E^F_G`H{I|J}K~L-M@x.org", "a b@x.com", "a@@x.com", "a@x.com.",
]  # fmt: skip
CASES = {"hostname": HOSTS + NOT_HOSTS + HOST_EDGES, "email": EMAILS + NOT_EMAILS + EMAIL_EDGES}


def mutations(texts: list[str], n: int, rng: random.Random) -> list[str]:
    """n strings one to three random edits (insert, delete, replace) away from the texts."""
    alphabet = "az09-.@AZ_+\"'~ "
    out = []
    for _ in range(n):
        t = list(rng.choice(texts))
        for _ in range(rng.randint(1, 3)):
            i = rng.randint(0, len(t))
            op = rng.choice("idr") if t else "i"
            if op == "i":
                t.insert(i, rng.choice(alphabet))
            elif i < len(t):
                t[i] = rng.choice(alphabet) if op == "r" else ""
        out.append("".join(t))
    return out


CROSSING = [f"{x}{y}".encode() for x in "az09-~A" for y in '."@'] + [b'com"', b"a.b", b".co", b"x@x", b"aa", b"a" * 8]
"""Tokens beyond the 256 bytes that run past the end of a label, a local part or a top-level
domain (a rule's lookahead decides at compile time which of them a mask keeps)."""


@pytest.fixture(scope="module")
def crossing_compiler():
    import xgrammar as xgr

    vocab = [bytes([b]) for b in range(BYTES)] + [b""] + CROSSING
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[BYTES])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def verdict(old, new, text: str) -> tuple[bool, bool]:
    """Whether each grammar takes text as a JSON string; AssertionError where their masks differ
    after any prefix of it (a token past a rule's end is kept by one and not by the other)."""
    import torch
    import xgrammar as xgr

    vocab = old.tokenizer_info.vocab_size
    mo, mn = xgr.GrammarMatcher(old), xgr.GrammarMatcher(new)
    a, b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    for ch in json.dumps(text):
        mo.fill_next_token_bitmask(a)
        mn.fill_next_token_bitmask(b)
        assert torch.equal(a, b), text
        took = mo.accept_string(ch), mn.accept_string(ch)
        if not all(took):
            return took
    return mo.accept_token(BYTES), mn.accept_token(BYTES)


@pytest.mark.parametrize("fmt", ["hostname", "email"])
def test_the_shared_rules_write_exactly_the_patterns_strings(byte_compiler, crossing_compiler, fmt):
    """Edge cases at every bound (labels of 63 / 64 characters, the fourth of 61 / 62, 5 to 8
    labels of 30 / 31, 253 / 254 characters, local parts of 32 / 33 atoms, top-level domains of
    24 / 25 letters and the special-use names beside their prefixes and extensions), 600 random
    edits of them and 150 random walks of each grammar: the pattern's grammar and the shared
    rules' have the same masks after every prefix (tokens past a rule's end included) and take
    the same strings as Python's `re`."""
    source = check_schema(json.dumps({"type": "string", "format": fmt}))
    pattern = EXACT_FORMATS[fmt]
    assert "fmt_label63 ::= " in str(json_schema_grammar(source))  # the shared rules are used
    rng = random.Random(fmt)
    texts = CASES[fmt] + mutations(CASES[fmt], 600, rng)
    walked = [byte_compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True),
              byte_compiler.compile_grammar(json_schema_grammar(source))]  # fmt: skip
    texts += [t for g in walked for t in walks(g, 150, rng)]
    old = crossing_compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    new = crossing_compiler.compile_grammar(json_schema_grammar(source))
    verdicts = {t: (*verdict(old, new, t), bool(re.fullmatch(pattern, t))) for t in texts}
    assert {t: v for t, v in verdicts.items() if len(set(v)) > 1} == {}
    taken = sum(v[0] for v in verdicts.values())
    assert 300 < taken < len(verdicts) - 300, taken  # both sides are tried


def test_one_copy_of_each_label_rule_serves_every_field_of_both_formats():
    """Host names and e-mail addresses at several places of one schema (nested, array items,
    anyOf, $defs, patternProperties) refer to the same label rules; every other rule of the
    converter's grammar is as it was (the grammar reads back as its own text)."""
    host, mail = {"type": "string", "format": "hostname"}, {"type": "string", "format": "idn-email"}
    schema = {"type": "object", "$defs": {"h": host}, "properties": {
        "a": host, "b": {"type": "array", "items": mail}, "c": {"anyOf": [{"$ref": "#/$defs/h"}, {"type": "null"}]},
        "d": {"type": "object", "patternProperties": {"^x$": mail}}}}  # fmt: skip
    text = str(json_schema_grammar(check_schema(json.dumps(schema))))
    rules = dict(line.split(" ::= ", 1) for line in text.splitlines())
    assert sum(body in ("((fmt_hostname))", "((fmt_email))") for body in rules.values()) >= 4
    assert [n for n, b in rules.items() if "{0,58}" in b] == ["fmt_label63"]  # no pattern of a format is left
    assert sum(n.startswith("fmt_label") for n in rules) == 3


def test_fields_compile_through_the_engine_with_the_shared_rules():
    """Through the engine's compiler (the RWKV vocabulary), alone and as an any_of alternative:
    the grammar has one copy of the label rules for both fields; valid host names and e-mail
    addresses are written, the others refused."""
    import xgrammar as xgr

    compiler = GrammarCompiler(get_tokenizer().token_table)
    fields = {"h": {"type": "string", "format": "hostname"}, "e": {"type": "string", "format": "email"}}
    schema = {"type": "object", "properties": fields, "required": ["h", "e"]}
    either = GrammarSpec.any_of([("<x>", GrammarSpec("regex", "a")), ("", GrammarSpec.json_schema(schema))])
    grammars = [compiler.compile(s).grammar for s in (GrammarSpec.json_schema(schema), either)]
    assert all(str(g.grammar).count("fmt_label63 ::= ") == 1 for g in grammars)

    def ok(h: str, e: str) -> bool:
        out = set()
        for g in grammars:
            m = xgr.GrammarMatcher(g)
            out.add(m.accept_string(json.dumps({"h": h, "e": e}, separators=(", ", ": "))) and m.accept_token(0))
        assert len(out) == 1, (h, e)
        return out.pop()

    assert ok("www.example.com", "first.last+tag@mail.example.org") and ok(L(63), f"{L(32)}@x.com")
    assert not ok(L(64), "a@b.co") and not ok("a.com", "a@x.test") and not ok("a.com", f"{L(33)}@x.com")


def test_a_pattern_rule_used_outside_a_json_string_or_a_taken_name_is_left_as_it_is():
    """The lookaheads assume a closing quote after the format: a pattern rule used otherwise
    stays the converter's, and so does a grammar that already has a rule of our names."""
    from server.engine.formats import share_format_rules
    from server.engine.grammar import _pattern_rules

    body = next(b for b, rule in _pattern_rules().items() if rule == "fmt_hostname")
    quoted = f'root ::= (("\\"" h "\\""))\nh ::= {body}'
    shared = share_format_rules(quoted, _pattern_rules())
    assert shared is not None and "h ::= fmt_hostname" in shared and "fmt_label61 ::= " in shared
    assert "fmt_local" not in shared  # only the rules the format needs
    assert share_format_rules(f'root ::= (("\\"" h "x"))\nh ::= {body}', _pattern_rules()) is None
    assert share_format_rules(f'{quoted}\nfmt_label30 ::= "a"', _pattern_rules()) is None
