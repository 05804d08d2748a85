"""RWKV World tokenizer (vocab `rwkv_vocab_v20230424.txt`, shipped here) and a streaming decoder.

    from server.tokenizer import get_tokenizer, Tokenizer, IncrementalDecoder
    tok = get_tokenizer()                      # cached singleton
    ids = tok.encode("Hello 世界")              # list[int]
    tok.decode(ids); tok.decode_bytes(ids); tok.token_bytes(ids[0])
    dec = IncrementalDecoder(tok); text = dec.push(ids[:1]) + dec.push(ids[1:]) + dec.flush()
    dec.push_one(ids[0])                       # the per-token path (no range check)

Facts and choices:
- Encoding is greedy longest match over the text's UTF-8 bytes, left to right, identical to the
  `rwkv` package's `TRIE_TOKENIZER`. Every one of the 256 bytes is a token, so any text encodes.
  Lone surrogates (not encodable as UTF-8) are replaced by U+FFFD before encoding.
- The id space is `vocab_size = 65536`. Ids 0 and 65530..65535 have no vocabulary entry (0 is
  used as end-of-text by RWKV models) and decode to b"" / "" -- a model can sample them, so
  decoding never raises for any id in [0, 65536). Ids outside that range raise ValueError.
- `decode` joins the bytes and decodes UTF-8 with errors="replace": only byte sequences that are
  genuinely invalid UTF-8 (e.g. a lone token in the middle of a character) become U+FFFD.
- `IncrementalDecoder.push` returns only complete characters; concatenating every push and the
  final `flush` equals `decode` of all ids, however the ids were split.
"""

from __future__ import annotations

from .incremental import IncrementalDecoder
from .tokenizer import Tokenizer, get_tokenizer
from .vocab import VOCAB_SIZE

__all__ = ["VOCAB_SIZE", "IncrementalDecoder", "Tokenizer", "get_tokenizer"]
