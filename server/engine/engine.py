"""The engine: one loop thread that runs scheduler steps on the device, and the in-process API.

    from server.engine import Engine, SamplingParams
    engine = Engine(model, tokenizer, settings); engine.start()
    h = engine.submit("Hello", SamplingParams(max_tokens=32, temperature=0))
    for ev in h: print(ev.text, end="")          # or: async for ev in h
    res = h.result()                              # or: await h.wait()
    engine.generate(["a", "b"], params)           # -> list[Result]
    engine.shutdown()

Where the last sampled token goes (the state contract). The engine never runs a token it does
not need: a finished sequence's state (Result.state, when return_state=True) holds everything
fed so far, and `Result.pending_tokens` lists what was not fed yet:

    state + pending_tokens == prompt + token_ids      (always; [] after a stop token id)

- length / stop string / abort: pending_tokens == [last generated token] (its logits were never
  needed); a stop string's tokens are in token_ids and in the state, not in the text;
- stop token (EOS 0 or stop_token_ids): the stop token is not emitted, not fed: pending == [];
- max_tokens=0 (prefill only): the whole prompt is fed, pending == [];
- aborted while waiting or prefilling: pending == the prompt tokens not yet fed.
So continuing is exactly equivalent to never having stopped: submit
`pending_tokens + more_prompt_tokens` with `init_state=state` (prefill A then B == prefill A+B).
Penalties and the seeded random stream restart with each request (a continuation request can
pass the same seed; positions count from its first generated token).

The critical path (CUDA, defer_delivery): only id bookkeeping runs between a step's token ids
reaching the host and the next launch; text, events and delivery follow it (see delivery.py).

Threads. submit/abort/stats may be called from any thread (including an event loop thread:
they never wait for the engine). Events are pushed once per step per request; asyncio consumers
are woken with one call_soon_threadsafe per event loop per step. A request that fails (bad
starting state, an error while processing its tokens) ends with finish_reason "error" and the
others go on; if the loop itself dies, every caller gets EngineDeadError instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import deque
from typing import Sequence as Seq

from server.config import Settings

from .delivery import DeliveryMixin
from .handle import Deliveries, RequestHandle
from .runner import Runner, _check_state
from .scheduler import Scheduler, StepPlan
from .sequence import FastDecoder, Sequence
from .stats import StatsTracker
from .types import (
    EngineDeadError,
    EngineStats,
    Event,
    PromptTooLongError,
    QueueFullError,
    Result,
    SamplingParams,
)

log = logging.getLogger("server.engine")

MAX_STEP_FAILURES = 3
"""Consecutive failed decode steps after which the loop declares itself dead."""


class Engine(DeliveryMixin):
    def __init__(self, model, tokenizer, settings: Settings | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.settings = settings or Settings()
        s = self.settings
        on_cuda = str(model.device).startswith("cuda")
        self.max_batch = s.max_batch if s.max_batch > 0 else (256 if on_cuda else 32)
        self.scheduler = Scheduler(self.max_batch, s.step_token_budget, s.prefill_chunk)  # queue bound: submit()
        self.runner: Runner | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[tuple[str, object]] = deque()
        self._inbox_adds = 0
        self._live: dict[str, RequestHandle] = {}
        self._awaiting_state: dict[int, Event] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._step_failures = 0
        self._stats = StatsTracker(s.stats_interval)
        self._deferred: tuple[Deliveries, list] | None = None
        """The last step's deliveries and its deferred text work ((seq, token) to emit)."""
        self.defer_delivery = on_cuda
        """Detokenize, check and deliver a step's events after the NEXT step is launched (while
        the device runs): between a step's token ids reaching the host and the next launch only
        id bookkeeping runs (stop token ids, max_tokens; sequences with stop strings are checked
        on text before the launch). Only worth it when the launch is asynchronous (CUDA); on the
        CPU it would only add a step of latency."""

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is not None:
            return self
        self.runner = Runner(self.model, self.max_batch, cuda_graphs=self.settings.cuda_graphs)
        self._thread = threading.Thread(target=self._run, name="rwkv-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or self._thread.is_alive():  # never started, or stuck: fail callers now
            self._fail_all(EngineDeadError("the engine was shut down"))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _gone(self) -> bool:
        """Stopped or died (a not-yet-started engine is not gone: its requests wait)."""
        return self._dead is not None or self._stopping or (self._thread is not None and not self._thread.is_alive())

    # --- the API --------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        init_state=None,
        request_id: str | None = None,
        return_state: bool = False,
    ) -> RequestHandle:
        """Queue a request; raises QueueFullError, PromptTooLongError, EngineDeadError, ValueError."""
        if self._dead is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        params = params or SamplingParams(max_tokens=self.settings.default_max_tokens)
        ids = self._prompt_ids(prompt, params)
        if init_state is not None and self.runner is not None:
            _check_state(init_state, self.runner.pool)
        rid = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = RequestHandle(self, rid, loop)
        seq = Sequence(rid, ids, params, _decoder(self.tokenizer, self.model.shape.vocab_size), seed=seed, init_state=init_state,
                       return_state=return_state, sink=handle)  # fmt: skip
        with self._lock:
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already in use")
            waiting = self._inbox_adds + self.scheduler.num_waiting
            if self.settings.max_queue and waiting >= self.settings.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting (max_queue={self.settings.max_queue})")
            self._live[rid] = handle
            self._inbox.append(("add", seq))
            self._inbox_adds += 1
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Abort a request by identity; False if it is unknown or already finished."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._inbox.append(("abort", request_id))
        self._wake.set()
        return True

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[Result]:  # fmt: skip
        """Submit all prompts, wait for all results (in order)."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        handles = [self.submit(p, q) for p, q in zip(prompts, plist)]
        return [h.result(timeout) for h in handles]

    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.scheduler.num_running, self.scheduler.num_waiting + self._inbox_adds,
                                    self.max_batch)  # fmt: skip

    def _prompt_ids(self, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        if params.max_tokens < 0 or params.temperature < 0 or not 0 <= params.top_p <= 1 or params.top_k < 0:
            raise ValueError("invalid sampling parameters (max_tokens, temperature, top_k >= 0; 0 <= top_p <= 1)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if len(ids) > self.settings.max_prompt_tokens:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens (max {self.settings.max_prompt_tokens})")
        V = self.model.shape.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= V):
            raise ValueError(f"token ids must be in [0, {V})")
        if not ids and params.max_tokens > 0:
            raise ValueError("empty prompt: nothing to generate from (feed at least one token)")
        return ids

    # --- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_inbox()
                runner = self.runner
                if self.scheduler.has_work():
                    self._step()
                    continue
                self._flush_deferred()
                if runner.copies_pending:
                    self._deliver_states(Deliveries(), wait=True).deliver()
                else:
                    self._stats.roll(0, 0)
                    self._wake.wait(min(self._stats.interval, 1.0))
        except BaseException as exc:  # the loop itself broke: report, never hang callers
            self._dead = exc
            log.exception("engine loop died")
        finally:
            try:
                self._flush_deferred()
            except BaseException:  # noqa: BLE001 (the callers still get EngineDeadError)
                log.exception("could not deliver the last events")
            self._fail_all(EngineDeadError("the engine was shut down" if self._dead is None
                                           else f"the engine loop died: {self._dead!r}"))  # fmt: skip

    def _drain_inbox(self) -> None:
        d = Deliveries()
        while True:
            with self._lock:
                if not self._inbox:
                    break
                kind, item = self._inbox.popleft()
                if kind == "add":
                    self._inbox_adds -= 1
            if kind == "add":
                self.scheduler.add(item)  # type: ignore[arg-type]
            else:
                self._flush_deferred()  # the sequence's text must be up to date before it ends
                ended = self.scheduler.abort(item)  # type: ignore[arg-type]
                if ended is not None:
                    self._finished(ended[0], ended[1], d)
        d.deliver()

    def _step(self) -> None:
        t0, m0, s0 = time.perf_counter(), self.runner.model_time, self.runner.sample_time
        d = Deliveries()
        plan = self.scheduler.plan(allow_cont=True)
        for seq, ev in plan.early:
            self._finished(seq, ev, d)
        for seq, msg in self.runner.prepare(plan).failed:
            self._fail_seq(seq, msg, d)
        try:
            self.runner.prefill(plan)
        except Exception as exc:
            log.exception("prefill failed")
            for slot, _ in plan.prefill:
                self._fail_seq(plan.rows[slot], f"prefill failed: {exc!r}", d)
        tokens = self._decode(plan, d)  # the previous step's text + events while the device runs
        decoded = 0
        emits: list = []
        if tokens is not None:
            out = self.scheduler.apply(plan, tokens, defer_text=True)  # ids only (+ stop-string rows)
            decoded = out.decode_tokens
            emits = out.deferred
            for seq, ev in out.events:
                if ev.finished:
                    self._finished(seq, ev, d)
                else:
                    d.add(seq.sink, ev)
        if self.defer_delivery:
            self._deliver_states(d)
            self._deferred = (d, emits)  # text + delivery once the next step is launched (or when idle)
        else:
            self._deferred = (d, emits)
            self._flush_deferred()
            self._deliver_states(Deliveries()).deliver()
        self._stats.record(time.perf_counter() - t0, self.runner.model_time - m0, self.runner.sample_time - s0,
                           decoded, plan.n_prefill_tokens, plan.bucket)  # fmt: skip
        self._stats.roll(self.scheduler.num_running, self.scheduler.num_waiting)

    def _decode(self, plan: StepPlan, d: Deliveries) -> list[int] | None:
        try:
            job = self.runner.launch(plan)
        except Exception as exc:
            self._flush_deferred()
            return self._decode_failed(plan, d, exc)
        self._flush_deferred()  # the consumers take the GIL while the device runs, not during the launch
        try:
            tokens = self.runner.finish(job)
        except Exception as exc:
            return self._decode_failed(plan, d, exc)
        self._step_failures = 0
        return tokens

    def _decode_failed(self, plan: StepPlan, d: Deliveries, exc: Exception) -> None:
        self._step_failures += 1
        log.exception("decode step failed (%d in a row)", self._step_failures)
        if self._step_failures >= MAX_STEP_FAILURES:
            raise exc
        for seq in plan.rows:
            self._fail_seq(seq, f"decode step failed: {exc!r}", d)
        return None


def _decoder(tokenizer, vocab_size: int):
    return FastDecoder(tokenizer, vocab_size)
