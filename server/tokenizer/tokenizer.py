"""`Tokenizer`: RWKV World encode/decode over a 65536-id space."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .trie_regex import compile_greedy
from .vocab import DEFAULT_VOCAB, VOCAB_SIZE, load_vocab

_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """Greedy longest-match byte-level tokenizer (the RWKV World tokenizer).

    Immutable after construction and safe to share between threads. Text with the shipped
    vocabulary is encoded by `pyrwkv_tokenizer` (a compiled implementation of the same greedy
    longest match with the same vocabulary: ready at once, ~10x faster than the regex; a test
    checks the two agree on every token and on mixed text). Raw bytes, and any other vocabulary
    file, go through the compiled regex of trie_regex.py (built on first use or by `warm_up()`).
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(self, vocab_path: str | Path = DEFAULT_VOCAB) -> None:
        self._bytes: tuple[bytes, ...] = tuple(load_vocab(vocab_path))  # id -> bytes (b"" when no entry)
        self._ids: dict[bytes, int] = {t: i for i, t in enumerate(self._bytes) if t}
        self._pattern: re.Pattern[bytes] | None = None
        self._lock = threading.Lock()
        self._fast = _fast_encoder() if Path(vocab_path) == DEFAULT_VOCAB else None

    def warm_up(self) -> Tokenizer:
        """Build the encoder now (otherwise the first `encode` does it; nothing to build when the
        compiled encoder serves this vocabulary)."""
        if self._fast is None:
            self._matcher()
        return self

    def _matcher(self) -> re.Pattern[bytes]:
        if self._pattern is None:
            with self._lock:
                if self._pattern is None:
                    self._pattern = compile_greedy(list(self._ids))
        return self._pattern

    @property
    def token_table(self) -> tuple[bytes, ...]:
        """The bytes of every id in [0, vocab_size) (b"" where there is no entry)."""
        return self._bytes

    # --- encode -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`'s UTF-8 bytes. Lone surrogates (not encodable) become U+FFFD."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            text = _SURROGATE.sub("\ufffd", text)
            data = text.encode("utf-8")
        if self._fast is not None:
            return list(self._fast.encode(text))
        return self.encode_bytes(data)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes (greedy longest match, left to right)."""
        return list(map(self._ids.__getitem__, self._matcher().findall(data)))

    # --- decode -------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id; b"" for ids without an entry (0, 65530..65535)."""
        if not 0 <= token_id < VOCAB_SIZE:
            raise ValueError(_range_msg(token_id))
        return self._bytes[token_id]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of `ids`. ValueError for an id outside [0, 65536)."""
        if not isinstance(ids, (list, tuple)):
            ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= VOCAB_SIZE):
            bad = next(i for i in ids if not 0 <= i < VOCAB_SIZE)
            raise ValueError(_range_msg(bad))
        return b"".join(map(self._bytes.__getitem__, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """UTF-8 text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD
        (Python's errors="replace": one U+FFFD per maximal invalid subsequence)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


_instance: Tokenizer | None = None
_lock = threading.Lock()


def get_tokenizer() -> Tokenizer:
    """The shared tokenizer for the shipped vocab (loaded once; the encoder builds on first use,
    or call `get_tokenizer().warm_up()` at startup)."""
    global _instance
    if _instance is None:
        with _lock:
            if _instance is None:
                _instance = Tokenizer()
    return _instance


def _fast_encoder() -> Any:
    """The compiled World-vocabulary encoder, or None where the package is missing."""
    try:
        import pyrwkv_tokenizer
    except ImportError:  # the regex encoder serves
        return None
    return pyrwkv_tokenizer.RWKVTokenizer()


def _range_msg(token_id: object) -> str:
    return f"token id {token_id!r} is outside the vocabulary range [0, {VOCAB_SIZE})"
