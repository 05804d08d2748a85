"""The runner: executes a scheduler plan on the device over a preallocated slot pool.

Per step (see scheduler.py for the plan's meaning), in this order:
1. ops: copy finished states out of their slots, move slots to keep the active prefix;
2. admissions: reset each new slot to zeros or its starting state (pool.scatter converts
   device/dtype), reset its penalties and sampling parameters;
3. prefill: one `model.forward(chunks, pool, slots)` for all prompt chunks of the step (up to
   4 chunks of up to --prefill-graph-len tokens: one graph replay, model/prefill_graphs.py);
4. decode + sampling: one `model.decode(ids, pool.view(0, bucket))` and one sampler call over
   the bucket (or one CUDA-graph replay of both), then ONE device->host copy of the token ids
   into a pinned buffer (`launch`); `finish` waits for it with the GIL released (the engine
   delivers the previous step's events in between).
   A continuation plan (StepPlan.cont: same rows as the previous step, all decoding) is fed on
   the device: the previous step's sampled ids (or its host-resolved ids after overflow rows),
   positions + 1, the same commit mask: no host lists, no host->device copy. With CUDA graphs
   the graph feeds itself, so such a step is one replay and the id copy (graphs.step_cont).
   A step with constrained rows (a MaskFill) or logprob rows is split: the forward (a
   forward-only graph replay, or the eager decode), then, while the device runs it, the host
   fills the masks (plan.MaskFill); then the masks are copied and applied to the logits, the
   logprob rows' logits are taken (logprobs.py), and the sampling runs eagerly.
States are updated in place in the pool; nothing is copied per step except moves/admissions.

Finished states are copied out as batch-1 States on the CPU: on CUDA a device-side gather on the
main stream (ordered before the slot is reused), then a host copy on a thread of its own
(copyout.HostCopies); the copy is handed back, by request id, by `poll_copies()` once complete.
The runner reads the plan's plain data only (plan.py); it satisfies plan.StepRunner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from server.model.state import State

from .copyout import HostCopies
from .logprobs import LogprobRows, Pending
from .plan import CopyOutOp, MaskFill, MoveOp, StepPlan, bucket_sizes
from .sampler import SamplerSlots, apply_token_bitmask
from .types import OVERFLOW_TOKEN, TokenLogprob


@dataclass
class _Launched:
    n: int
    tok: torch.Tensor  # (n,) on the device
    logits: torch.Tensor | None  # (n, V) eager logits (None with graphs: graphs.logits(n))
    pos: torch.Tensor | None  # (b,) positions on the device (None after a bare graph replay)
    commit: torch.Tensor  # (b,) bool
    b: int = 0
    greedy: bool = False
    t_launch: float = 0.0  # set by _launched()
    host_ids: list[int] | None = None  # set when overflow rows were re-sampled on the host
    lp: Pending | None = None  # the plan's logprobs entries, being computed


class Runner:
    def __init__(self, model, max_batch: int, *, cuda_graphs: bool = False, prefill_graph_len: int = 0):
        self.model = model
        self.max_batch = max_batch
        self.device = torch.device(model.device)
        self.pool: State = model.zero_state(max_batch)
        self.sampler = SamplerSlots(max_batch, model.shape.vocab_size, self.device)
        self.cuda = self.device.type == "cuda"
        self.copies = HostCopies(self.device) if self.cuda else None
        self._h2d = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=self.cuda)  # (3, M)
        self._d2h = torch.zeros(max_batch, dtype=torch.long, pin_memory=self.cuda)  # (M,) sampled ids
        self._d2h_done = torch.cuda.Event() if self.cuda else None
        self._last: _Launched | None = None  # the previous decode (a continuation plan feeds on it)
        self._ready: list[tuple[str, State | None]] = []  # the CPU's copy-outs (done at once)
        self._masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see _apply_masks
        self._lp = LogprobRows(max_batch, self.device)
        self.graphs = None
        if cuda_graphs and self.cuda:
            from server.model.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.pool, sampler=self.sampler, buckets=bucket_sizes(max_batch))
            self.graphs.capture()
        self.prefill_graphs = None  # short prefills as graph replays (all captured here)
        if cuda_graphs and self.cuda and prefill_graph_len > 0 and model.kernel_ops():
            from server.model.prefill_graphs import MAX_BATCH, PrefillGraphs

            self.prefill_graphs = PrefillGraphs(model, self.pool, max_len=prefill_graph_len)
            self.prefill_graphs.capture(range(1, MAX_BATCH + 1))  # all now: none while copies run
        self.model_time = 0.0
        """Seconds in model.forward + launching the decode (on the CPU: the decode + sampling)."""
        self.sample_time = 0.0
        """Seconds from the end of the decode launch to its token ids on the host (the device's
        time not hidden behind host work, plus overflow rows' exact sampling)."""
        self.mask_time = 0.0
        """Seconds spent filling grammar masks (on the host, while the device runs the forward)."""

    # --- step phases ----------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> list[tuple[str, str]]:
        """Ops (copy-outs, moves) then admissions; (request_id, message) of failed admissions."""
        for op in plan.ops:
            if isinstance(op, CopyOutOp):
                self._copy_out(op.slot, op.request_id)
            elif isinstance(op, MoveOp):
                self._move(op.pairs)
        return self._admit(plan) if plan.admits else []

    def prefill(self, plan: StepPlan) -> None:
        if not plan.prefill:
            return
        t0 = time.perf_counter()
        tokens, slots = [t for _, t in plan.prefill], [s for s, _ in plan.prefill]
        if self.prefill_graphs is not None and self.prefill_graphs.covers(tokens):
            self.prefill_graphs.run(tokens, slots)
        else:
            self.model.forward(tokens, self.pool, slots=slots)
        self.model_time += time.perf_counter() - t0

    def decode(self, plan: StepPlan) -> list[int]:
        """Decode every active row once, sample, and return the n_active token ids."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan, masks: MaskFill | None = None) -> _Launched | None:
        """Enqueue the step's decode + sampling and the copy of its token ids to the host; on
        CUDA this returns at once (the caller can do host work while the device runs).
        masks: the step's constrained rows (plan.MaskFill): the forward is launched first, the
        masks are filled on the host while the device runs it, then copied and applied to the
        logits before the sampling. Rows with logprobs get them from the same logits."""
        n, b = plan.n_active, plan.bucket
        if n == 0:
            return None
        t0 = time.perf_counter()
        last, self._last = self._last, None
        split = masks is not None or bool(plan.logprobs)  # forward, then host work, then sampling
        if plan.cont:
            if last is None or last.n != n or last.b != b:
                raise RuntimeError("a continuation plan must follow the launched step of the same rows")
            if self.graphs is not None and last.host_ids is None:
                # the graph fed itself (ids, positions + 1): a bare replay, nothing copied in
                if split:
                    return self._launch_split(plan, masks, None, None, last.commit, last.greedy, t0)
                job = _Launched(n, self.graphs.step_cont(n), None, None, last.commit, b, last.greedy)
                return self._launched(job, t0)
            # the previous step's sampled ids feed this one on the device (no host round trip)
            if last.host_ids is None:
                ids = last.tok
            else:  # overflow rows were re-sampled on the host
                ids = torch.tensor(last.host_ids, dtype=torch.long).to(self.device, non_blocking=True)
            if b > n and self.graphs is None:
                ids = torch.cat([ids, ids.new_zeros(b - n)])
            pos, commit, greedy = self._positions(last) + 1, last.commit, last.greedy
        else:
            h = self._h2d
            h[:, :n] = torch.tensor([plan.decode_tokens, plan.positions, plan.commit], dtype=torch.long)  # (3, n)
            if b > n:
                h[:, n:b] = 0
            dev = h[:, :b].to(self.device, non_blocking=True)  # (3, b)
            ids, pos, commit = dev[0], dev[1], dev[2].bool()
            greedy = self.graphs is None and plan.greedy
        if split:
            return self._launch_split(plan, masks, ids, pos, commit, greedy, t0)
        logits = None
        if self.graphs is not None:
            tok = self.graphs.step(n, ids[:n], pos[:n], commit[:n])  # (n,)
        else:
            # raw (model dtype) logits, as the graphs take them: the samplers widen as they read
            logits = self.model.decode(ids, self.pool.view(0, b), raw_logits=True)  # (b, V)
            tok = self.sampler.sample(logits, pos, commit, greedy_only=greedy)[:n]  # (n,)
            logits = logits[:n]
        return self._launched(_Launched(n, tok, logits, pos, commit, b, greedy), t0)

    def _launch_split(self, plan: StepPlan, masks: MaskFill | None, ids, pos, commit, greedy: bool,
                      t0: float) -> _Launched:  # fmt: skip
        """The forward (a forward-only graph replay, or the eager decode), then, while the device
        runs it, the host fills the masks; then the masks, the logprobs' logits and the
        sampling are enqueued. ids None: a continuation the graph inputs already hold."""
        n, b, g = plan.n_active, plan.bucket, self.graphs
        if g is not None:
            logits = g.forward(n) if ids is None else g.forward(n, ids[:n], pos[:n], commit[:n])  # (b, V)
            pos, commit = g.positions[:b], g.commit[:b]
        else:
            logits = self.model.decode(ids, self.pool.view(0, b), raw_logits=True)  # (b, V)
        lp = self._lp.select(plan.logprobs, logits) if plan.logprobs else None  # before the masks
        if masks is not None:
            self._apply_masks(masks, logits, b)
        tok = self.sampler.sample(logits, pos, commit, greedy_only=greedy)  # (b,)
        if g is not None:
            g.feed(b, tok)  # what the fused graph does at its end: the next replay's inputs
        job = _Launched(n, tok[:n], logits[:n], None if g is not None else pos, commit, b, greedy)
        if lp is not None:
            job.lp = self._lp.finish(lp, tok)
        return self._launched(job, t0)

    def _apply_masks(self, masks: MaskFill, logits: torch.Tensor, b: int) -> None:
        """Fill the constrained rows' masks on the host (the device runs the forward meanwhile),
        copy them to the device, set the disallowed tokens' logits to -inf."""
        if self._masks is None:
            W = (logits.shape[1] + 31) // 32
            M = self.max_batch
            host = torch.zeros(M, W, dtype=torch.int32, pin_memory=self.cuda)  # (M, W)
            rows_h = torch.zeros(M, dtype=torch.long, pin_memory=self.cuda)  # (M,)
            dev = host if not self.cuda else torch.zeros(M, W, dtype=torch.int32, device=self.device)
            rows_d = rows_h if not self.cuda else torch.zeros(M, dtype=torch.long, device=self.device)
            self._masks = (host, rows_h, dev, rows_d)
        host, rows_h, dev, rows_d = self._masks
        t = time.perf_counter()
        rows = masks(host[:b])  # the previous step's copy of `host` completed (finish waited for it)
        self.mask_time += time.perf_counter() - t
        R = len(rows)
        if R == 0:
            return
        rows_h[:R] = torch.tensor(rows, dtype=torch.long)
        if self.cuda:
            dev[:R].copy_(host[:R], non_blocking=True)
            rows_d[:R].copy_(rows_h[:R], non_blocking=True)
        apply_token_bitmask(logits, dev[:R], rows_d[:R])

    def logprobs(self, job: _Launched | None) -> list[TokenLogprob]:
        """After finish(job): the plan's logprobs entries' values, in the plan's order."""
        if job is None or job.lp is None:
            return []
        return self._lp.values(job.lp, job.host_ids)

    def _launched(self, job: _Launched, t0: float) -> _Launched:
        """Enqueue the step's one device->host copy of its ids; the step becomes `_last`."""
        if self._d2h_done is not None:  # CUDA
            self._d2h[: job.n].copy_(job.tok, non_blocking=True)
            self._d2h_done.record()
        job.t_launch = time.perf_counter()
        self.model_time += job.t_launch - t0
        self._last = job
        return job

    def _positions(self, job: _Launched) -> torch.Tensor:
        """The (b,) positions a launched step sampled with (a bare graph replay keeps none)."""
        if job.pos is not None:
            return job.pos
        assert self.graphs is not None
        return self.graphs.positions_of_last(job.b)

    def finish(self, job: _Launched | None) -> list[int]:
        """Wait for a launched step (GIL released while waiting) and return its token ids."""
        if job is None:
            return []
        if self._d2h_done is not None:  # CUDA
            self._d2h_done.synchronize()  # releases the GIL while the device works
            out = self._d2h[: job.n].tolist()
        else:
            out = job.tok.tolist()
        if out and min(out) < 0:  # overflow rows (resampled here) or non-finite rows (the scheduler fails them)
            if OVERFLOW_TOKEN in out:
                logits = job.logits
                if logits is None:
                    assert self.graphs is not None  # logits are kept by the eager path only
                    logits = self.graphs.logits(job.n)
                out = self._resolve(out, logits, self._positions(job), job.commit)
            job.host_ids = [max(t, 0) for t in out]  # what a continuation feeds (a failed row: any id)
        self.sample_time += time.perf_counter() - job.t_launch
        return out

    def _resolve(self, out: list[int], logits, pos, commit) -> list[int]:
        """Sample the overflow rows (-1) exactly, eagerly (rare: top_p near 1, flat logits)."""
        rows = [i for i, t in enumerate(out) if t == OVERFLOW_TOKEN]
        for i, t in zip(rows, self.sampler.resolve(logits, rows, pos, commit).tolist()):
            out[i] = t
        return out

    # --- slots ----------------------------------------------------------------------------
    def _move(self, pairs: list[tuple[int, int]]) -> None:
        dst = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        src = torch.tensor([s for _, s in pairs], dtype=torch.long, device=self.device)
        for t in self.pool.tensors():
            t.index_copy_(1, dst, t.index_select(1, src))
        self.sampler.move(pairs)

    def _admit(self, plan: StepPlan) -> list[tuple[str, str]]:
        zero, ok, failed = [], [], []
        for a in plan.admits:
            try:
                if a.init_state is None:
                    zero.append(a.slot)
                else:
                    self.pool.scatter(_check_state(a.init_state, self.pool), [a.slot])
                ok.append(a)
            except Exception as exc:
                failed.append((a.request_id, f"could not load the starting state: {exc}"))
                zero.append(a.slot)
        if zero:
            self.pool.zero_slots(zero)
        if ok:
            self.sampler.reset([a.slot for a in ok], [a.params for a in ok], [a.seed for a in ok])
        return failed

    # --- final states -----------------------------------------------------------------------
    def _copy_out(self, slot: int, request_id: str) -> None:
        g = self.pool.gather([slot])  # device copy, ordered before the slot is reused
        if self.copies is None:  # the CPU: the gather is the copy
            self._ready.append((request_id, g))
        else:
            self.copies.submit(request_id, g)

    def poll_copies(self, wait: bool = False) -> list[tuple[str, State | None]]:
        """Final states whose copy to the CPU completed (all of them when wait=True); None for
        a copy that failed (logged)."""
        ready, self._ready = self._ready, []
        if self.copies is not None:
            ready += self.copies.take(wait)
        return ready

    @property
    def copies_pending(self) -> bool:
        return bool(self._ready or (self.copies is not None and self.copies.pending))

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current device (the kernels launch on the
        current device; with one engine per GPU each engine thread runs on its own)."""
        if self.cuda:  # a tensor's device always names its index ("cuda" alone would not do)
            torch.cuda.set_device(self.pool.tensors()[0].device)

    def detached_state(self, init_state: State | None) -> State:
        """A batch-1 state on the CPU for a request that never ran: a copy of its starting
        state, or zeros with the pool's dtypes."""
        if init_state is not None:
            return init_state.to("cpu").clone()
        return State(*(torch.zeros_like(t[:, :1], device="cpu") for t in self.pool.tensors()))

    def check_state(self, state: State) -> None:
        _check_state(state, self.pool)


def _check_state(st: State, pool: State) -> State:
    if st.batch_size != 1:
        raise ValueError(f"a starting state must have batch 1, got {st.batch_size}")
    for a, b in zip(st.tensors(), pool.tensors()):
        if a.dim() != b.dim() or a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
            raise ValueError(f"state shape {tuple(a.shape)} does not fit the model's {tuple(b.shape)}")
    return st
