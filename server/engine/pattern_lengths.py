"""minLength / maxLength beside a JSON-schema `pattern`. xgrammar (0.2.9) keeps the pattern and
drops the lengths (an output could fail them), so schema_checks refuses them unless
bounded_pattern writes a pattern whose strings are exactly those of the pattern with such
lengths:

- lengths every string of the pattern already has are dropped (`^[0-9]{5}$` with maxLength 5);
- a pattern with one part of variable length, a repetition of a piece of fixed width
  (`^[a-z]+$`, `^[A-Z]{2}-[0-9]{1,8}$`, `^(ab)*c$`), gets the repetition's count bounded by
  the lengths (the length of a string fixes the count): `^[a-z]{1,20}$` for maxLength 20;
- any other pattern is a ValueError that says what: a pattern with two parts of variable length
  or an alternation of them (no regex of the intersection is written here), or a construct
  whose widths are not read here (lookarounds, backreferences, ...).

The library matches a whole string against a pattern (anchored or not) and reads `.`, a class
and an escape like `\\d` as one character (a code point, never a JSON escape: test_format_lengths
walks the compiled grammars), so a string's length is the sum of its parts' widths. Widths are
read by a parser of the ECMA-262 subset below; anything else is refused, not guessed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["bounded_pattern"]

WRITTEN_OUT, COUNTED = 128, 1000
"""The most characters a repetition bounded by the lengths may take where the pattern's own was
cheaper: the library writes out a repetition of up to 128 state by state, each with its token
masks (`.{1,128}` 0.75 s, `(.{10}){0,100}` 5 s; `[a-z]{1,128}` 0.13 s), and counts a longer
one at a cost of the square of its bound (`[a-z]{1,1000}` 0.04 s, 5,000 1 s, 30,000 64 s;
`.{0,1000}` 0.26 s)."""
_DEPTH = 32
"""The deepest nesting of groups read."""
_CLASS_ESCAPES, _CHAR_ESCAPES = set("dDwWsS"), {"t", "n", "v", "f", "r"}


class Unsupported(ValueError):
    """A pattern whose widths are not read here."""


@dataclass
class _Item:
    """One atom of a sequence with its quantifier: the atom is pattern[start:end], the quantifier
    pattern[end:stop]; width: the atom's (least, most: None unbounded), count: the quantifier's."""

    start: int
    end: int
    stop: int
    width: tuple[int, int | None]
    count: tuple[int, int | None]
    ends_in_repeat: bool  # a group one of whose branches ends in a repetition of variable count

    def repeats(self) -> bool:
        """Whether this item is, or ends in, a repetition of variable count."""
        return self.count[0] != self.count[1] or self.ends_in_repeat

    def widths(self) -> tuple[int, int | None]:
        (lo, hi), (a, b) = self.width, self.count
        return lo * a, (None if hi is None or b is None else hi * b) if hi != 0 else 0


def _total(items: list[_Item]) -> tuple[int, int | None]:
    """The widths of a sequence of items."""
    ws = [it.widths() for it in items]
    his = [hi for _, hi in ws]
    return sum(lo for lo, _ in ws), (None if None in his else sum(h for h in his if h is not None))


class _Parser:
    """A recursive-descent reader of the pattern: branches of items with their widths."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def branches(self, depth: int) -> list[list[_Item]]:
        """An alternation up to `)` or the end: its branches' items."""
        if depth > _DEPTH:
            raise Unsupported(f"groups nested deeper than {_DEPTH}")
        out: list[list[_Item]] = [[]]
        while self.peek() not in ("", ")"):
            if self.peek() == "|":
                self.i += 1
                out.append([])
                continue
            start = self.i
            width, ends_in_repeat = self.atom(depth)
            end = self.i
            count = self.quantifier()
            if self.p[end : self.i] == "?" and ends_in_repeat:
                raise Unsupported("a `?` after a group that ends in a repetition (the library reads `(ab+)?` as "
                                  "also taking `b`: write {0,1})")  # fmt: skip
            out[-1].append(_Item(start, end, self.i, width, count, ends_in_repeat))
        return out

    def atom(self, depth: int) -> tuple[tuple[int, int | None], bool]:
        """The widths of the atom at the cursor, and whether it is a group one of whose branches
        ends in a repetition of variable count."""
        ch = self.peek()
        if ch == "(":
            if self.peek(1) == "?" and self.p[self.i : self.i + 3] != "(?:":
                raise Unsupported(f"`{self.p[self.i : self.i + 3]}` (a lookaround or a named group)")
            self.i += 3 if self.peek(1) == "?" else 1
            inner = self.branches(depth + 1)
            if self.peek() != ")":
                raise Unsupported("an unclosed group")
            self.i += 1
            ws = [_total(b) for b in inner]
            his = [hi for _, hi in ws]
            width = min(lo for lo, _ in ws), (None if None in his else max(h for h in his if h is not None))
            return width, any(b and b[-1].repeats() for b in inner)
        if ch == "[":
            self.char_class()
        elif ch == "\\":
            self.escape()
        elif ch in ("^", "$"):
            raise Unsupported(f"`{ch}` inside the pattern (an anchor other than a leading `^` and a final `$`)")
        elif ch in "*+?{}]":
            raise Unsupported(f"`{ch}` where a character or a group is expected")
        else:
            self.i += 1  # a literal character or `.`
        return (1, 1), False

    def char_class(self) -> None:
        """Past a character class `[...]` (one character wide)."""
        self.i += 2 if self.peek(1) == "^" else 1
        if self.peek() == "]":
            raise Unsupported("an empty class `[]` or `[^]`")
        while self.peek() != "]":
            if self.peek() in ("", "["):
                raise Unsupported("a `[` inside a class, or an unclosed class")
            self.i += 2 if self.peek() == "\\" else 1
        self.i += 1

    def escape(self) -> None:
        """Past an escape that is one character: a class escape (\\d ...), a control character
        (\\n ...), \\xHH, \\uHHHH (no surrogate), or an escaped punctuation character."""
        ch, digits = self.peek(1), {"x": 2, "u": 4}.get(self.peek(1), 0)
        if digits:
            code = self.p[self.i + 2 : self.i + 2 + digits]
            if len(code) != digits or any(c not in "0123456789abcdefABCDEF" for c in code):
                raise Unsupported(f"`\\{ch}` without {digits} hex digits")
            if 0xD800 <= int(code, 16) <= 0xDFFF:
                raise Unsupported("a surrogate `\\u` escape")
            self.i += 2 + digits
        elif ch in _CLASS_ESCAPES or ch in _CHAR_ESCAPES or (ch and not ch.isalnum() and ch.isascii()):
            self.i += 2
        else:
            raise Unsupported(f"the escape `\\{ch}` (a word boundary, a backreference, a property, ...)")

    def quantifier(self) -> tuple[int, int | None]:
        """The bounds of the quantifier at the cursor ((1, 1) where there is none)."""
        ch = self.peek()
        bounds: tuple[int, int | None] = {"?": (0, 1), "*": (0, None), "+": (1, None)}.get(ch, (1, 1))
        if ch in "?*+" and ch:
            self.i += 1
        elif ch == "{":
            close = self.p.find("}", self.i)
            lo, comma, hi = self.p[self.i + 1 : close].partition(",") if close > 0 else ("", "", "")
            if not lo.isdigit() or not (hi.isdigit() or hi == "") or (hi and int(hi) < int(lo)):
                raise Unsupported("a `{` that is no quantifier {n}, {n,} or {n,m}")
            bounds = int(lo), (int(hi) if hi else None if comma else int(lo))
            self.i = close + 1
        if bounds != (1, 1) and self.peek() and self.peek() in "?*+{":
            raise Unsupported("a lazy or repeated quantifier")
        return bounds


def _read(pattern: str) -> tuple[int, list[list[_Item]]]:
    """(the offset of the body, its top-level branches): the body is the pattern without a
    leading `^` and a final `$` (the library matches the whole string either way)."""
    lead = 1 if pattern.startswith("^") else 0
    body = pattern[lead:]
    if body.endswith("$") and (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0:
        body = body[:-1]  # a final `$` after an even number of backslashes: an anchor
    parser = _Parser(body)
    out = parser.branches(0)
    if parser.i != len(body):
        raise Unsupported("a `)` without its `(`")
    return lead, out


def _span(lo: int, hi: int | None) -> str:
    return f"{lo} to {hi} characters" if hi is not None else f"at least {lo} characters"


def bounded_pattern(pattern: str, least: int, most: int | None) -> str:
    """The pattern of the strings of `pattern` with `least` to `most` (None: any) characters
    (the module's docstring); ValueError saying why none is written."""
    try:
        lead, branches = _read(pattern)
    except Unsupported as exc:
        raise ValueError(f"minLength / maxLength beside this pattern are not enforced: it has {exc}, whose "
                         "width is not read here (bound the length in the pattern)") from None  # fmt: skip
    ws = [_total(b) for b in branches]
    his = [hi for _, hi in ws]
    lo, hi = min(w[0] for w in ws), (None if None in his else max(h for h in his if h is not None))
    if least <= lo and (most is None or (hi is not None and hi <= most)):
        return pattern  # every string of the pattern has such a length
    if (hi is not None and hi < least) or (most is not None and most < lo):
        raise ValueError(f"no string of the pattern has {_span(least, most)}: its strings have {_span(lo, hi)}")
    variable = [it for it in branches[0] if it.widths()[0] != it.widths()[1]]
    if len(branches) > 1 or len(variable) != 1 or variable[0].width[0] != variable[0].width[1]:
        raise ValueError(f"minLength / maxLength beside this pattern are not enforced: it has {_why(branches)}; "
                         "they are where the pattern's strings all have such a length, or where it has one part "
                         "of variable length, a repetition of a piece of fixed width (as `^[a-z]+$` or "
                         "`^[A-Z]{2}[0-9]{1,8}$`): bound the length in the pattern")  # fmt: skip
    return _recount(pattern, lead, variable[0], lo, least, most)


def _slow(w: int, a: int, b: int | None) -> bool:
    """Whether a repetition of a piece `w` characters wide, `a` to `b` times, is past WRITTEN_OUT
    (written out) or COUNTED (counted) characters."""
    if b is not None and b <= WRITTEN_OUT:
        return w * b > WRITTEN_OUT
    return w * max(a, b or 0) > COUNTED


def _why(branches: list[list[_Item]]) -> str:
    """What keeps the lengths of a pattern of `branches` from being written as one count."""
    if len(branches) > 1:
        return "alternatives (`|`) at the top"
    variable = [it for it in branches[0] if it.widths()[0] != it.widths()[1]]
    if len(variable) > 1:
        return f"{len(variable)} parts of variable length"
    return "a repetition of a piece of variable width"


def _recount(pattern: str, lead: int, item: _Item, lo: int, least: int, most: int | None) -> str:
    """`pattern` with the count of `item`, a repetition of a piece of fixed width, bounded so that
    the whole is `least` to `most` characters long (`lo`: the pattern's shortest width)."""
    w, (a, b) = item.width[0], item.count
    fixed = lo - w * a  # the width of every other part
    k_lo = max(a, -(-(least - fixed) // w))
    k_hi = b if most is None else (most - fixed) // w if b is None else min(b, (most - fixed) // w)
    if k_hi is not None and k_lo > k_hi:
        raise ValueError(f"no string of the pattern has {_span(least, most)}: its strings have {fixed} + {w}k "
                         f"characters (k from {a} to {'any' if b is None else b})")  # fmt: skip
    count = f"{{{k_lo},{'' if k_hi is None else k_hi}}}"
    if (k_lo, k_hi) != (a, b) and _slow(w, k_lo, k_hi) and not _slow(w, a, b):
        repeated = pattern[lead + item.start : lead + item.stop]
        raise ValueError(f"minLength / maxLength beside this pattern are not enforced: they make its `{repeated}` "
                         f"`{count}`, which compiles slowly (at most {WRITTEN_OUT} characters under "
                         f"{WRITTEN_OUT + 1} repetitions, {COUNTED} above): bound the length in the "
                         "pattern")  # fmt: skip
    return pattern[: lead + item.end] + count + pattern[lead + item.stop :]
