"""Constrained requests on the engine thread: each request's grammar state (`Constraint`) and
the rows' masks of each step (`Constraints`).

`Constraints` follows the scheduler's plans (which request decodes in which row, as the output
processor does), takes each constrained row's new output token after a step (`stage`), and,
while the device runs the next step's forward, feeds the tokens to the matchers and fills the
rows' masks (`fill`: the runner calls it, plan.MaskFill). A row whose grammar failed is
reported by `take_failures()` and failed by the engine; the batch goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .grammar import Compiled, GrammarCompiler
from .plan import MoveOp, StepOutput, StepPlan


class Constraint:
    """One request's constraint: the grammar matcher (from the first token, or once the trigger
    appeared), the trigger state before that, and the output tokens not fed yet."""

    def __init__(self, compiled: Compiled, prefix: Sequence[int] = (), table: Sequence[bytes] = ()):
        """prefix: the output this request continues (SamplingParams.grammar_prefix), fed here
        through the trigger and the grammar as if it had been generated (table: the vocabulary's
        bytes); ValueError when it does not fit, so the request is refused before it starts."""
        self.compiled = compiled
        self.matcher: Any = None
        self.k = 0  # trigger bytes matched (free phase)
        self.pending: list[int] = []
        self.error: str | None = None
        if compiled.guard is None:
            self._start(b"")
        if prefix:
            self._resume(prefix, table)

    def _resume(self, prefix: Sequence[int], table: Sequence[bytes]) -> None:
        """Feed prefix token by token (to name the first that does not fit)."""
        for i, t in enumerate(prefix):
            self.pending.append(t)
            self.feed(table)
            if self.error is not None:
                raise ValueError(
                    f"the output so far does not fit the grammar: its token {i + 1} of {len(prefix)} "
                    f"({t}, {table[t]!r}) is not allowed there (a continue without a prompt extends "
                    "the output under the task's grammar; a new prompt starts a new output)"
                )

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

        rows = self._rows
        matchers: list[Any] = []  # xgr.GrammarMatcher, one per constrained row
        m_rows: list[int] = []
        bans: list[tuple[int, Any]] = []
        out: list[int] = []
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
        out: list[int] = []
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
