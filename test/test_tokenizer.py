"""Tokenizer: same ids as the `rwkv` package, lossless round trip, streaming decode, id range."""

from __future__ import annotations

import argparse
import difflib
import inspect
import json.decoder
import random
import textwrap

import pytest
from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

from server.tokenizer import VOCAB_SIZE, IncrementalDecoder, Tokenizer, get_tokenizer
from server.tokenizer.vocab import DEFAULT_VOCAB, load_vocab

ZH = (
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的"
    "智能机器。该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。北京是中华人民共和国的"
    "首都，也是全国的政治中心和文化中心。今天天气很好，我们去公园散步吧！《红楼梦》成书于清代乾隆年间。"
)
JA = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。東京都は日本の首都であり、人口は約"
    "千四百万人です。コンピューターのプログラミングを勉強しています。ひらがな、カタカナ、漢字。ｶﾀｶﾅ半角。"
)
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "❤️", "🔥", "🤖", "🧑🏿‍💻", "✅", "🏳️‍🌈", "😂", "🙏"]
EMOJI_WORDS = ["ok", " yes", "!", " ", "\n", "good job", "。", "最高"]


def random_codepoints(rng: random.Random, n: int) -> str:
    """Code points from every UTF-8 length class (surrogates, not encodable, become spaces)."""
    cps = (rng.randrange(rng.choice([0x80, 0x800, 0x3000, 0x10000, 0x110000])) for _ in range(n))
    return "".join(" " if 0xD800 <= cp < 0xE000 else chr(cp) for cp in cps)


def random_bytes_text(rng: random.Random, n: int) -> str:
    return bytes(rng.randrange(256) for _ in range(n)).decode("utf-8", errors="replace")


def mixed_corpus(seed: int = 0, scale: int = 1) -> dict[str, str]:
    """Named corpus parts: English prose, Chinese, Japanese, emoji, code, random text, spacing."""
    rng = random.Random(seed)
    mods = [argparse, difflib, random, textwrap, json, inspect]
    spaces = (rng.choice([" ", "\t", "\n", "\r\n"]) * rng.randrange(1, 200) + "x" for _ in range(100))
    emoji = (rng.choice(EMOJI if rng.random() < 0.6 else EMOJI_WORDS) for _ in range(2000 * scale))
    return {
        "english": "\n\n".join(m.__doc__ or "" for m in mods) * scale,
        "chinese": ZH * 8 * scale,
        "japanese": JA * 8 * scale,
        "emoji": "".join(emoji),
        "code": (inspect.getsource(json.decoder) + inspect.getsource(textwrap)) * scale,
        "random_unicode": random_codepoints(rng, 5000 * scale),
        "random_bytes": random_bytes_text(rng, 10000 * scale),
        "whitespace": "".join(spaces) * scale,
    }


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer().warm_up()


@pytest.fixture(scope="module")
def ref() -> TRIE_TOKENIZER:
    return TRIE_TOKENIZER(str(DEFAULT_VOCAB))


@pytest.fixture(scope="module")
def corpus() -> dict[str, str]:
    return mixed_corpus()


def test_singleton_and_size():
    assert get_tokenizer() is get_tokenizer()
    assert get_tokenizer().vocab_size == VOCAB_SIZE == 65536


def test_same_ids_as_package_on_mixed_corpus(tok, ref, corpus):
    for name, text in corpus.items():
        assert tok.encode(text) == ref.encode(text), name
    whole = "".join(corpus.values())
    rng = random.Random(1)
    for _ in range(300):  # many short pieces: starts and ends land anywhere
        a = rng.randrange(len(whole))
        piece = whole[a : a + rng.randrange(1, 40)]
        assert tok.encode(piece) == ref.encode(piece), piece


def test_same_ids_as_package_on_token_soup(tok, ref):
    """Texts glued from random vocab entries: long matches that almost continue, and stop."""
    rng = random.Random(2)
    table = load_vocab()
    for _ in range(200):
        data = b"".join(table[rng.randrange(1, 65530)] for _ in range(rng.randrange(1, 30)))
        text = data.decode("utf-8", errors="replace")
        assert tok.encode(text) == ref.encode(text)
        assert tok.encode_bytes(data) == ref.encodeBytes(data)


def test_raw_bytes_round_trip(tok, ref):
    rng = random.Random(3)
    for n in (0, 1, 2, 7, 100, 5000):
        data = bytes(rng.randrange(256) for _ in range(n))
        ids = tok.encode_bytes(data)
        assert ids == ref.encodeBytes(data)
        assert tok.decode_bytes(ids) == data


def test_decode_encode_round_trip(tok, corpus):
    rng = random.Random(4)
    texts = list(corpus.values()) + ["", "a", " " * 300, "\x00\x01\n", "\ufffd"]
    texts += [random_codepoints(rng, rng.randrange(1, 50)) for _ in range(200)]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_lone_surrogate_encodes_as_replacement(tok):
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_greedy_longest_match_backs_off(tmp_path, ref):
    """'abcde' is a token but 'abcd' is not: 'abcdx' must give 'abc','d','x' (not fail)."""
    lines = [f"{i + 1} {bytes([i])!r} 1" for i in range(256)]
    lines += ["257 'abc' 3", "258 'abcde' 5", "259 '你' 3", "260 b'\\xe4\\xbd' 2"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    small, small_ref = Tokenizer(path), TRIE_TOKENIZER(str(path))
    for data in [b"abcdx", b"abcde", b"abcdeabcd", b"ab", b"\xe4\xbd\xa0\xe4\xbd\xe4"]:
        assert small.encode_bytes(data) == small_ref.encodeBytes(data)
    assert small.encode_bytes(b"abcdx") == [257, ord("d") + 1, ord("x") + 1]


def test_bad_vocab_files_are_rejected(tmp_path):
    cases = {
        "noline": "1\n",
        "len": "1 'a' 2\n",
        "dupid": "1 'a' 1\n1 'b' 1\n",
        "range": "70000 'a' 1\n",
        "bytes": "1 'a' 1\n",  # only one of the 256 single-byte tokens
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.txt"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError):
            load_vocab(path)


def test_every_id_decodes(tok, ref):
    for i in range(VOCAB_SIZE):
        tok.decode([i])
        assert tok.decode_bytes([i]) == tok.token_bytes(i) == ref.idx2token.get(i, b"")
    assert tok.decode_bytes(range(VOCAB_SIZE)) == ref.decodeBytes(range(1, 65530))
    for i in [0, 65530, 65531, 65532, 65533, 65534, 65535]:
        assert tok.token_bytes(i) == b"" and tok.decode([i]) == ""
    assert all(tok.token_bytes(i) for i in range(1, 65530))


def test_out_of_range_ids_raise(tok):
    for bad in (-1, VOCAB_SIZE, 10**9):
        for call in (lambda: tok.decode([1, bad]), lambda: tok.decode_bytes([bad]),
                     lambda: tok.token_bytes(bad), lambda: IncrementalDecoder(tok).push([bad])):
            with pytest.raises(ValueError, match=r"outside the vocabulary range \[0, 65536\)"):
                call()


def _streamed(tok: Tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    dec = IncrementalDecoder(tok)
    bounds = [0, *sorted(cuts), len(ids)]
    return [dec.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])] + [dec.flush()]


def test_incremental_every_split(tok):
    texts = ["👨‍👩‍👧‍👦🇯🇵 ok", "日本語のテキスト、中文。", "héllo wörld ✅", "\ufffd literal"]
    for text in texts:
        ids = tok.encode(text)
        for cut in range(len(ids) + 1):
            assert "".join(_streamed(tok, ids, [cut])) == text
        pieces = _streamed(tok, ids, list(range(1, len(ids))))  # one token per push
        assert "".join(pieces) == text
        if "\ufffd" not in text:
            assert not any("\ufffd" in p for p in pieces)


def test_incremental_random_splits_of_valid_text(tok, corpus):
    rng = random.Random(5)
    for name, text in corpus.items():
        ids = tok.encode(text[:3000])
        for _ in range(5):
            cuts = [rng.randrange(len(ids) + 1) for _ in range(rng.randrange(1, 60))]
            pieces = _streamed(tok, ids, cuts)
            assert "".join(pieces) == tok.decode(ids), name
            if "\ufffd" not in text:
                assert not any("\ufffd" in p for p in pieces), name


def test_incremental_random_ids_match_full_decode(tok):
    """Invalid UTF-8 (random ids, lone high bytes, unassigned ids) never stalls or diverges."""
    rng = random.Random(6)
    high = list(range(129, 257))  # ids of the single bytes 0x80..0xff
    for _ in range(300):
        pool = rng.choice([high, range(VOCAB_SIZE), [0, 65535, *high, *range(10000, 10100)]])
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        cuts = [rng.randrange(len(ids) + 1) for _ in range(rng.randrange(0, 10))]
        assert "".join(_streamed(tok, ids, cuts)) == tok.decode(ids)
        dec = IncrementalDecoder(tok)
        for i in ids:
            dec.push([i])
            assert len(dec.pending) <= 3


def test_incremental_holds_back_only_incomplete(tok):
    dec = IncrementalDecoder(tok)
    first = [b + 1 for b in "😀".encode()]  # single-byte token ids: id = byte + 1
    assert dec.push(first[:2]) == "" and dec.pending == "😀".encode()[:2]
    assert dec.push(first[2:]) == "😀" and dec.pending == b""
    assert dec.push([0xF0 + 1]) == ""  # could still become a character
    assert dec.push([ord("A") + 1]) == "\ufffdA"  # can't any more: emitted, not stalled
    assert dec.push([0xE4 + 1]) == "" and dec.flush() == "\ufffd"
    assert dec.push(tok.encode("ok")) == "ok"  # reusable after flush


def test_push_one_is_push_of_one_id(tok, corpus):
    """The engine's per-token path (a table lookup, no range check) gives what push([id]) gives,
    and the pieces add up to decode (valid text: never a split character)."""
    rng = random.Random(7)
    cases = [tok.encode(t[:2000]) for t in corpus.values()]
    cases += [[rng.randrange(VOCAB_SIZE) for _ in range(200)], [0xF0 + 1, 0x9F + 1, ord("A") + 1, 0xE4 + 1]]
    for ids in cases:
        a, b = IncrementalDecoder(tok), IncrementalDecoder(tok)
        one = [a.push_one(i) for i in ids] + [a.flush()]
        assert one == [b.push([i]) for i in ids] + [b.flush()]
        assert "".join(one) == tok.decode(ids)
        if "\ufffd" not in tok.decode(ids):
            assert not any("\ufffd" in p for p in one)


def test_compiled_encoder_agrees_with_the_regex_on_every_token_and_on_text(tok, corpus):
    """The shipped vocabulary is encoded by pyrwkv_tokenizer; the regex encoder (raw bytes, other
    vocabularies) must give the same ids: every token that is valid UTF-8 encodes to itself, and
    mixed text (with a lone surrogate) encodes the same both ways."""
    if tok._fast is None:
        pytest.skip("pyrwkv_tokenizer is not installed (pip install '.[test]')")
    for i, b in enumerate(tok.token_table):
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if b:
            assert tok.encode(text) == [i], i
    for text in [*corpus.values(), "lone \ud800 surrogate", "✿prefix✿✿suffix✿x✿middle✿y"]:
        fixed = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)  # what encode() does
        assert tok.encode(text) == tok.encode_bytes(fixed.encode("utf-8"))


def test_literals_read_without_literal_eval_are_its_values(tmp_path):
    """load_vocab reads a literal with no backslash from between its quotes: every form must give
    what ast.literal_eval gives (the file's 840 escaped literals and the rest go through it)."""
    import ast

    extra = ["'plain'", '"it\'s"', "'say \"hi\"'", "b'ascii'", "b\"q'\"", "u'uni'", "'日本'", "'\\t\\n'",
             "b'\\xfe\\xff'", "'a' 'b'", "r'raw'", "B'up'"]
    values = [ast.literal_eval(lit) for lit in extra]
    lines = [f"{i + 1} {bytes([i])!r} 1" for i in range(256)]
    for n, (lit, v) in enumerate(zip(extra, values)):
        size = len(v.encode("utf-8") if isinstance(v, str) else v)
        lines.append(f"{300 + n} {lit} {size}")
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    table = load_vocab(path)
    assert [table[300 + n] for n in range(len(extra))] == [v.encode("utf-8") if isinstance(v, str) else v
                                                          for v in values]
    for bad in ("b'é'", "'open", "f'x'"):  # not a plain literal: refused as before
        path.write_text("\n".join([*lines[:256], f"400 {bad} 2"]) + "\n", encoding="utf-8")
        with pytest.raises((ValueError, SyntaxError)):
            load_vocab(path)
