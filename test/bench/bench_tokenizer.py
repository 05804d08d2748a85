"""Tokenizer throughput: ours vs the `rwkv` package (MB of UTF-8 input per second, best of N).

    python test/bench/bench_tokenizer.py [--scale 5] [--repeat 5]

The package has one World tokenizer implementation, `rwkv.rwkv_tokenizer.TRIE_TOKENIZER`;
`rwkv.utils.PIPELINE(model, "rwkv_vocab_v20230424")` wraps the same class and is measured too.
The corpus is the test suite's mixed corpus (English, Chinese, Japanese, emoji, code, random
code points, random bytes, whitespace runs); every encode is checked against the package's ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test/ (mixed_corpus)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root (server)

from test_tokenizer import mixed_corpus  # noqa: E402

from server.tokenizer import Tokenizer  # noqa: E402
from server.tokenizer.vocab import DEFAULT_VOCAB  # noqa: E402


def best_seconds(fns: list, arg, repeat: int) -> list[float]:
    """Best time of each fn on arg; runs interleaved so load changes hit all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t = time.perf_counter()
            fn(arg)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def timed(what: str, fn):
    t = time.perf_counter()
    out = fn()
    print(f"{what}: {time.perf_counter() - t:.2f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=5, help="corpus size multiplier (1 ~ 100 KB)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement (best is kept)")
    args = ap.parse_args()

    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    from rwkv.utils import PIPELINE

    ours = timed("ours: load vocab", lambda: Tokenizer())
    timed("ours: build encoder", ours.warm_up)
    trie = timed("rwkv TRIE_TOKENIZER: load", lambda: TRIE_TOKENIZER(str(DEFAULT_VOCAB)))
    pipe = PIPELINE(None, "rwkv_vocab_v20230424")
    encoders = {"ours": ours.encode, "rwkv TRIE_TOKENIZER": trie.encode, "rwkv PIPELINE": pipe.encode}

    parts = mixed_corpus(seed=0, scale=args.scale)
    parts["ALL (mixed)"] = "".join(parts.values())
    print(f"\nencode MB/s (best of {args.repeat}); python {sys.version.split()[0]}")
    print(f"{'part':<16}{'KB':>8}" + "".join(f"{name:>22}" for name in encoders) + f"{'speedup':>10}")
    for name, text in parts.items():
        size = len(text.encode("utf-8"))
        assert ours.encode(text) == trie.encode(text), f"ids differ on {name}"
        rates = [size / t / 1e6 for t in best_seconds(list(encoders.values()), text, args.repeat)]
        cols = "".join(f"{r:>22.2f}" for r in rates)
        print(f"{name:<16}{size / 1e3:>8.0f}{cols}{rates[0] / max(rates[1:]):>9.2f}x")

    ids = ours.encode(parts["ALL (mixed)"])
    size = len(ours.decode_bytes(ids))
    rate_ours, rate_pkg = (size / t / 1e6 for t in best_seconds([ours.decode, trie.decode], ids, args.repeat))
    print(f"\ndecode MB/s (ALL): ours {rate_ours:.1f}, rwkv TRIE_TOKENIZER {rate_pkg:.1f}")


if __name__ == "__main__":
    main()
