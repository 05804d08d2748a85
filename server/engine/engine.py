"""The engine: one loop thread that runs steps on the device, and the in-process API.

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

One step (`Engine.step`): the scheduler decides (plain data), the runner executes on the device,
the output processor turns ids into text, events and results. Between a step's token ids
reaching the host and the next launch only id bookkeeping runs (and the text of requests with
stop strings); on CUDA the text and the deliveries of a step run after the NEXT step was
launched, while the device works (`defer_delivery`); on the CPU, at the end of the step.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.config import Settings
from server.tokenizer import IncrementalDecoder, Tokenizer

from .constraints import Constraint, Constraints
from .grammar import GrammarCompiler
from .handle import RequestHandle, fail_handles
from .inbox import Inbox, prompt_ids
from .output import OutputProcessor
from .plan import StepPlan, StepRunner
from .protocol import StateLike
from .scheduler import Scheduler
from .sequence import EngineSeq
from .stats import StatsTracker
from .types import (
    EngineDeadError,
    EngineStats,
    GrammarSpec,
    Result,
    SamplingParams,
)

if TYPE_CHECKING:  # (imports torch at run time: the runner imports it once the engine starts)
    from server.model.rwkv7 import RWKV7

log = logging.getLogger("server.engine")

MAX_STEP_FAILURES = 3
"""Consecutive failed decode steps after which the loop declares itself dead (at once for a
device fault: `_device_fault`)."""


def _device_fault(exc: BaseException) -> bool:
    """A CUDA error that torch reports as one (an illegal memory access, a lost device): the
    device's context is then unusable and every later step would fail too, so the loop dies at
    once (with one engine per GPU the others take the new work at once)."""
    import torch  # a failing step ran on torch: already imported

    return isinstance(exc, getattr(torch, "AcceleratorError", ()))  # (torch >= 2.8)


class Engine:
    def __init__(
        self, model: RWKV7, tokenizer: Tokenizer, settings: Settings | None = None, *, runner: StepRunner | None = None
    ):
        """runner: the device side (default: a `runner.Runner` over the model, built by start())."""
        self.model, self.tokenizer = model, tokenizer
        self.settings = s = settings or Settings()
        on_cuda = str(model.device).startswith("cuda")
        self.max_batch = s.resolved_max_batch(str(model.device))
        self.scheduler = Scheduler(self.max_batch, s.step_token_budget, s.prefill_chunk)  # queue bound: submit()
        self._runner = runner
        self.output = OutputProcessor(new_decoder=lambda: IncrementalDecoder(tokenizer),
                                      detached_state=self._detached_state, on_done=self._done)  # fmt: skip
        self.defer_delivery = on_cuda
        """Flush a step's text and deliveries after the next step's launch (only worth it when the
        launch is asynchronous: CUDA; on the CPU it would only add a step of latency)."""
        self._lock = threading.Lock()  # the grammar compiler's creation
        self._wake = threading.Event()
        self._inbox = Inbox(s.max_queue, self.max_batch)  # new requests, aborts from any thread; live handles
        self._compiler: GrammarCompiler | None = None
        self.constraints: Constraints | None = None
        """The constrained requests (grammar.Constraints), once the first grammar was compiled."""
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._step_failures = 0
        self._stats = StatsTracker(s.stats_interval)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is not None:
            return self
        if self._runner is None:
            from .runner import Runner  # torch: only an engine that runs needs it

            self._runner = Runner(self.model, self.max_batch, cuda_graphs=self.settings.cuda_graphs,
                                  prefill_graph_len=self.settings.prefill_graph_len)  # fmt: skip
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
        elif self._runner is not None:
            self._runner.close()

    @property
    def runner(self) -> StepRunner:
        """The device side (there once the engine started, or given at construction)."""
        if self._runner is None:
            raise RuntimeError("the engine has no runner before start()")
        return self._runner

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _alive(self) -> bool:
        """Handles will still get their events (an engine not started yet is alive)."""
        gone = self._dead is not None or self._stopping or (self._thread is not None and not self._thread.is_alive())
        return not gone

    # --- the API --------------------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of this engine's vocabulary (built on first use)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer.token_table, self.model.shape.vocab_size)
                self.constraints = Constraints(self._compiler)
            return self._compiler

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile spec into the cache now; ValueError (the reason) when it cannot be compiled.
        submit() compiles an uncached spec on the caller's thread (milliseconds, more for big
        schemas; the first compile also builds the vocabulary tables): an event-loop caller
        can run this in a worker thread first (`await asyncio.to_thread(...)`)."""
        self.grammars.compile(spec)

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
    ) -> RequestHandle:
        """Queue a request; raises QueueFullError, PromptTooLongError, EngineDeadError, ValueError
        (also for a grammar that cannot be compiled: its reason). end_before_state (with
        return_state): deliver the finishing event without waiting for the final state's copy
        to the host; the Result follows with it. For callers whose next request does not need
        this one settled (a stream that only keeps the state for later). history: leading prompt
        tokens that re-feed a task's history, not counted against max_prompt_tokens (EngineAPI)."""
        if self._dead is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        params = params or SamplingParams(max_tokens=self.settings.default_max_tokens)
        ids = prompt_ids(self.tokenizer, prompt, params, vocab_size=self.model.shape.vocab_size,
                         max_prompt_tokens=self.settings.max_prompt_tokens, history=history)  # fmt: skip
        constraint = None
        if params.grammar is not None:  # (a grammar_prefix that does not fit: ValueError, nothing queued)
            constraint = Constraint(self.grammars.compile(params.grammar), params.grammar_prefix, self.grammars.table)
        if init_state is not None and self._runner is not None:
            self._runner.check_state(init_state)
        rid = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = RequestHandle(
            rid, loop, alive=self._alive, abort=self.abort, end_before_state=end_before_state and return_state
        )
        seq = EngineSeq(rid, ids, params, seed=seed, init_state=init_state, return_state=return_state)
        text = self.output.new_text(rid, handle, params)
        self._inbox.put((seq, text, constraint), handle)
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Abort a request by identity; False if it is unknown or already finished."""
        if not self._inbox.abort(request_id):
            return False
        self._wake.set()
        return True

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[Result]:  # fmt: skip
        """Submit all prompts, wait for all results (in order)."""
        plist: list[SamplingParams | None] = (
            list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)  # type: ignore[list-item]
        )
        handles = [self.submit(p, q) for p, q in zip(prompts, plist)]
        return [h.result(timeout) for h in handles]

    def stats(self) -> EngineStats:
        """running: the requests that hold a slot or that a free slot will take (not taken by the
        loop yet included); waiting: those beyond the free slots (what max_queue bounds)."""
        running, waiting = self._inbox.load()
        return self._stats.snapshot(running, waiting, self.max_batch)

    # --- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.runner.bind_thread()
            while not self._stopping:
                self._wake.clear()
                if not self.run_once():
                    self._stats.roll(0, 0)
                    self._wake.wait(min(self._stats.interval, 1.0))
        except BaseException as exc:  # the loop itself broke: report, never hang callers
            self._dead = exc
            log.exception("engine loop died")
        finally:
            try:
                self.output.finish(self.scheduler.take_finished())
                self.output.flush()
            except BaseException:
                log.exception("could not deliver the last events")
            self._fail_all(EngineDeadError("the engine was shut down" if self._dead is None
                                           else f"the engine loop died: {self._dead!r}"))  # fmt: skip

    def step(self) -> None:
        """One step (the engine thread; the tests call it directly)."""
        runner, sched, out = self.runner, self.scheduler, self.output
        t0, m0, s0 = time.perf_counter(), runner.model_time, runner.sample_time
        self._drain_inbox()
        plan = sched.plan()  # plain data: rows, admissions, slot moves, bucket (or "continue")
        out.follow(plan)  # which request decodes in which row
        cons = self.constraints
        if cons is not None:
            cons.follow(plan)
        self._fail(runner.prepare(plan))  # slot moves, copy-outs, admissions
        self._prefill(plan)
        job = self._launch(plan, cons)  # decode + sampling enqueued: on CUDA the device runs from here
        sched.materialize()  # meanwhile: the last step's id bookkeeping,
        self._flush()  # its text, events, results and their delivery
        tokens = self._wait(plan, job)  # the sampled ids on the host
        decoded = 0
        if tokens:
            lps = runner.logprobs(job) if plan.logprobs else None
            step_out = sched.apply(plan, tokens, out.match_stops)  # ids decide; stop strings on text
            out.stage(step_out, plan, lps)
            if cons is not None and cons.in_rows:
                cons.stage(step_out)
            decoded = step_out.decode_tokens
        self._stats.count(decoded, plan.n_prefill_tokens, plan.bucket)  # before any flush delivers them
        out.states_ready(runner.poll_copies())
        if not self.defer_delivery:
            self._flush()  # the CPU: at once (no launch to hide it behind)
        self._stats.add_time(time.perf_counter() - t0, runner.model_time - m0, runner.sample_time - s0)
        self._publish()  # the slots this step freed
        self._stats.roll(sched.num_running, sched.num_waiting)

    def run_once(self) -> bool:
        """One turn of the loop: a step when there is work, else what is left to deliver (staged
        events, final states still being copied); False when there was nothing to do."""
        if self._inbox.has_items() or self.scheduler.has_work():
            self.step()
        elif self.output.pending or self.scheduler.has_finished():
            self._flush()
        elif self.runner.copies_pending:
            self.output.states_ready(self.runner.poll_copies(wait=True))
        else:
            return False
        return True

    def _drain_inbox(self) -> None:
        for item in self._inbox.take():
            if isinstance(item, str):
                self.scheduler.abort(item)
            else:
                seq, text, constraint = item
                self.output.open(text)
                if constraint is not None:
                    self.constraints.open(seq.request_id, constraint)  # type: ignore[union-attr]
                self.scheduler.add(seq)
        self._publish()  # what it took is the scheduler's now (aborts freed their slots)

    def _publish(self) -> None:
        """Tell the inbox how many requests the loop holds (its queue bound counts them)."""
        self._inbox.publish(self.scheduler.num_running + self.scheduler.num_waiting)

    def _flush(self) -> None:
        """Hand the requests that ended to the output processor; build and deliver all it staged."""
        ends = self.scheduler.take_finished()
        self._publish()  # before any delivery: a caller that has its result finds its slot free
        if ends and self.constraints:
            self.constraints.close([e.request_id for e in ends])
        self.output.finish(ends)
        self._fail(self.output.flush())

    # --- failures -------------------------------------------------------------------------
    def _fail(self, failures: list[tuple[str, str]]) -> None:
        for rid, msg in failures:
            self.scheduler.fail([rid], msg)

    def _prefill(self, plan: StepPlan) -> None:
        try:
            self.runner.prefill(plan)
        except Exception as exc:
            log.exception("prefill failed")
            self.scheduler.fail([plan.request_ids[slot] for slot, _ in plan.prefill], f"prefill failed: {exc!r}")

    def _launch(self, plan: StepPlan, cons: Constraints | None) -> Any:
        """Launch the step; with constrained rows, the runner fills their masks (cons.fill)
        after launching the forward. Rows whose grammar failed are failed after the launch."""
        try:
            if cons is None or not cons.in_rows:
                return self.runner.launch(plan)
            job = self.runner.launch(plan, lambda bitmask: cons.fill(plan, bitmask))
            self._fail(cons.take_failures())
            return job
        except Exception as exc:  # counted: the loop dies after MAX_STEP_FAILURES
            self._step_failed(plan, exc)
            return None

    def _wait(self, plan: StepPlan, job: Any) -> list[int]:
        if job is None:
            return []
        try:
            tokens = self.runner.finish(job)
        except Exception as exc:
            self._step_failed(plan, exc)
            return []
        self._step_failures = 0
        return tokens

    def _step_failed(self, plan: StepPlan, exc: Exception) -> None:
        self._step_failures += 1
        log.exception("decode step failed (%d in a row)", self._step_failures)
        if self._step_failures >= MAX_STEP_FAILURES or _device_fault(exc):
            raise exc
        self.scheduler.fail(plan.request_ids, f"decode step failed: {exc!r}")

    # --- the output processor's dependencies ------------------------------------------------
    def _detached_state(self, init_state: Any) -> Any:
        return self.runner.detached_state(init_state)

    def _done(self, request_id: str) -> None:
        self._inbox.done(request_id)
        self._stats.finished_total += 1

    def _fail_all(self, exc: EngineDeadError) -> None:
        fail_handles(self._inbox.close(), exc)
