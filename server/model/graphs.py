"""CUDA graphs of the decode step (model.decode + GPU sampling), one per batch size (bucket).

    graphs = DecodeGraphs(model, pool, sampler=slots_sampler, buckets=[1, 2, 4, 8])
    graphs.capture()                       # at start-up, while every slot is free
    tokens = graphs.step(n, token_ids, positions, commit)   # (n,) long on the device
    tokens = graphs.step_cont(n)           # the next token of the same rows, fed on the device

The buckets come from the caller (the engine's runner passes server.engine.plan.bucket_sizes:
the bucketing rule lives there); a step of n rows replays the graph of the smallest bucket that
holds them. A replay decodes rows [0, bucket) of `pool` in place: the graph holds views of the
pool's own tensors, so states are never copied in or out. Rows [n, bucket) feed token 0 with
commit False: their slots must be free (the scheduler keeps the active slots a prefix), and their
penalties do not change. Inputs go through static buffers;
outputs are static tensors overwritten by the next replay (copy what you keep).
Each graph ends by feeding itself: its sampled ids (clamped to >= 0) become the token inputs and
the positions advance by one, so a continuation (`step_cont`: the same rows again) is a bare
replay, with no input copies between the previous step's ids and the next launch (the padding
rows then feed their own last samples instead of token 0: still commit False, still free slots).
All buckets share one memory pool and are captured largest first.

Steps with host work between the forward and the sampling (grammar masks filled on the host
while the device runs the forward; logprobs taken from the logits before the masks) replay a
forward-only graph of the bucket instead (captured on first use) and sample eagerly:

    logits = graphs.forward(n, token_ids, positions, commit)   # or graphs.forward(n): continue
    ... masks ...; tok = sampler.sample(logits, graphs.positions[:b], graphs.commit[:b])
    graphs.feed(b, tok)                    # the fused graph's self-feed, eagerly
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from server.model import graph_driver
from server.model.state import State

log = logging.getLogger(__name__)


HOIST_MEMSETS = True
"""Captured graphs get graph_driver.hoist_memsets before they are instantiated (cuBLAS's workspace
memsets off the step's critical path); bench_engine's --hoist-memsets switches it for A/Bs."""

MEMSET_KERNELS = True
"""With HOIST_MEMSETS: each moved 4-byte memset becomes a one-thread store kernel (graph_edit's
as_kernels): the kernel that waits for it starts sooner than after a memset node
(docs/performance.md, "cuBLASLt's memsets moved"); bench_engine's --memset-kernels switches it."""


def _new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """A graph to capture into, and whether it keeps its cudaGraph_t for edits (HOIST_MEMSETS
    and a torch with keep_graph, 2.7 or newer)."""
    if HOIST_MEMSETS:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:
            pass
    return torch.cuda.CUDAGraph(), False


def _edit_and_instantiate(graph: torch.cuda.CUDAGraph) -> None:
    """The edits are an optimization: any failure (an old driver: DriverError; anything else is
    a bug, logged with its traceback) leaves the graph as captured, or with orderings added
    (graph_edit.apply_hoists' order), and it is instantiated all the same."""
    try:
        moved, kernels = graph_driver.hoist_memsets(graph.raw_cuda_graph(), MEMSET_KERNELS)
        log.debug("graph edit: %d memsets moved, %d of them as store kernels", moved, kernels)
    except graph_driver.DriverError as e:
        log.warning("captured graph left as it is: %s", e)
    except Exception:
        log.exception("captured graph left as it is: its edit failed")
    graph.instantiate()


@contextlib.contextmanager
def capture_graph(pool: Any) -> Iterator[torch.cuda.CUDAGraph]:
    """A new CUDA graph captured by the block (torch.cuda.graph with pool=pool), edited
    (HOIST_MEMSETS) and instantiated when the block ends; guarded against what other code may do
    meanwhile:
    - Python's cyclic garbage collector is paused. A collection inside a capture (the captured
      Python code allocates) can destroy a dead object's CUDA graphs, events or pinned buffers,
      and such a call while the stream captures invalidates the capture: the GPU tests saw an
      engine's start-up capture fail when an earlier test's engine was collected during it.
      torch 2.11 no longer collects before a capture (torch.compiler.config.force_cudagraph_gc);
      dead objects wait for the next collection. The switch is process-wide, and captures never
      overlap (start-up captures end before the engine's thread starts; it makes the rest), so
      no other capture turns it back on midway.
    - The capture is thread-local (cudaStreamCaptureModeThreadLocal): forward graphs are captured
      on first use while the server runs, beside the copy-out threads' pinned allocations and
      stream waits; under torch's default global mode such a call from another thread
      invalidated the capture (test_model_gpu). This thread's own unsafe calls still fail it."""
    graph, kept = _new_graph()
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield graph
    finally:
        if was:
            gc.enable()
    if kept:
        _edit_and_instantiate(graph)


class DecodeGraphs:
    def __init__(self, model, pool: State, sampler=None, *, buckets: Sequence[int], greedy_only: bool = False):
        """sampler: an engine SamplerSlots (sample(logits, positions, commit, greedy_only)),
        or None for greedy argmax. buckets: the batch sizes of the graphs (at most the pool's)."""
        self.model, self.pool, self.sampler = model, pool, sampler
        self.sizes = sorted(set(buckets))
        if not self.sizes or self.sizes[0] < 1 or self.sizes[-1] > pool.batch_size:
            raise ValueError(f"buckets must lie in [1, {pool.batch_size}], got {list(buckets)}")
        self.max_batch = self.sizes[-1]
        self.greedy_only = greedy_only
        dev = pool.device
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=dev)  # (M,)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)  # (M,)
        self.commit = torch.zeros(self.max_batch, dtype=torch.bool, device=dev)  # (M,)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, tokens)
        self.fwd_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> the decode alone
        self.fwd_logits: dict[int, torch.Tensor] = {}  # bucket -> its (b, V) logits
        self.mempool: Any = None  # the graphs' shared memory pool (a CUDA pool handle)
        self._warm = False
        self._last_bucket = 0  # the bucket of the last replay (what step_cont continues)

    def bucket(self, n: int) -> int:
        """The batch size of the graph that decodes n rows: the smallest bucket >= n."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise ValueError(f"{n} rows do not fit the largest bucket ({self.max_batch})")
        return self.sizes[i]

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        # raw logits (model dtype): the samplers widen them as they read (no (b, V) fp32 copy)
        logits = self.model.decode(self.tokens[:b], self.pool.view(0, b), raw_logits=True)  # (b, V)
        if self.sampler is None:
            tok = logits.argmax(-1)  # (b,)
        else:
            tok = self.sampler.sample(logits, self.positions[:b], self.commit[:b], self.greedy_only)
        return logits, tok

    def _warmup(self) -> None:
        """Eager steps on a side stream before any capture, so that lazy library init (cuBLAS
        handles and workspaces, kernel modules) stays out of the graphs: two at batch 1 and one
        at the largest bucket (batch 1 alone never reaches cuBLAS: its projections run the gemv
        kernel). Only at start-up: writes slots [0, max_batch), all free then (a slot is zeroed
        when a sequence takes it); no penalties (commit False)."""
        s = torch.cuda.Stream(self.pool.device)
        s.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(s):
            for b in (1, self.max_batch, 1):
                self._body(b)
        torch.cuda.current_stream(self.pool.device).wait_stream(s)
        torch.cuda.synchronize(self.pool.device)
        self._warm = True

    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture the given buckets (default all), largest first; call while slots are free."""
        if not self._warm:
            self._warmup()
        for b in sorted(buckets or self.sizes, reverse=True):
            self._capture(b)

    def _capture(self, b: int) -> None:
        t0 = time.perf_counter()
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        with capture_graph(self.mempool) as g:
            out = self._body(b)
            # feed the next replay: ids (an overflow row's -1 as token 0) and positions + 1
            torch.clamp(out[1], min=0, out=self.tokens[:b])
            self.positions[:b].add_(1)
        self.graphs[b], self.outputs[b] = g, out
        log.info("captured decode graph for bucket %d in %.2fs", b, time.perf_counter() - t0)

    def _capture_forward(self, b: int) -> None:
        t0 = time.perf_counter()
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        with capture_graph(self.mempool) as g:
            logits = self.model.decode(self.tokens[:b], self.pool.view(0, b), raw_logits=True)  # (b, V)
        self.fwd_graphs[b], self.fwd_logits[b] = g, logits
        log.info("captured forward graph for bucket %d in %.2fs", b, time.perf_counter() - t0)

    def forward(self, n: int, token_ids=None, positions=None, commit=None) -> torch.Tensor:
        """Decode rows [0, n) without sampling: the (b, V) raw logits of the bucket (a static
        output). Inputs as step(); None: continue from the previous replay (its self-feed or
        feed()). The caller samples and then calls feed()."""
        b = self.bucket(n)
        if b not in self.fwd_graphs:
            if not self._warm:
                raise RuntimeError("DecodeGraphs.capture() must run (at start-up) before forward()")
            self._capture_forward(b)
        if token_ids is None:
            if b != self._last_bucket:
                raise RuntimeError(f"forward({n}): the last replay was bucket {self._last_bucket}, not {b}")
        else:
            self._fill(self.tokens, b, n, token_ids, 0)
            self._fill(self.positions, b, n, positions, 0)
            self._fill(self.commit, b, n, commit, True)
        self.fwd_graphs[b].replay()
        self._last_bucket = b
        return self.fwd_logits[b]

    def feed(self, b: int, tokens: torch.Tensor) -> None:
        """After a forward() replay's sampling: the next replay's inputs (ids clamped to >= 0,
        positions + 1), as the fused graph feeds itself."""
        torch.clamp(tokens[:b], min=0, out=self.tokens[:b])
        self.positions[:b].add_(1)

    def step(self, n: int, token_ids, positions=None, commit=None) -> torch.Tensor:
        """Decode rows [0, n): inputs (n,) (device tensors or lists); returns the sampled
        tokens (n,) on the device (a view of a static output)."""
        b = self.bucket(n)
        if b not in self.graphs:
            if not self._warm:  # the warm-up writes slot 0: only at start-up
                raise RuntimeError("DecodeGraphs.capture() must run (at start-up) before step()")
            self._capture(b)  # a capture only records: safe while slots are in use
        self._fill(self.tokens, b, n, token_ids, 0)
        self._fill(self.positions, b, n, positions, 0)
        self._fill(self.commit, b, n, commit, True)
        self.graphs[b].replay()
        self._last_bucket = b
        return self.outputs[b][1][:n]

    def step_cont(self, n: int) -> torch.Tensor:
        """Decode rows [0, n) once more, fed by the previous replay (same bucket): its sampled
        ids, positions + 1, the same commit mask; nothing is copied in. (n,) on the device."""
        b = self.bucket(n)
        if b != self._last_bucket:
            raise RuntimeError(f"step_cont({n}): the last replay was bucket {self._last_bucket}, not {b}")
        self.graphs[b].replay()
        return self.outputs[b][1][:n]

    def positions_of_last(self, n: int) -> torch.Tensor:
        """The positions (n,) the last replay sampled with (its inputs have moved on by one)."""
        return self.positions[:n] - 1

    def logits(self, n: int) -> torch.Tensor:
        """Logits (n, V) fp32 of the last step() of n rows (widened from the static output)."""
        return self.outputs[self.bucket(n)][0][:n].float()

    @staticmethod
    def _fill(buf: torch.Tensor, b: int, n: int, src, default) -> None:
        pad = False if buf.dtype == torch.bool else 0
        if src is None:
            buf[:n].fill_(default)
        else:
            src = torch.as_tensor(src, dtype=buf.dtype)
            buf[:n].copy_(src, non_blocking=True)
        if b > n:
            buf[n:b].fill_(pad)
