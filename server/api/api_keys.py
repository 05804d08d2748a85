"""API keys: how a request's key is read and matched against the configured ones."""

from __future__ import annotations

import hmac


def match_key(keys: frozenset[str], key: str | bytes | None) -> str | None:
    """The configured key equal to `key` (constant-time comparisons on bytes), or None. `key`: a
    header's raw bytes, or a JSON string (its UTF-8). A configured key matches its UTF-8 and,
    where it has one, its Latin-1 encoding: browsers send a header's characters as Latin-1 bytes,
    other clients a non-ASCII key's UTF-8 (compare_digest refuses non-ASCII str, so no str here)."""
    if key is None:
        return None
    got = key if isinstance(key, bytes) else key.encode("utf-8", "surrogatepass")
    return next((k for k in keys if any(hmac.compare_digest(f, got) for f in _key_forms(k))), None)


def _key_forms(key: str) -> tuple[bytes, ...]:
    """The byte strings a client may send for `key` (UTF-8; Latin-1 where it differs)."""
    utf8 = key.encode("utf-8", "surrogatepass")
    try:
        latin = key.encode("latin-1")
    except UnicodeEncodeError:
        return (utf8,)
    return (utf8,) if latin == utf8 else (utf8, latin)


def bearer_token(value: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (None: no such value)."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
