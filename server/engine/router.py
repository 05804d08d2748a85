"""Several engines behind one `EngineAPI`: one engine per device (`--devices`), one server.

The task manager, the caches and the routes see one engine. Each engine has its own model copy,
slots, queue and CUDA graphs. States live in host memory (an engine copies a finished sequence's
state out; a starting state is copied into the slot that takes it), so any engine can run any
request, a fork or continuation included, and a template prefilled once serves every engine. The
router therefore only places new work and keeps the server up when an engine dies:

- submit: to the live engine with the lowest load, (running + waiting) / slots; ties to the
  first. An engine's counts include what was submitted and not yet taken by its loop, so a burst
  spreads at once. A full queue (429) or an engine that died since the check: the next one.
- an engine whose loop died (a GPU fault) takes no new work; its running requests fail with its
  own error (EngineDeadError: 503); the others go on. The server is alive while one engine is.
- abort: the engine that holds the request; compile_grammar: every live engine (each has its own
  grammar cache, and any of them may take the request); stats: the sums (per engine: `engines()`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from .protocol import EngineAPI, Handle, StateLike
from .types import EngineDeadError, EngineStats, GrammarSpec, QueueFullError, SamplingParams

log = logging.getLogger("server.engine")


class EngineRouter:
    """One EngineAPI over engines on several devices (see the module docstring)."""

    def __init__(self, engines: Sequence[EngineAPI], devices: Sequence[str]) -> None:
        if not engines or len(engines) != len(devices):
            raise ValueError("EngineRouter: one device name per engine, at least one engine")
        self._engines = list(engines)
        self.devices = list(devices)
        self.max_batch = sum(e.max_batch for e in self._engines)
        self._lock = threading.Lock()
        self._reported: set[int] = set()  # engines whose death was logged

    # --- EngineAPI ---------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return any(e.is_alive for e in self._engines)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        init_state: StateLike | None = None,
        request_id: str | None = None,
        return_state: bool = False,
        end_before_state: bool = False,
        history: int = 0,
    ) -> Handle:
        error: Exception = EngineDeadError("every engine stopped; see the server log")
        for i in self._by_load():
            try:
                return self._engines[i].submit(
                    prompt,
                    params,
                    init_state=init_state,
                    request_id=request_id,
                    return_state=return_state,
                    end_before_state=end_before_state,
                    history=history,
                )
            except (QueueFullError, EngineDeadError) as exc:  # this one cannot take it: the next may
                error = exc
        raise error

    def abort(self, request_id: str) -> bool:
        return any(e.abort(request_id) for e in self._engines)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        for i in self._live():
            self._engines[i].compile_grammar(spec)

    def stats(self) -> EngineStats:
        total = EngineStats()
        live = self._live()
        for i, e in enumerate(self._engines):
            st = e.stats()
            total.prompt_tokens_total += st.prompt_tokens_total
            total.generation_tokens_total += st.generation_tokens_total
            total.steps += st.steps
            if i in live:  # the capacity and the rates of the engines that run
                total.running += st.running
                total.waiting += st.waiting
                total.slots += st.slots
                total.decode_tok_s += st.decode_tok_s
                total.prefill_tok_s += st.prefill_tok_s
                total.step_ms = max(total.step_ms, st.step_ms)
        total.engines, total.engines_alive = len(self._engines), len(live)
        return total

    def shutdown(self, timeout: float = 30.0) -> None:
        threads = [threading.Thread(target=e.shutdown, args=(timeout,), daemon=True) for e in self._engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5.0)

    # --- beyond EngineAPI --------------------------------------------------------------------
    def engines(self) -> list[tuple[str, bool, EngineStats]]:
        """(device, alive, stats) of each engine, in --devices order (for /metrics)."""
        return [(d, e.is_alive, e.stats()) for d, e in zip(self.devices, self._engines)]

    def _live(self) -> list[int]:
        live = []
        for i, e in enumerate(self._engines):
            if e.is_alive:
                live.append(i)
                continue
            with self._lock:
                first = i not in self._reported
                self._reported.add(i)
            if first:
                log.error("the engine on %s stopped: its requests failed; new requests go to the %d other engine(s) "
                          "that run", self.devices[i], sum(x.is_alive for x in self._engines))  # fmt: skip
        return live

    def _by_load(self) -> list[int]:
        """The live engines, least loaded first ((running + waiting) / slots; ties: --devices order)."""
        loads = []
        for i in self._live():
            st = self._engines[i].stats()
            loads.append(((st.running + st.waiting) / max(st.slots, 1), i))
        return [i for _, i in sorted(loads)]
