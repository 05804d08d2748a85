"""CUDA graphs of short prefills: model.forward_padded for B sequences right-padded to a length
bucket, one graph per (B, bucket).

    graphs = PrefillGraphs(model, pool, max_len=512)
    graphs.capture(range(1, MAX_BATCH + 1))  # at start-up (else each shape on first use)
    if graphs.covers(tokens):
        graphs.run(tokens, slots)          # == model.forward(tokens, pool, slots), states alike

Why: a prefill of a few hundred tokens is bound by the host issuing its ~1,800 launches (~55 a
layer), not by the device: on the H200 a 16-token prefill of the 2.9B model took ~34 ms of host
time against ~6 ms of device time, and a chat turn's prefill stalls every decoding stream for as
long. A replay issues it in one launch.

The graphs index the pool by slot (the kernels' slots= path), so one graph serves every slot; the
padding is skipped by the kernels' lengths= (padded tokens change no state) and only costs the
dense layers' extra rows, at most 2x for lengths just past a bucket. The runner captures every
graph at start-up; run() captures a missing one on first use. Inputs go through one static
device buffer per graph (ids, lengths and slots: one host-to-device copy from pinned memory). A
capture is preceded by one eager run on a scratch state (lazy initialisation: cuBLAS, Triton
compiles), never on the pool. All graphs share one memory pool. A capture that fails leaves its
shape to the eager forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from server.model.graphs import capture_graph
from server.model.state import State

log = logging.getLogger(__name__)

LENGTHS = (16, 32, 64, 128, 256, 512, 1024)
"""Length buckets (tokens per sequence) a graph is captured for, up to PrefillGraphs' max_len."""
MAX_BATCH = 4
"""Sequences per graphed prefill (more run eagerly: they are rarer and fill the device better)."""
MAX_TOKENS = 2048
"""Cap on sequences x bucket length of one graph (its activations stay reserved in the pool)."""


class PrefillGraphs:
    def __init__(self, model, pool: State, *, max_len: int = 512):
        """max_len: the longest sequence a graph covers (a bucket of LENGTHS or less; 0: none)."""
        self.model, self.pool = model, pool
        self.lengths = [n for n in LENGTHS if n <= max_len]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.lengths else None
        self._failed: set[tuple[int, int]] = set()  # shapes whose capture failed: eager from then on

    def capture(self, batches: Sequence[int] = (1,)) -> None:
        """Capture the graphs of these sequence counts at every length bucket now. The runner
        captures all of them at start-up: a capture on first use adds ~0.1 s to that request's
        time to first token, and a capture while other threads touch the device (the runner's
        copy-out threads grow pinned buffers) can be invalidated by them (seen on the H200)."""
        for B in batches:
            for T in self.lengths:
                if (B, T) not in self.graphs and B * T <= MAX_TOKENS:
                    self._try_capture(B, T)

    def covers(self, tokens: Sequence[Sequence[int]]) -> bool:
        """Whether run() replays a graph for these sequences (else the caller runs them eagerly)."""
        if not self.lengths or not 1 <= len(tokens) <= MAX_BATCH:
            return False
        longest = max(len(t) for t in tokens)
        return 1 <= longest <= self.lengths[-1] and len(tokens) * self._bucket(longest) <= MAX_TOKENS

    def run(self, tokens: Sequence[Sequence[int]], slots: Sequence[int]) -> torch.Tensor:
        """model.forward(tokens, pool, slots) by a graph replay (captured now if new): the logits
        after each last token, (B, V) fp32, a static tensor that the graph's next replay
        overwrites. The inputs are checked as forward() checks them."""
        slots = [int(s) for s in slots]
        self.model.check_forward(tokens, self.pool, slots)
        B, T = len(tokens), self._bucket(max(len(t) for t in tokens))
        entry = self.graphs.get((B, T)) or self._try_capture(B, T)
        if entry is None:  # its capture failed once: this shape stays eager
            return self.model.forward(tokens, self.pool, slots)
        graph, buf, logits = entry
        host = torch.zeros(B * T + 2 * B, dtype=torch.long, pin_memory=True)  # ids, lengths, slots
        for j, t in enumerate(tokens):
            host[j * T : j * T + len(t)] = torch.tensor(t, dtype=torch.long)
        host[B * T : B * T + B] = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        host[B * T + B :] = torch.tensor(slots, dtype=torch.long)
        buf.copy_(host, non_blocking=True)
        graph.replay()
        return logits

    def _try_capture(self, B: int, T: int):
        """_capture, or None (logged, and not tried again) if the capture fails: a graph is an
        optimisation, so a failure leaves that shape to the eager forward instead of failing
        the request. Nothing is replayed or written to the pool by a failed capture."""
        if (B, T) in self._failed:
            return None
        try:
            return self._capture(B, T)
        except RuntimeError as e:  # torch.AcceleratorError is one
            self._failed.add((B, T))
            log.warning("prefill graph for %d x %d tokens: capture failed (%s); that shape runs eagerly", B, T, e)
            torch.cuda.synchronize(self.pool.device)
            return None

    def _bucket(self, n: int) -> int:
        return self.lengths[bisect.bisect_left(self.lengths, n)]

    def _capture(self, B: int, T: int):
        t0 = time.perf_counter()
        dev = self.pool.device
        buf = torch.zeros(B * T + 2 * B, dtype=torch.long, device=dev)  # (B*T + 2B,) static inputs
        ids, lengths, slots = buf[: B * T].view(B, T), buf[B * T : B * T + B], buf[B * T + B :]

        def call(state: State) -> torch.Tensor:
            return self.model.forward_padded(ids, lengths.to(torch.int32), slots.to(torch.int32), state)

        lengths.fill_(T)
        slots.copy_(torch.arange(B, device=dev))
        scratch = self.model.zero_state(B)  # the eager run's state: the pool is never touched here
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            call(scratch)
        torch.cuda.current_stream(dev).wait_stream(side)
        del scratch
        with capture_graph(self._mempool) as graph:
            logits = call(self.pool)  # (B, V) static output
        self.graphs[(B, T)] = (graph, buf, logits)
        log.info("prefill graph for %d x %d tokens captured in %.2f s", B, T, time.perf_counter() - t0)
        return self.graphs[(B, T)]
