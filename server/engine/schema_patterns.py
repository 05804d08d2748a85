"""Regex patterns the constrained decoder (xgrammar 0.2.9) would write wrongly or misread, for
schema_checks: a part that writes a quote, a backslash or a control character itself inside a
JSON string (_unwritable), and a construct the library ignores or reads otherwise than a regex
engine does (_ignored: a lookaround, a possessive quantifier, an escape read as the letter, an
anchor inside the pattern). pattern_issue / ignored_issue give the refusal's message."""

from __future__ import annotations

import re

__all__ = ["ignored_issue", "pattern_issue"]


def pattern_issue(pattern: str) -> str | None:
    """Why a `pattern` is refused, or None."""
    bad = _unwritable(pattern)
    return None if bad is None else _message(bad)


def ignored_issue(pattern: str) -> str | None:
    """Why a patternProperties key is refused (what the library ignores or misreads), or None."""
    bad = _ignored(pattern)
    return None if bad is None else _message(bad)


def _message(bad: tuple[str, str]) -> str:
    part, why = bad
    return _UNWRITABLE[why].format(repr(part) if len(part) == 1 else part)


_CODES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0, "a": 7, "e": 27}  # the library's
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
    if nxt == "u" and (code := re.match(r"\{([0-9a-fA-F]{1,6})}", pattern[i + 2 :])) and int(code[1], 16) < 0x110000:
        return [(int(code[1], 16), int(code[1], 16))], i + 2 + code.end()  # \u{...}: the library reads it
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
    "look": ("the pattern has a lookaround ({}...): the decoder ignores a lookahead (it would pass strings that fail "
             "it) and has no lookbehind: not supported; spell out what it asks for (^a[a-z]{{0,4}}$ for "
             "^(?=a)[a-z]{{1,5}}$), or drop it"),
    "possessive": ("the pattern has a possessive quantifier ({}): the decoder does not read it as one (it takes "
                   "a*+a as a*a): not supported; drop its last +"),
    "anchor": ("the pattern has an anchor ({}) where the decoder ignores it (it reads ^ and $ at the edges of the "
               "pattern or of a top-level alternative only), and where it rules strings out (a ^ after a character "
               "of its branch, a $ before one, either in a repeated group): not supported; anchor the edges only"),
    "escape": ("the pattern has an escape the decoder does not read as meant ({}: an unknown escaped letter, and a "
               "digit in a class, are read as the character itself; \\x, \\u without their hex digits otherwise): "
               "not supported; write the character itself, \\xHH, \\uHHHH or a class (^ for \\A, $ for \\Z)"),
}  # fmt: skip
"""Why a pattern is refused (_unwritable, _ignored), by what it writes or misreads."""


def _unwritable(pattern: str) -> tuple[str, str] | None:
    """(part, why) of the first part of `pattern` the decoder cannot write as it should, or None.
    xgrammar matches a pattern against the JSON text of the string, not its value: a quote or a
    backslash outside a character class goes out unescaped (why "raw"; a class leaves both out,
    but for a class of nothing else); a control character outside a class, or a class of nothing
    else, is never written (why "control"; the decoder masks raw control bytes inside JSON). A
    class with other members is fine: the library, or the mask, leaves those out. First: _ignored."""
    if ignored := _ignored(pattern):
        return ignored
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


_ESC = r"\\(?:u\{[0-9a-fA-F]+}|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)"
_TOKENS = re.compile(rf"{_ESC}|\[\^?(?:{_ESC}|[^]\\])*]|\((?:\?(?:<?[=!]|P?<\w+>|[a-zA-Z-]*[:)]))?|\{{\d+(?:,\d*)?}}|.",
                     re.S)  # fmt: skip
"""_ignored's tokens: an escape, a class, a group's opening (or flags), a count {n,m}, a character."""
_READ = ("abcdefknprstuvwxBDPSW", "abcdefnrstuvwxDSW")  # the letters the library reads escaped: outside a class, in one


def _ignored(pattern: str) -> tuple[str, str] | None:
    """(part, why) of the first part of `pattern` xgrammar ignores or misreads (a warning in its log
    at most), or None: a lookahead, which it drops (why "look"; a lookbehind too, which it
    refuses), a possessive quantifier (read as a plain one), an escape it reads as the character
    itself (a letter not in _READ, a digit in a class; \\x, \\u without their digits), a ^ or $
    where it ignores one (anywhere but the edges of the top-level alternatives) and that rules
    strings out: a ^ after a character of its branch (or of the branches its groups are in), a $
    before one, either in a repeated group. The rest it reads, or refuses itself (\\b, \\1, (?>)."""
    # a level per open group, the pattern's first: [a character in its branch, in any branch of it,
    # a $ in its branch (awaiting the end), a $ in an earlier branch, an anchor in it]
    levels, quantifier, closed = [[False] * 5], "", [False] * 5
    for t in (m.group() for m in _TOKENS.finditer(pattern)):
        top, in_class = levels[-1], t[0] == "["
        for e in re.findall(_ESC, t[1:-1]) if in_class else [t] if t[0] == "\\" else []:
            c = e[1:2]
            letter = c.isascii() and c.isalpha() and (c not in _READ[in_class] or (len(e) == 2 and c in "xu"))
            if letter or (in_class and c in "123456789"):
                return e, "escape"
        if t[:3] in ("(?=", "(?!") or t[:4] in ("(?<=", "(?<!"):
            return t, "look"
        counts = t in ("*", "+", "?") or (t[0] == "{" and len(t) > 1)  # a quantifier, or a lazy one's ?
        quantifier = quantifier + t if counts else ""
        if t == "+" and len(quantifier) > 1:
            return quantifier, "possessive"
        if counts and closed[4] and (t in "*+" or (t[0] == "{" and (t[-2] == "," or int(t[1:-1].split(",")[-1]) > 1))):
            return f"^ or $ in a group repeated by {t}", "anchor"
        closed = [False] * 5
        if t[0] == "(" and t[-1] != ")":  # a group opens ("(?i)" alone: flags)
            levels.append([False] * 5)
        elif t == ")" and len(levels) > 1:  # what its branches hold, its parent's branch holds
            closed, top = levels.pop(), levels[-1]
            top[0], top[1], top[4] = top[0] or closed[1], top[1] or closed[1], top[4] or closed[4]
            top[2] = top[2] or closed[2] or closed[3]
        elif t == "|":
            top[0], top[2], top[3] = False, False, top[2] or top[3]
        elif t == "^" and any(level[0] for level in levels):
            return t, "anchor"
        elif t in ("^", "$"):
            top[2], top[4] = top[2] or t == "$", True
        elif not counts and t[0] != "(":  # a character, a class or an escape
            if any(level[2] for level in levels):
                return "$", "anchor"
            top[0] = top[1] = True
    return None
