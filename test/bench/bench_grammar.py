"""Grammar libraries compared for constrained decoding with the RWKV World vocabulary (65,536
byte-level tokens, given to each library as raw bytes): per-step token-mask cost at batch B,
compile time per schema, and how each handles
tokens that are not valid UTF-8 on their own (the vocabulary has 486 of them: pieces of
multi-byte characters).

    PYTHONPATH=. python test/bench/bench_grammar.py                       # all libraries, B = 64, 256
    PYTHONPATH=. python test/bench/bench_grammar.py --libs xgrammar --batches 256 --threads 1,2

Per step, every row's matcher fills its row of a (B, V/32) int32 bitmask (the library's batch
API where it has one, else a loop), then accepts the row's next token. Rows follow different
documents valid for the schema, tokenized greedily by the RWKV tokenizer (the tokens a model
would emit); every row's next token is checked against its mask ("violations": tokens of a
valid document that the mask forbids; must be 0). docs/agents.md holds the table this printed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.tokenizer import get_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "role", "tags", "address", "active", "scores"],
    "additionalProperties": False,
}
"""A realistic structured-output schema: nested object, enum, arrays, strings, a pattern."""

WORDS = "alpha beta gamma delta river stone cloud 北京 上海 数据 模型 café naïve".split()


def documents(n: int, seed: int = 0) -> list[str]:
    """n JSON documents valid for SCHEMA (compact separators, as a constrained model writes them)."""
    rng = random.Random(seed)
    w = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for _ in range(n):
        doc = {
            "name": w(rng.randint(1, 3)), "age": rng.randint(0, 99), "role": rng.choice(["admin", "user", "guest"]),
            "tags": [w(1) for _ in range(rng.randint(0, 4))],
            "address": {"street": w(2), "city": w(1), "zip": f"{rng.randint(0, 99999):05d}"},
            "active": rng.random() < 0.5, "scores": [round(rng.uniform(-5, 5), 2) for _ in range(rng.randint(0, 3))],
        }  # fmt: skip
        out.append(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))
    return out


# --- the libraries ----------------------------------------------------------------------------
class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)

    def compile(self, kind: str, source: str):
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def fill_one(self, m, bitmask, i: int) -> None:
        import torch

        m.fill_next_token_bitmask(torch.from_numpy(bitmask), i)

    def accept(self, m, tok: int) -> bool:
        return m.accept_token(tok)


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes], threads: int):
        import llguidance as llg
        import llguidance.numpy as lln

        self.llg, self.lln = llg, lln

        class Wrapper:  # what LLTokenizer reads of a tokenizer: bytes per id, EOS, an encoder
            eos_token_id, bos_token_id, special_token_ids = 0, None, []
            tokens = vocab

            def __call__(self, s):
                return get_tokenizer().encode_bytes(s if isinstance(s, bytes) else s.encode())

        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(Wrapper()))
        self.executor = llg.LLExecutor(threads)

    def compile(self, kind: str, source: str):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}' if kind == "json_object" else source,
            defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
        )  # fmt: skip
        err = self.llg.LLMatcher.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers, bitmask) -> None:
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one(self, m, bitmask, i: int) -> None:
        self.lln.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, tok: int) -> bool:
        return m.consume_token(tok)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: list[bytes], threads: int):
        import outlines_core as oc

        self.oc = oc
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b:
                table.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(0, table)

    def compile(self, kind: str, source: str):
        if kind == "json_object":
            raise NotImplementedError("no JSON-object grammar: regular languages only (no recursion)")
        regex = self.oc.json_schema.build_regex_from_schema(source, None)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            self.fill_one(m, bitmask, i)

    def fill_one(self, m, bitmask, i: int) -> None:
        row = bitmask[i]
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def accept(self, m, tok: int) -> bool:
        try:
            m.advance(tok)
            return True
        except Exception:  # noqa: BLE001 - a rejected token
            return False


LIBS = {c.name: c for c in (XGrammar, LLGuidance, OutlinesCore)}


def allowed(bitmask: np.ndarray, i: int, tok: int) -> bool:
    return bool((int(bitmask[i, tok >> 5]) >> (tok & 31)) & 1)


# --- measurements ---------------------------------------------------------------------------------
def step_cost(lib, compiled, docs: list[list[int]], B: int, steps: int) -> dict:
    """Mean ms per step to fill B rows' masks (and to accept B tokens); mask violations."""
    V = 65536
    bitmask = np.full((B, V // 32), -1, dtype=np.int32)
    matchers = [lib.matcher(compiled) for _ in range(B)]
    rows = [docs[i % len(docs)] for i in range(B)]
    n = min(steps, min(len(r) for r in rows))
    fill_t, acc_t, bad = [], [], 0
    for s in range(n):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        bad += sum(not allowed(bitmask, i, rows[i][s]) for i in range(B))
        t2 = time.perf_counter()
        for i, m in enumerate(matchers):
            lib.accept(m, rows[i][s])
        t3 = time.perf_counter()
        fill_t.append(t1 - t0)
        acc_t.append(t3 - t2)
    return {"steps": n, "fill_ms": 1e3 * statistics.mean(fill_t), "fill_p50_ms": 1e3 * statistics.median(fill_t),
            "accept_ms": 1e3 * statistics.mean(acc_t), "violations": bad}  # fmt: skip


def utf8_pieces(lib, compiled, tok) -> dict:
    """Inside a JSON string: are tokens that are pieces of a UTF-8 character allowed, and does a
    character spelled as single-byte tokens go through?"""
    table = tok.token_table
    m = lib.matcher(compiled)
    ok = all(lib.accept(m, t) for t in tok.encode('{"name":"'))
    bitmask = np.full((1, 65536 // 32), -1, dtype=np.int32)
    lib.fill_one(m, bitmask, 0)
    pieces = [i for i, b in enumerate(table) if b and not _utf8(b)]
    n_allowed = sum(allowed(bitmask, 0, i) for i in pieces)
    split = [tok.encode_bytes(bytes([b]))[0] for b in "模".encode()]  # one character, three byte tokens
    ok_split = ok and all(lib.accept(m, t) for t in split) and all(lib.accept(m, t) for t in tok.encode('型"'))
    return {"pieces_allowed": f"{n_allowed}/{len(pieces)}", "char_as_bytes_accepted": ok_split}


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", default="1,2", help="worker threads of the batch fill (comma-separated)")
    a = ap.parse_args()
    tok = get_tokenizer()
    vocab = list(tok.token_table)
    schema = json.dumps(SCHEMA)
    docs = [tok.encode(d) for d in documents(64)]
    for name in a.libs.split(","):
        for threads in [int(t) for t in a.threads.split(",")]:
            t0 = time.perf_counter()
            lib = LIBS[name](vocab, threads)
            setup = time.perf_counter() - t0
            print(f"{name} (threads={threads}): vocabulary setup {setup * 1e3:.0f} ms", flush=True)
            for kind in ("json_schema", "json_object"):
                try:
                    t0 = time.perf_counter()
                    compiled = lib.compile(kind, schema)
                    t1 = time.perf_counter()
                    lib.matcher(compiled)
                    t2 = time.perf_counter()
                except NotImplementedError as exc:
                    print(f"  {kind}: {exc}")
                    continue
                line = f"  {kind}: compile {1e3 * (t1 - t0):.1f} ms, matcher {1e3 * (t2 - t1):.2f} ms"
                if threads == 1:
                    line += f", {utf8_pieces(lib, compiled, tok)}"
                print(line, flush=True)
                for B in [int(b) for b in a.batches.split(",")]:
                    r = step_cost(lib, compiled, docs, B, a.steps)
                    print(f"    B={B:4d}: fill {r['fill_ms']:8.2f} ms/step (p50 {r['fill_p50_ms']:.2f}), "
                          f"accept {r['accept_ms']:.2f} ms/step, violations {r['violations']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
