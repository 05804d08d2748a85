"""Request latency recording: `Recorder`, one per request or task run, on the per-token path.

A Recorder observes a request's time to first token, its inter-token latency and its duration
into the latency histograms of `server.api.metrics.Metrics` (which renders them when /metrics is
scraped). The inter-token latency is observed once per delivery batch with a count: a wake-up
that takes n tokens of one sequence is one `observe(gap / n, n)`, not n calls, as hundreds of
streams pass here per engine step. This module imports metrics, never the other way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from server.api.metrics import Metrics
from server.engine.types import Event


class Timed(Protocol):
    """What a Recorder keeps on each sequence it times (an OpenAI job, a task run)."""

    t_last: float | None


class Recorder:
    """TTFT / inter-token latency / duration metrics of one request (or task run)."""

    def __init__(self, metrics: Metrics | None, t_arrival: float) -> None:
        self.metrics, self.t0, self.first = metrics, t_arrival, True
        self._finished = False

    def on_batch(self, seq: Timed, batch: Sequence[Event]) -> None:
        """A sequence's events taken at one wake-up (their tokens arrived together)."""
        now = time.perf_counter()
        n_new = len(batch[0].token_ids) if len(batch) == 1 else sum(len(ev.token_ids) for ev in batch)
        if n_new and self.metrics is not None:
            if self.first:
                self.metrics.ttft.observe(now - self.t0)
                self.first = False
                if n_new > 1:  # they reached the client with the first: no gap between them
                    self.metrics.itl.observe(0.0, n_new - 1)
            elif seq.t_last:
                self.metrics.itl.observe((now - seq.t_last) / n_new, n_new)
        if n_new:
            seq.t_last = now

    def finish(self) -> None:
        """The request is over: its duration, recorded once however many paths end it."""
        if self.metrics is not None and not self._finished:
            self.metrics.e2e.observe(time.perf_counter() - self.t0)
        self._finished = True
