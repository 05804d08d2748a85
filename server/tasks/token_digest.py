"""Digests of token-id prefixes: SHA-256 over the ids as int32 bytes (Task.tokens' own layout),
taken at several lengths in one incremental pass. The OpenAI routes' conversation cache keys its
states by them; the Responses reuse index finds earlier responses by them."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence


def tokens_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes of an array('i')."""
    return array("i", ids).tobytes()


def history_digest(tokens: Sequence[int]) -> bytes:
    """The SHA-256 of a whole token history (prefix_digests' at its full length): tasks.digest.
    A Task's array('i') is hashed in place (no copy: 100k tokens in ~0.3 ms)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return hashlib.sha256(tokens).digest()
    return hashlib.sha256(tokens_bytes(tokens)).digest()


def prefix_digests(tokens: Sequence[int], lengths: Iterable[int], seed: bytes = b"") -> dict[int, bytes]:
    """The SHA-256 of `seed` then tokens[:n], for each n in `lengths` (each at most len(tokens)),
    hashing the tokens once."""
    h = hashlib.sha256(seed)
    out: dict[int, bytes] = {}
    at = 0
    for n in sorted(lengths):
        h.update(tokens_bytes(tokens[at:n]))
        at = n
        out[n] = h.digest()  # (digest() leaves h open: the next lengths go on from here)
    return out
