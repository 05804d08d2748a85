"""Loader for the RWKV World vocabulary file (`rwkv_vocab_v20230424.txt`).

File format, one token per line: `<id> <python literal> <byte length>`, where the literal is a
Python `str` (stored as its UTF-8 bytes) or `bytes` literal, e.g. `259 '\\t ' 2` or
`125 b'\\x80' 1`. A literal with no backslash is its quotes' contents (98.7% of the lines:
parsing all 65,529 with `ast.literal_eval` was half of the tokenizer's 0.5 s start); the others
are parsed with `ast.literal_eval` (never `eval`), all at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

VOCAB_SIZE = 65536
"""Size of the id space (model embedding rows). Ids without a vocab entry decode to b""."""

DEFAULT_VOCAB = Path(__file__).with_name("rwkv_vocab_v20230424.txt")


def load_vocab(path: str | Path = DEFAULT_VOCAB) -> list[bytes]:
    """Return `table` with `table[id]` = the token's bytes, b"" where the id has no entry.

    Raises ValueError naming the line for a malformed file, a duplicate or out-of-range id,
    a length mismatch, a duplicate token, or a missing single-byte token (the greedy encoder
    needs all 256 so that every input can be encoded).
    """
    ids: list[int] = []
    literals: list[str] = []
    lengths: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            first, last = line.find(" "), line.rfind(" ")
            if first <= 0 or last <= first:
                raise ValueError(f"{path}:{lineno}: expected '<id> <literal> <length>'")
            try:
                ids.append(int(line[:first]))
                lengths.append(int(line[last + 1 :]))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: id and length must be integers") from None
            literals.append(line[first + 1 : last])
    values = _parse(literals)
    table = [b""] * VOCAB_SIZE
    seen: set[bytes] = set()
    for lineno, (idx, value, length) in enumerate(zip(ids, values, lengths), 1):
        token = value.encode("utf-8") if isinstance(value, str) else value
        _check_entry(path, lineno, idx, token, length, table, seen)
        table[idx] = token
        seen.add(token)
    missing = [b for b in range(256) if bytes([b]) not in seen]
    if missing:
        raise ValueError(f"{path}: no single-byte token for byte(s) {missing[:8]}")
    return table


def _parse(literals: list[str]) -> list[str | bytes]:
    """The values of `literals`: one without a backslash between matching quotes is read
    directly (a str literal's text, or a bytes literal's ASCII); the rest by literal_eval."""
    values: list[str | bytes | None] = [None] * len(literals)
    hard: list[int] = []
    for i, lit in enumerate(literals):
        body, is_bytes = (lit[1:], True) if lit[:1] == "b" else (lit, False)
        if len(body) >= 2 and body[0] in "'\"" and body[-1] == body[0] and "\\" not in body:
            inner = body[1:-1]
            if body[0] not in inner and (not is_bytes or inner.isascii()):
                values[i] = inner.encode("ascii") if is_bytes else inner
                continue
        hard.append(i)
    if hard:
        for i, v in zip(hard, ast.literal_eval("[" + ",".join(literals[i] for i in hard) + "]")):
            values[i] = v
    return [v for v in values if v is not None]  # (every slot is filled: the same list)


def _check_entry(path, lineno, idx, token, length, table, seen) -> None:
    where = f"{path}:{lineno}"
    if not isinstance(token, bytes) or not token:
        raise ValueError(f"{where}: token must be a non-empty str or bytes literal")
    if not 0 <= idx < VOCAB_SIZE:
        raise ValueError(f"{where}: id {idx} outside [0, {VOCAB_SIZE})")
    if table[idx]:
        raise ValueError(f"{where}: duplicate id {idx}")
    if len(token) != length:
        raise ValueError(f"{where}: token is {len(token)} bytes, the line says {length}")
    if token in seen:
        raise ValueError(f"{where}: duplicate token {token!r}")
