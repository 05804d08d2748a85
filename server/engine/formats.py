"""Exact patterns for JSON-schema string `format`s: schema_checks.rewrite_strings compiles a format
of EXACT_FORMATS as its pattern (bounded by the string's minLength / maxLength: format_pattern).
Each is a format whose xgrammar pattern lets through strings the format refuses, or that
xgrammar ignores (any string); its pattern accepts exactly the format's strings or a documented
subset of them that every validator takes (Python's ipaddress and datetime, pydantic,
jsonschema's format checker with its optional libraries, jsonschema_rs).
docs/agents.md ("String formats") has what xgrammar does with each format and why.

Two rules for these patterns, from xgrammar (0.2.9):
- A pattern is matched against the JSON text of the string, not its value: one that lets
  through a quote or a backslash writes invalid JSON. None here does; none allows a control
  character either (so that text and value are the same).
- Its regex compiler mishandles `?` after a group that ends in a repetition: `(ab+)?` also
  takes "b" (and so `(\\.[0-9]+)?` took "12:00:0055"). A group is made optional by `{0,1}`.
  test_formats walks each compiled pattern and checks every string against Python's `re`."""

from __future__ import annotations

import json
import re

__all__ = ["EXACT_FORMATS", "FORMAT_RULES", "FORMAT_WIDTHS", "SHARED_RULES", "format_pattern", "share_format_rules"]

# --- dates and times (RFC 3339) ---------------------------------------------------------------
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"  # leap years of them
_DAYS = r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_DATE = rf"({_YEAR}-{_DAYS}|{_LEAP}-02-29)"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+){0,1}(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_N = "[0-9]{1,6}"  # a duration's number: 6 digits keep every duration within Python's timedelta
_DUR_TIME = rf"T({_N}H({_N}M({_N}S){{0,1}}){{0,1}}|{_N}M({_N}S){{0,1}}|{_N}S)"
_DURATION = rf"P(({_N}D|{_N}M({_N}D){{0,1}}|{_N}Y({_N}M({_N}D){{0,1}}){{0,1}})({_DUR_TIME}){{0,1}}|{_DUR_TIME}|{_N}W)"

# --- IP addresses (RFC 3986 section 3.2.2: RFC 4291's text forms) ------------------------------
_IPV4 = rf"({_OCTET}\.){{3}}{_OCTET}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = rf"({_H16}:{_H16}|{_IPV4})"
# what may follow "::" after up to 1, 2, .. 7 groups
_AFTER = [rf"({_H16}:){{4}}{_LS32}", rf"({_H16}:){{3}}{_LS32}", rf"({_H16}:){{2}}{_LS32}", rf"{_H16}:{_LS32}",
          _LS32, _H16, ""]  # fmt: skip
_IPV6 = "|".join(
    [rf"({_H16}:){{6}}{_LS32}", rf"::({_H16}:){{5}}{_LS32}"]
    + [rf"({_H16}(:{_H16}){{0,{k}}}){{0,1}}::{tail}" for k, tail in enumerate(_AFTER)]
)


# --- host names (RFC 1123) and e-mail addresses (RFC 5321) ------------------------------------
def _label(most: int) -> str:
    """A host-name label of 1 to `most` lower-case letters, digits and inner hyphens, without
    "--" in its third and fourth places (RFC 5891 keeps those for "xn--" punycode labels, which
    validators decode and check: none is written)."""
    c, h = "[a-z0-9]", "[a-z0-9-]"
    return rf"{c}({h}{{0,2}}{c}|{h}({c}{h}|-{c}){h}{{0,{most - 5}}}{c}){{0,1}}"


_L63, _L61, _L30 = _label(63), _label(61), _label(30)
# at most 253 characters: 1 to 4 labels of up to 63 (the fourth up to 61), or 5 to 8 of up to 30
_HOSTNAME = rf"{_L63}(\.{_L63}){{0,2}}(\.{_L61}){{0,1}}|{_L30}(\.{_L30}){{4,7}}"


def _none_of(words: list[str], least: int, most: int) -> str:
    """A regex of the words of `least` to `most` lower-case letters other than `words`."""
    letters = "abcdefghijklmnopqrstuvwxyz"

    def after(prefix: str) -> str:  # what may follow `prefix` (a prefix of one of the words)
        nxt = sorted({w[len(prefix)] for w in words if w.startswith(prefix) and len(w) > len(prefix)})
        n = len(prefix) + 1  # the length with one more letter
        alts = [f"[{''.join(ch for ch in letters if ch not in nxt)}][a-z]{{{max(0, least - n)},{most - n}}}"]
        alts += [f"{ch}({after(prefix + ch)})" for ch in nxt]
        ends = len(prefix) >= least and prefix not in words  # `prefix` itself is one
        return "|".join(alts) + ("|" if ends else "")

    return after("")


_ATEXT = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]"
_SPECIAL_USE = ["arpa", "invalid", "local", "localhost", "onion", "test"]  # RFC 6761, 7686, 6762
# local part: a dot-atom of at most 32 characters and the dots between them (63 in all); domain:
# 2 to 3 lower-case labels of up to 63 or 4 to 6 of up to 30, the last (the top-level domain) 2 to
# 24 letters and no special-use name (pydantic's EmailStr, by email-validator, refuses those, a
# domain without a dot and one whose last character is no letter): 243 characters at most (254)
_LOCAL, _TLD = rf"{_ATEXT}(\.?{_ATEXT}){{0,31}}", _none_of(_SPECIAL_USE, 2, 24)
_EMAIL = rf"{_LOCAL}@(({_L63}\.){{1,2}}|({_L30}\.){{3,5}})({_TLD})"


# --- host names and e-mail addresses as shared rules (xgrammar's EBNF) ------------------------
def _regex_rule(pattern: str, before: str) -> str:
    """An EBNF rule body: `pattern` as the JSON-schema converter writes a `pattern` (over the
    string's JSON text), which ends only before one of the characters `before` (a lookahead: the
    library then settles at compile time the tokens that run past the rule's end; without it
    each such token is checked at every step, ~250 us a step instead of ~6)."""
    return f"Regex({json.dumps(f'^({pattern})$')}, json_string=true) (=[{before}])"


SHARED_RULES = {
    "fmt_label63": _regex_rule(_L63, '.\\"'),
    "fmt_label61": _regex_rule(_L61, '\\"'),  # a host name's last label only
    "fmt_label30": _regex_rule(_L30, '.\\"'),
    "fmt_local": _regex_rule(_LOCAL, "@"),
    "fmt_tld": _regex_rule(_TLD, '\\"'),
    "fmt_hostname": 'fmt_label63 ("." fmt_label63){0,2} ("." fmt_label61)? | fmt_label30 ("." fmt_label30){4,7}',
    "fmt_email": 'fmt_local "@" ((fmt_label63 "."){1,2} | (fmt_label30 "."){3,5}) fmt_tld',
}
"""_HOSTNAME and _EMAIL as EBNF rules whose labels are rules of their own, written once: the
library builds the token masks of each state of a rule, and a regex writes out every copy of a
label (_HOSTNAME: four of up to 63 characters, eight of up to 30), the rules each label once,
shared by both formats (a third of the first compile: docs/agents.md, "String formats").
Each lookahead holds wherever the JSON-schema converter puts the pattern (a JSON string's
content: the closing quote follows), so the language is _HOSTNAME's and _EMAIL's, and so are the
token masks (test_format_rules compares both, strings in and out at every bound)."""
FORMAT_RULES = {"hostname": "fmt_hostname", "idn-hostname": "fmt_hostname", "email": "fmt_email",
                "idn-email": "fmt_email"}  # fmt: skip
"""The formats whose EXACT_FORMATS pattern is compiled as a rule of SHARED_RULES."""


def share_format_rules(text: str, patterns: dict[str, str]) -> str | None:
    """The JSON-schema converter's EBNF `text` with each rule whose body is one of `patterns`
    (the converter's EBNF of each FORMAT_RULES pattern: the name of its rule) replaced by that
    shared rule, the shared rules it needs added; None where nothing is replaced. A rule is
    replaced only where every use of it is a JSON string's content ("\\"" name "\\"": the
    closing quote follows, as the lookaheads assume), and none where a name of ours is taken."""
    lines = text.splitlines()
    if any(line.partition(" ::= ")[0] in SHARED_RULES for line in lines):
        return None
    todo = []
    for i, line in enumerate(lines):
        name, _, body = line.partition(" ::= ")
        if body not in patterns:
            continue
        if len(re.findall(rf"(?<!\w){re.escape(name)}(?!\w)", text)) - 1 == text.count(f'"\\"" {name} "\\""'):
            lines[i] = f"{name} ::= {patterns[body]}"
            todo.append(patterns[body])
    added: dict[str, str] = {}
    while todo:  # the rules used and those they refer to
        name = todo.pop()
        added.setdefault(name, f"{name} ::= {SHARED_RULES[name]}")
        todo += [n for n in SHARED_RULES if n not in added and re.search(rf"\b{n}\b", SHARED_RULES[name])]
    return "\n".join(lines + sorted(added.values())) if added else None


# --- URIs (RFC 3986) ---------------------------------------------------------------------------
_PCT = "%[0-9A-Fa-f]{2}"
_UNRESERVED_SUB = "[A-Za-z0-9._~!$&'()*+,;=-]"  # unreserved and sub-delims
_PCHAR = f"({_UNRESERVED_SUB}|{_PCT}|[:@])"
_AUTHORITY = (
    rf"(({_UNRESERVED_SUB}|{_PCT}|:)*@){{0,1}}"  # userinfo
    rf"(\[({_IPV6}|v[0-9A-Fa-f]+\.({_UNRESERVED_SUB}|:)+)\]|({_UNRESERVED_SUB}|{_PCT})*)"  # host
    r"(:[0-9]*){0,1}"  # port
)
_QUERY_FRAGMENT = rf"(\?({_PCHAR}|[/?])*){{0,1}}(#({_PCHAR}|[/?])*){{0,1}}"


def _part(first: str) -> str:
    """hier-part / relative-part: "//" authority path-abempty, path-absolute, a path whose first
    segment is `first`, or path-empty."""
    return rf"(//{_AUTHORITY}(/{_PCHAR}*)*|/({_PCHAR}+(/{_PCHAR}*)*){{0,1}}|{first}(/{_PCHAR}*)*){{0,1}}"


_URI = rf"[A-Za-z][A-Za-z0-9+.-]*:{_part(_PCHAR + '+')}{_QUERY_FRAGMENT}"
_RELATIVE_REF = rf"{_part(f'({_UNRESERVED_SUB}|{_PCT}|@)+')}{_QUERY_FRAGMENT}"  # no colon in the first segment

# --- URI templates (RFC 6570), relative JSON pointers -----------------------------------------
_LITERAL = rf"([!#$&(-;=?-\[\]_a-z~]|{_PCT})"
_VARSPEC = rf"[A-Za-z0-9_](\.?([A-Za-z0-9_]|{_PCT}))*(:[1-9][0-9]{{0,2}}|\*){{0,1}}"
_URI_TEMPLATE = rf"({_LITERAL}|\{{[+#./;?&]{{0,1}}{_VARSPEC}(,{_VARSPEC})*\}})*"
# up to 99 levels up (jsonschema's checker refuses a "0" before a digit: "100"), then "#" or a JSON
# pointer of printable ASCII (no quote, backslash, or "/" and "~" but as "/" and "~0" / "~1")
_RELATIVE_JSON_POINTER = r"(0|[1-9][0-9]{0,1})(#|(/([ !#-.0-\[\]-}]|~[01])*)*)"

EXACT_FORMATS = {
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "duration": rf"^{_DURATION}$",
    "ipv4": rf"^{_IPV4}$",
    "ipv6": rf"^({_IPV6})$",
    "hostname": rf"^({_HOSTNAME})$",
    "idn-hostname": rf"^({_HOSTNAME})$",  # an ASCII host name is an IDNA one
    "email": rf"^{_EMAIL}$",
    "idn-email": rf"^{_EMAIL}$",
    "uri": rf"^{_URI}$",
    "iri": rf"^{_URI}$",  # a URI is an IRI
    "uri-reference": rf"^({_URI}|{_RELATIVE_REF})$",
    "iri-reference": rf"^({_URI}|{_RELATIVE_REF})$",
    "uri-template": rf"^{_URI_TEMPLATE}$",
    "relative-json-pointer": rf"^{_RELATIVE_JSON_POINTER}$",
}
"""Each format as the pattern that writes only its strings. What xgrammar's own lets through
(examples in docs/agents.md): leading zeros in an ipv4 ("01.2.3.4") or in an ipv6's embedded IPv4
("::ffff:1.2.3.04"); any day up to 31 in every month in a date or date-time ("2024-02-30"), a
leap second at any minute in a time or date-time ("12:30:60Z"); duration numbers past Python's
timedelta ("P99999999999D"); host-name labels over 63 characters; e-mail domains without a dot,
special-use ones ("a@b.test"), quoted local parts (pydantic's EmailStr refuses each); the reserved
operators of a uri-template ("{=a}"); relative JSON pointers jsonschema's checker refuses ("100").
idn-hostname, idn-email, iri and iri-reference it does not check at all: their patterns write the
ASCII format they extend. These patterns take neither a leap second nor a lower-case "t" / "z",
upper-case host names, punycode ("xn--") labels, a trailing dot, quoted or IP-literal e-mail
parts, non-ASCII names, nor the longest names (see each): all valid, none needed."""

# --- length bounds (minLength / maxLength beside a format) --------------------------------------
FORMAT_WIDTHS: dict[str, tuple[int, int | None]] = {
    "date": (10, 10), "time": (9, None), "date-time": (20, None), "duration": (3, 44), "ipv4": (7, 15),
    "ipv6": (2, 45), "hostname": (1, 253), "idn-hostname": (1, 253), "email": (6, 243), "idn-email": (6, 243),
    "uri": (2, None), "iri": (2, None), "uri-reference": (0, None), "iri-reference": (0, None),
    "uri-template": (0, None), "relative-json-pointer": (1, None),
    "uuid": (36, 36), "json-pointer": (0, None),  # the library's own (exact) grammars
}  # fmt: skip
"""The shortest and the longest string (None: no bound) each format's grammar writes, in
characters (test_format_lengths reads them off the patterns). xgrammar drops minLength / maxLength
beside any of these formats (other formats are annotations to it: it enforces the lengths)."""


def format_pattern(fmt: str, least: int, most: int | None) -> str | None:
    """The pattern of the `fmt` strings (FORMAT_WIDTHS) of `least` to `most` characters (None
    for uuid and json-pointer, whose library grammars write only such strings); ValueError
    saying what is not supported. Bounds that hold for every string of the format are dropped;
    below the longest uri / iri, _bounded_uri writes the pattern."""
    lo, hi = FORMAT_WIDTHS[fmt]
    if least > lo:
        raise ValueError(f'minLength {least} beside format "{fmt}" is not enforced: its shortest strings are {lo} '
                         "characters, and a format's pattern is bounded from above only (drop minLength, or make it "
                         f"at most {lo})")  # fmt: skip
    if most is None or (hi is not None and most >= hi):
        return EXACT_FORMATS.get(fmt)
    if most < lo:
        raise ValueError(f'maxLength {most} beside format "{fmt}": no such string is shorter than {lo} characters')
    if fmt in ("uri", "iri"):
        return f"^{_bounded_uri(most)}$"
    longest = f"up to {hi} characters" if hi else "any length"
    fix = f"drop maxLength, or make it at least {hi}" if hi else "drop maxLength"
    raise ValueError(f'maxLength {most} beside format "{fmt}" is not enforced: its strings run {longest}, and only '
                     f'"uri" and "iri" have a pattern bounded by a maxLength ({fix})')  # fmt: skip


_COUNTED = 129
"""The smallest upper bound xgrammar (0.2.9) compiles as a counter; it writes out a repetition of
up to 128 state by state, each state with its token masks (milliseconds apiece)."""
_SHORT = 32
"""The most a bounded part takes when it cannot take _COUNTED (written out; path and query: twice)."""
_LONG = 160
"""The most any bounded part takes: xgrammar's conversion of a schema costs the square of a bound
(0.25 s for 1,000 repetitions of a group, 8 s for 5,000)."""
_US = "A-Za-z0-9._~!$&'()*+,;="  # unreserved and sub-delims, as a class's inside ("-" goes last)


def _bounded_part(extra: str, chars: int, encoded: bool = True, short: int = _SHORT) -> tuple[str, int]:
    """(regex, its longest match) of up to `chars` characters of _US + `extra` (at most `short`
    below _COUNTED, at most _LONG repetitions), with percent-encodings (3 characters each) where
    `encoded` and there is room for _COUNTED of them."""
    cls = f"[{_US}{extra}-]"
    if encoded and chars // 3 >= _COUNTED:
        k = min(chars // 3, _LONG)
        return f"({cls}|{_PCT}){{0,{k}}}", k * 3
    k = min(chars, _LONG) if chars >= _COUNTED else min(chars, short)
    return (f"{cls}{{0,{k}}}" if k > 0 else ""), max(k, 0)


def _bounded_uri(n: int) -> str:
    """uri strings of at most n (>= 2) characters, a subset: a scheme of up to 16 characters (n/8
    under 128); "//", a host (a name of unreserved and sub-delims characters, up to a third of
    the rest, or an IPv6 literal), a port (n >= 128), or no authority; path and query; a fragment
    of up to an eighth. Each part is one bounded repetition (_bounded_part: counted by xgrammar
    or short, at most _LONG); path, query and fragment take percent-encodings where there is room
    for 129 of them. No user info, no IPvFuture host. Under 16 characters: a one-letter scheme
    and a path. test_format_lengths checks the widths and walks the grammars."""
    pchar, rest_cls = f"[{_US}:@-]", ":@/?"
    if n < 16:
        return "[A-Za-z]:" + (f"({pchar}{_bounded_part(rest_cls, n - 3, encoded=False)[0]}){{0,1}}" if n > 2 else "")
    s, port = min(15, n // 8), "(:[0-9]{0,5}){0,1}" if n >= 128 else ""
    budget = n - (s + 6) - (6 if port else 0)  # scheme and ":", "//", port, the path's first "/" or "?", "#"
    host_c, frag_c = min(253, budget // 3), budget // 8
    if budget - host_c - frag_c < _COUNTED <= budget:  # path and query first: as many as a counter takes
        host_c = min(host_c, (budget - _COUNTED) * 3 // 4)
        frag_c = min(frag_c, budget - _COUNTED - host_c)
    host, host_w = _bounded_part("", host_c, encoded=False)
    if host_w >= 47:  # room for "[" + the longest IPv6 address + "]"
        host = rf"(\[({_IPV6})\]|{host})"
    frag, frag_w = _bounded_part(rest_cls, frag_c)
    rest, _ = _bounded_part(rest_cls, budget - host_w - frag_w, short=2 * _SHORT)
    # one repetition for path and query, after any of their first characters (each copy of a
    # written-out repetition costs its compile time again)
    hier = rf"(//{host}{port}[/?]|/({pchar}|\?)|{pchar}|\?){rest}|//{host}{port}|/"
    return rf"[A-Za-z][A-Za-z0-9+.-]{{0,{s}}}:({hier}){{0,1}}(#{frag}){{0,1}}"
