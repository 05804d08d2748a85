"""Greedy longest-match tokenization as one compiled regular expression.

The vocabulary is laid out as a byte trie and written as a regex in which every trie node is an
alternation over its children, one branch per next byte, with an extra empty branch when the
node itself is a token. Branches of one alternation start with distinct bytes, so at most one can
match; a branch that cannot reach a token fails and the alternation falls back to the empty
branch, i.e. to the longest token seen so far on the path. `pattern.findall(data)` is therefore
the greedy longest-match segmentation, done entirely inside the C regex engine (every single byte
is a token, so matches are contiguous and cover the input).

Speed comes from `re`'s quick rejection of a branch whose first op is a literal or a character
class that does not match: children that are leaves go first as one character class, then
children ordered by subtree size (a proxy for frequency), with common ASCII punctuation and
whitespace, and the lead bytes of emoji (0xF0) and of U+FFFD / full-width forms (0xEF), first at
the root. Measured by test/bench/bench_tokenizer.py.
"""

from __future__ import annotations

import re

_ROOT_FIRST = frozenset(b" \n.,()_:='\"-\t\r\xf0\xef")

_Node = dict  # byte -> child node; key None present when the path is a token


def build_trie(tokens: list[bytes]) -> _Node:
    root: _Node = {}
    for token in tokens:
        node = root
        for byte in token:
            node = node.setdefault(byte, {})
        node[None] = True
    return root


def _sizes(root: _Node) -> dict[int, int]:
    """Tokens per subtree, keyed by id(node); iterative post-order."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = [c for b, c in node.items() if b is not None]
        if done:
            sizes[id(node)] = (None in node) + sum(sizes[id(c)] for c in kids)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in kids)
    return sizes


def _esc(byte: int) -> str:
    return chr(byte) if chr(byte).isascii() and chr(byte).isalnum() else f"\\x{byte:02x}"


def _emit(node: _Node, sizes: dict[int, int], depth: int) -> str:
    kids = [(b, c) for b, c in node.items() if b is not None]
    boost = _ROOT_FIRST if depth == 0 else frozenset()
    kids.sort(key=lambda bc: (bc[0] not in boost, -sizes[id(bc[1])], bc[0]))
    leaves = sorted(b for b, c in kids if len(c) == 1 and None in c)
    alts = []
    if leaves:
        alts.append(_esc(leaves[0]) if len(leaves) == 1 else "[" + "".join(map(_esc, leaves)) + "]")
    alts += [_esc(b) + _emit(c, sizes, depth + 1) for b, c in kids if not (len(c) == 1 and None in c)]
    if depth > 0 and None in node:
        return "(?:" + "|".join(alts) + "|)"  # empty branch: stop here, this prefix is a token
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def compile_greedy(tokens: list[bytes]) -> re.Pattern[bytes]:
    """Compile a bytes pattern whose `findall` yields the greedy longest-match tokens."""
    root = build_trie(tokens)
    source = _emit(root, _sizes(root), 0)  # recursion depth = longest token (128 bytes)
    return re.compile(source.encode("latin-1"))
