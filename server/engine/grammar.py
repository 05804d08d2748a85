"""Constrained decoding: grammars (xgrammar) over the RWKV vocabulary, one constraint per request.

    compiler = GrammarCompiler(tokenizer.token_table)       # the vocabulary as raw bytes
    compiled = compiler.compile(GrammarSpec.json_schema(s))  # cached by spec; ValueError if bad
    c = Constraint(compiled)                                  # one request's state
    c.feed(token); c.fill(bitmask, j)                         # the allowed next tokens, into a row

Why xgrammar: docs/agents.md (measured by test/bench/bench_grammar.py). The library gets the
vocabulary as bytes (VocabType.RAW), so tokens that are pieces of a UTF-8 character are matched
byte by byte; ids without bytes (0, 65530..) are special tokens, never allowed, except EOS (0),
which the grammar allows exactly where its language may end.

`Constraints` is the engine's side (engine thread): it follows the scheduler's plans (which
request decodes in which row), feeds each constrained row its new output token, and, while the
device runs a step's forward, fills the rows' masks (server.engine.runner calls `fill`).

Module imports are light: xgrammar (which imports torch) loads on the first compile.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .plan import MoveOp, StepOutput, StepPlan
from .types import EOS_TOKEN, GrammarSpec

CACHE_SIZE = 128
"""Compiled grammars kept (LRU by spec)."""

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
    vocabulary tables are built on the first compile (or by `warm_up()`)."""

    def __init__(self, token_table: Sequence[bytes], vocab_size: int | None = None, *, threads: int = 2,
                 cache_size: int = CACHE_SIZE):  # fmt: skip
        V = vocab_size or len(token_table)
        self.table = list(token_table[:V]) + [b""] * max(0, V - len(token_table))
        self.vocab_size = V
        self.threads = threads
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Compiled] = OrderedDict()
        self._guards: dict[str, TriggerGuard] = {}
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._no_control: Any = None  # the JSON kinds' ban row

    def warm_up(self) -> GrammarCompiler:
        self._xgr_compiler()
        return self

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo(self.table, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=[EOS_TOKEN])  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Compiled:
        """The compiled grammar of spec (cached); ValueError with the reason when it cannot be
        compiled (bad kind or source, a recursive JSON schema, a library error)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        spec.check()
        grammar = self._compile(spec)
        guard = self._guard(spec.trigger) if spec.trigger else None
        out = Compiled(spec, grammar, guard, self._json_ban() if spec.kind in JSON_KINDS else None)
        with self._lock:
            self._cache[spec] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def _compile(self, spec: GrammarSpec):
        comp = self._xgr_compiler()
        kind, src = spec.kind, spec.source
        if kind == "json_schema":
            check_schema(src)
        try:
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
        except Exception as exc:  # noqa: BLE001 - the library's errors are RuntimeError/ValueError/...
            raise ValueError(f"invalid {kind} grammar: {_clean(exc)}") from None

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


def _clean(exc: BaseException) -> str:
    """The library's message without its C++ source location prefix."""
    lines = [_CPP_PREFIX.sub("", ln).strip() for ln in str(exc).strip().splitlines()]
    return " ".join(ln for ln in lines if ln)[:500] or type(exc).__name__


def check_schema(source: str) -> None:
    """ValueError for text that is not a JSON object, or a schema whose local $refs recurse
    (a schema that contains itself: the output would have no bound on its nesting)."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise ValueError(f"invalid json_schema grammar: not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("invalid json_schema grammar: a schema is a JSON object")

    def refs(node) -> list[str]:
        out, todo = [], [node]
        while todo:
            n = todo.pop()
            if isinstance(n, dict):
                r = n.get("$ref")
                if isinstance(r, str) and r.startswith("#"):
                    out.append(r)
                todo.extend(n.values())
            elif isinstance(n, list):
                todo.extend(n)
        return out

    def resolve(ptr: str):
        node = schema
        for part in [p for p in ptr[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def visit(ptr: str, path: tuple[str, ...]) -> None:
        for r in refs(resolve(ptr)):
            if r in path:
                raise ValueError(f"invalid json_schema grammar: recursive schema ({r!r} refers to itself)")
            visit(r, path + (r,))

    visit("#", ("#",))


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


class Constraint:
    """One request's constraint: the grammar matcher (from the first token, or once the trigger
    appeared), the trigger state before that, and the output tokens not fed yet."""

    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.matcher: Any = None
        self.k = 0  # trigger bytes matched (free phase)
        self.pending: list[int] = []
        self.error: str | None = None
        if compiled.guard is None:
            self._start(b"")

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def _start(self, tail: bytes) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.compiled.grammar)
        if tail and not self.matcher.accept_string(tail):
            self.error = f"the text after the trigger ({tail!r}) does not fit the grammar"

    def feed(self, table: Sequence[bytes]) -> None:
        """Feed the pending output tokens (engine thread, before the next mask)."""
        toks, self.pending = self.pending, []
        for t in toks:
            if self.error is not None:
                return
            if self.matcher is not None:
                if not self.matcher.accept_token(t):
                    self.error = f"token {t} ({table[t]!r}) is not allowed by the grammar here"
                continue
            guard = self.compiled.guard
            assert guard is not None
            self.k, tail = guard.step(self.k, table[t])
            if tail is not None:
                self._start(tail)

    def guard_row(self):
        """The free phase's mask row for the current state (None: no mask needed)."""
        guard = self.compiled.guard
        return guard.mask_row(self.k) if guard is not None and self.matcher is None else None


class Constraints:
    """The engine's constrained requests, row by row (engine thread only)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.table = compiler.table
        self._by_id: dict[str, Constraint] = {}
        self._rows: list[Constraint | None] = []  # row i = slot i of the last plan
        self._idx: list[int] = []  # rows with a constraint
        self._failed: list[tuple[str, str]] = []
        self._batch: Any = None

    def __bool__(self) -> bool:
        """Some running or waiting request has a constraint."""
        return bool(self._by_id)

    @property
    def in_rows(self) -> bool:
        """Some row of the last plan has a constraint (the step needs `fill`)."""
        return bool(self._idx)

    def open(self, request_id: str, constraint: Constraint) -> None:
        self._by_id[request_id] = constraint

    def close(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._by_id.pop(rid, None)

    def follow(self, plan: StepPlan) -> None:
        """Apply the plan's slot moves and admissions to the rows (as the output processor)."""
        if plan.cont or not (self._by_id or self._rows):
            return
        rows = list(self._rows)
        rows.extend([None] * (plan.n_active - len(rows)))
        for op in plan.ops:
            if isinstance(op, MoveOp):
                for dst, src in op.pairs:
                    rows[dst] = rows[src]
        for a in plan.admits:
            rows[a.slot] = self._by_id.get(a.request_id)
        del rows[plan.n_active :]
        self._rows = rows if any(c is not None for c in rows) else []
        self._idx = [i for i, c in enumerate(self._rows) if c is not None]

    def stage(self, out: StepOutput) -> None:
        """The step's output tokens of constrained rows become pending (fed at the next fill)."""
        if not self._idx:
            return
        emitted = None if out.emitted is None else set(out.emitted)
        rows, tokens = self._rows, out.tokens
        for i in self._idx:
            if emitted is None or i in emitted:
                rows[i].pending.append(tokens[i])  # type: ignore[union-attr]

    def fill(self, plan: StepPlan, bitmask) -> list[int]:
        """Runner callback, while the device runs the forward: feed each constrained row its
        pending tokens, write the masks of the rows that need one into bitmask rows 0, 1, ...
        (an int32 (>= n, ceil(V/32)) CPU tensor); return those rows in that order. A row whose
        grammar failed (a token it rejected, or no token allowed) is left out and reported by
        take_failures()."""
        import xgrammar as xgr

        rows, matchers, m_rows, bans, out = self._rows, [], [], [], []
        guards: list[tuple[int, Any]] = []
        for i in self._idx:
            c = rows[i]
            assert c is not None
            if c.error is None and c.pending:
                c.feed(self.table)
            if c.error is not None or not plan.commit[i]:
                if c.error is not None and plan.request_ids[i] in self._by_id:
                    self._fail(plan.request_ids[i], c.error)
                continue
            if c.matcher is not None:
                if c.compiled.ban is not None:
                    bans.append((len(matchers), c.compiled.ban))
                matchers.append(c.matcher)
                m_rows.append(i)
            else:
                g = c.guard_row()
                if g is not None:
                    guards.append((i, g))
        if matchers:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(self.compiler.threads)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(len(matchers))))
            for j, ban in bans:
                bitmask[j] &= ban
            ok = (bitmask[: len(matchers)] != 0).any(1).tolist()
            if not all(ok):
                return self._drop_empty(plan, bitmask, m_rows, ok, guards)
            out = m_rows
        for i, g in guards:
            bitmask[len(out)].copy_(g)
            out.append(i)
        return out

    def _drop_empty(self, plan: StepPlan, bitmask, m_rows: list[int], ok: list[bool], guards) -> list[int]:
        """Rows whose grammar allows no token fail; the others' masks move up to stay in order."""
        out = []
        for j, (i, good) in enumerate(zip(m_rows, ok)):
            if not good:
                rows_c = self._rows[i]
                assert rows_c is not None
                rows_c.error = "the grammar allows no token here"
                self._fail(plan.request_ids[i], rows_c.error)
                continue
            if len(out) != j:
                bitmask[len(out)].copy_(bitmask[j])
            out.append(i)
        for i, g in guards:
            bitmask[len(out)].copy_(g)
            out.append(i)
        return out

    def _fail(self, request_id: str, message: str) -> None:
        self._by_id.pop(request_id, None)
        self._failed.append((request_id, message))

    def take_failures(self) -> list[tuple[str, str]]:
        out, self._failed = self._failed, []
        return out
