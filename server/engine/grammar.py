"""Grammars for constrained decoding: GrammarSpecs compiled by xgrammar over the RWKV vocabulary.

    compiler = GrammarCompiler(tokenizer.token_table)       # the vocabulary as raw bytes
    compiled = compiler.compile(GrammarSpec.json_schema(s))  # cached by spec; ValueError if bad

Why xgrammar: docs/agents.md (measured by test/bench/bench_grammar.py). The library gets the
vocabulary as bytes (VocabType.RAW), so tokens that are pieces of a UTF-8 character are matched
byte by byte; ids without bytes (0, 65530..) are special tokens, never allowed, except EOS (0),
which the grammar allows exactly where its language may end.

Each request's state (its matcher, its trigger state) and the engine's per-step mask filling
are in constraints.py.

Module imports are light: xgrammar (which imports torch) loads on the first compile.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from cachetools import LRUCache

from .formats import EXACT_FORMATS, FORMAT_RULES, share_format_rules
from .schema_checks import check_schema
from .types import EOS_TOKEN, GrammarSpec

CACHE_SIZE = 128
"""Compiled grammars kept (LRU by spec)."""
LIBRARY_CACHE_BYTES = 256 << 20
"""The library's own cache (LRU, bytes): its compiled grammars and, what this is for, the token
masks of each rule, reused by every later grammar with the same rule. A format's pattern is one
rule, or a few shared ones (json_schema_grammar): the masks of `hostname` (~0.3 s of CPU on first
compile) or `email` (~0.3 s; 0.16 s after `hostname`, whose labels it shares) are built once per
process, not once per schema that has such a field (docs/agents.md, "String formats")."""

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


JSON_KINDS = ("json_schema", "json_object")


class Compiled:
    """A compiled grammar and, with a trigger, the guard of its free phase. `ban`: an int32
    mask row ANDed into every mask (JSON kinds: no token with a control byte, which the
    library's JSON strings would let through unescaped, invalid JSON; our JSON has no
    whitespace but spaces)."""

    def __init__(self, spec: GrammarSpec, grammar: Any, guard: TriggerGuard | None, ban: Any = None):
        self.spec, self.grammar, self.guard, self.ban = spec, grammar, guard, ban


class GrammarCompiler:
    """Compiles GrammarSpecs for one vocabulary (thread-safe, LRU-cached by spec). The library's
    vocabulary tables are built on the first compile."""

    def __init__(self, token_table: Sequence[bytes], vocab_size: int | None = None, *, threads: int = 0,
                 cache_size: int = CACHE_SIZE):  # fmt: skip
        """threads: the library's worker threads for compiling and for filling a step's masks
        (0: half the CPUs, at most 8: the engine thread and the event loop keep theirs)."""
        V = vocab_size or len(token_table)
        self.table = list(token_table[:V]) + [b""] * max(0, V - len(token_table))
        self.vocab_size = V
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self.cache_size = cache_size
        self._cache: LRUCache[GrammarSpec, Compiled] = LRUCache(maxsize=cache_size)
        self._guards: LRUCache[str, TriggerGuard] = LRUCache(maxsize=cache_size)  # by trigger
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._no_control: Any = None  # the JSON kinds' ban row

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo(self.table, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=[EOS_TOKEN])  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=True,
                                                     cache_limit_bytes=LIBRARY_CACHE_BYTES)  # fmt: skip
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Compiled:
        """The compiled grammar of spec (cached); ValueError with the reason when it cannot be
        compiled (bad kind or source, a recursive JSON schema, a library error)."""
        with self._lock:
            hit = self._cache.get(spec)  # a hit becomes the most recently used
            if hit is not None:
                return hit
        spec.check()
        grammar = self._compile(spec)
        guard = self._guard(spec.trigger) if spec.trigger else None
        out = Compiled(spec, grammar, guard, self._json_ban() if _json_only(spec) else None)
        with self._lock:
            self._cache[spec] = out  # evicts the least recently used beyond cache_size
        return out

    def _compile(self, spec: GrammarSpec):
        comp = self._xgr_compiler()
        kind, src = spec.kind, spec.source
        if kind == "json_schema":
            src = check_schema(src)
        if kind == "any_of":
            return comp.compile_grammar(self._union(spec))
        try:
            if kind == "json_schema" and _has_format_rules(src):
                return comp.compile_grammar(json_schema_grammar(src))
            if kind == "json_schema":
                return comp.compile_json_schema(src, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return comp.compile_regex(src)
            if kind == "lark":
                return comp.compile_lark(src)
            if kind == "ebnf":
                return comp.compile_grammar(src)
            return comp.compile_structural_tag(src)
        except Exception as exc:
            raise ValueError(f"invalid {kind} grammar: {_clean(exc)}") from None

    def _union(self, spec: GrammarSpec):
        """An any_of spec as one library grammar: the union of prefix + alternative."""
        import xgrammar as xgr

        self._xgr_compiler()  # the library's import and vocabulary, once
        parts = []
        for prefix, alt in spec.alternatives():
            if alt.kind == "json_schema":
                alt = GrammarSpec(alt.kind, check_schema(alt.source), alt.trigger)
            try:
                g = _grammar(xgr, alt)
                if prefix:
                    g = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {_literal(prefix)}"), g)
            except Exception as exc:
                raise ValueError(f"invalid any_of grammar: {alt.kind}: {_clean(exc)}") from None
            parts.append(g)
        return parts[0] if len(parts) == 1 else xgr.Grammar.union(*parts)

    def _json_ban(self):
        if self._no_control is None:
            import torch

            ctl = re.compile(rb"[\x00-\x1f]")
            allowed = torch.tensor([not ctl.search(b) for b in self.table], dtype=torch.bool)
            self._no_control = pack_bits(allowed)
        return self._no_control

    def _guard(self, trigger: str) -> TriggerGuard:
        with self._lock:
            g = self._guards.get(trigger)
        if g is None:
            g = TriggerGuard(trigger.encode("utf-8"), self.table)
        with self._lock:
            self._guards[trigger] = g
        return g


def _grammar(xgr: Any, spec: GrammarSpec) -> Any:
    """The library's Grammar of a spec of a single kind (an any_of alternative), written the way
    GrammarCompiler._compile compiles the same kind."""
    kind, src = spec.kind, spec.source
    if kind in JSON_KINDS:
        return json_schema_grammar(src if kind == "json_schema" else '{"type": "object"}')
    if kind == "regex":
        return xgr.Grammar.from_regex(src)
    if kind == "lark":
        return xgr.Grammar.from_lark(src)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(src)
    return xgr.Grammar.from_structural_tag(src)


def json_schema_grammar(source: str) -> Any:
    """The library's Grammar of a checked JSON schema (check_schema), as compile_json_schema
    writes it, with each host-name / e-mail pattern as its format's shared rules (formats.py,
    SHARED_RULES: the same strings, a third of the first compile). That goes through the
    converter's EBNF text; where the text does not read back as the same grammar, it stays."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=True)
    text = str(grammar) if _has_format_rules(source) else ""
    shared = text and share_format_rules(text, _pattern_rules())
    if not shared or str(xgr.Grammar.from_ebnf(text)) != text:
        return grammar
    return xgr.Grammar.from_ebnf(shared)


def _has_format_rules(source: str) -> bool:
    """Whether a checked schema's text has a pattern of formats.FORMAT_RULES."""
    return any(json.dumps(EXACT_FORMATS[fmt]) in source for fmt in FORMAT_RULES)


@functools.cache
def _pattern_rules() -> dict[str, str]:
    """{the converter's EBNF body of a FORMAT_RULES pattern: the name of the format's rule}."""
    import xgrammar as xgr

    out = {}
    for fmt, rule in FORMAT_RULES.items():
        schema = json.dumps({"type": "string", "pattern": EXACT_FORMATS[fmt]})
        text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
        out.update({ln.partition(" ::= ")[2]: rule for ln in text.splitlines() if " ::= Regex(" in ln})
    return out


def _literal(text: str) -> str:
    """text as an EBNF string literal (the library takes JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _json_only(spec: GrammarSpec) -> bool:
    """Whether every output of spec is JSON (after a prefix): the control-byte ban applies."""
    if spec.kind == "any_of":
        alts = spec.alternatives()
        return all(a.kind in JSON_KINDS and not _CONTROL.search(p) for p, a in alts)
    return spec.kind in JSON_KINDS


_CONTROL = re.compile(r"[\x00-\x1f]")


def _clean(exc: BaseException) -> str:
    """The library's message without its C++ source location prefix."""
    lines = [_CPP_PREFIX.sub("", ln).strip() for ln in str(exc).strip().splitlines()]
    return " ".join(ln for ln in lines if ln)[:500] or type(exc).__name__


class TriggerGuard:
    """The free phase of a triggered grammar: tracks how much of the trigger the output ends
    with (state k = bytes matched, as in Knuth-Morris-Pratt) and which tokens must not be
    sampled in each state: those that would complete the trigger and go on past its end."""

    def __init__(self, trigger: bytes, table: Sequence[bytes]):
        self.trigger = trigger
        self.V = len(table)
        last = trigger[-1:]
        L = len(trigger)
        self._forbid: dict[int, list[int]] = {}
        for tid, tb in enumerate(table):
            if not tb or last not in tb:
                continue
            for k in range(L):
                s = trigger[:k] + tb
                i = s.find(trigger)
                if i >= 0 and i + L < len(s):
                    self._forbid.setdefault(k, []).append(tid)
        self._rows: dict[int, Any] = {}  # state -> its mask row (built on first use)

    def step(self, k: int, token: bytes) -> tuple[int, bytes | None]:
        """(the new state, None) or (-, the bytes after the trigger) when it completed."""
        s = self.trigger[:k] + token
        i = s.find(self.trigger)
        if i >= 0:
            return 0, s[i + len(self.trigger) :]
        for j in range(min(len(self.trigger) - 1, len(s)), 0, -1):
            if s.endswith(self.trigger[:j]):
                return j, None
        return 0, None

    def mask_row(self, k: int):
        """The int32 bitmask row of state k (every token but the forbidden ones), or None when
        state k forbids nothing."""
        ids = self._forbid.get(k)
        if not ids:
            return None
        row = self._rows.get(k)
        if row is None:
            import torch

            allowed = torch.ones(self.V, dtype=torch.bool)
            allowed[ids] = False
            row = self._rows[k] = pack_bits(allowed)
        return row


def pack_bits(allowed) -> Any:
    """A (V,) bool tensor as a (ceil(V/32),) int32 bitmask (bit j of word w = token 32w + j)."""
    import torch

    V = allowed.shape[0]
    W = (V + 31) // 32
    bits = torch.zeros(W * 32, dtype=torch.int64)
    bits[:V] = allowed.to(torch.int64)
    words = (bits.view(W, 32) << torch.arange(32)).sum(1)  # (W,) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
