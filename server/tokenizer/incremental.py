"""`IncrementalDecoder`: streaming detokenizer that never splits a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from .tokenizer import Tokenizer, get_tokenizer


class IncrementalDecoder:
    """Turns a stream of token ids into text, one piece per `push` (or `push_one`).

    A token can end in the middle of a multi-byte character; pushing holds back such a trailing
    incomplete sequence (at most 3 bytes) until the bytes that complete it arrive. Bytes that can
    no longer become valid UTF-8 are emitted at once as U+FFFD (never stalls), exactly as
    `Tokenizer.decode` would replace them, so for any split of an id list
    `"".join(push(part) for part in parts) + flush() == tokenizer.decode(all_ids)`.
    Valid text never produces U+FFFD. Not thread-safe (one per stream).

    `push_one(token)` is the engine's per-token path: one lookup in the tokenizer's byte table
    and one step of Python's incremental UTF-8 decoder, no range check (the engine's ids come
    from the sampler, inside the vocabulary); `push(ids)` checks the ids.
    """

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        if tokenizer is None:
            tokenizer = get_tokenizer()
        self._tok = tokenizer
        self._table = tokenizer.token_table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decode = self._utf8.decode

    def push_one(self, token: int) -> str:
        """Add one id in [0, vocab_size) (not checked); return the newly completed text."""
        return self._decode(self._table[token])

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; return the newly completed text (may be ""). ValueError for an id outside
        the vocabulary range."""
        return self._decode(self._tok.decode_bytes(ids))

    def flush(self) -> str:
        """End of stream: return held-back bytes (as U+FFFD, they are incomplete) and reset."""
        out = self._decode(b"", True)
        self._utf8.reset()
        return out

    @property
    def pending(self) -> bytes:
        """Bytes held back waiting for the rest of a character."""
        return self._utf8.getstate()[0]
