"""Engine statistics: totals plus rates over fixed windows (logged once per window)."""

from __future__ import annotations

import logging
import threading
import time

from .types import EngineStats

log = logging.getLogger("server.engine")


class _Window:
    def __init__(self, start: float):
        self.start = start
        self.steps = 0
        self.step_s = 0.0
        self.model_s = 0.0
        self.sample_s = 0.0
        self.decode_tokens = 0
        self.prefill_tokens = 0


class StatsTracker:
    """Fed by the engine thread twice per step (`count`, then `add_time`); read from any thread."""

    def __init__(self, interval: float):
        self.interval = interval if interval > 0 else 10.0
        self.log_enabled = interval > 0
        self._lock = threading.Lock()
        now = time.monotonic()
        self._cur = _Window(now)
        self._last: _Window | None = None
        self._last_end = now
        self.steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.last_bucket = 0
        self.seconds_total = {"step": 0.0, "model": 0.0, "sample": 0.0}

    def count(self, decode_tokens: int, prefill_tokens: int, bucket: int) -> None:
        """A step and its tokens, counted before any of its events can be delivered (Engine.step):
        a client that has seen its answer finds its tokens in the totals."""
        with self._lock:
            w = self._cur
            w.steps += 1
            w.decode_tokens += decode_tokens
            w.prefill_tokens += prefill_tokens
            self.steps += 1
            self.prompt_tokens_total += prefill_tokens
            self.generation_tokens_total += decode_tokens
            self.last_bucket = bucket

    def add_time(self, step_s: float, model_s: float, sample_s: float) -> None:
        """The time of the step last counted, once it is over (its deliveries included)."""
        with self._lock:
            w = self._cur
            w.step_s += step_s
            w.model_s += model_s
            w.sample_s += sample_s
            t = self.seconds_total
            t["step"], t["model"], t["sample"] = t["step"] + step_s, t["model"] + model_s, t["sample"] + sample_s

    def roll(self, running: int, waiting: int) -> None:
        """Close the window when it is due; log it (engine thread, also while idle)."""
        now = time.monotonic()
        with self._lock:
            if now - self._cur.start < self.interval:
                return
            self._last, self._last_end = self._cur, now
            self._cur = _Window(now)
        if self.log_enabled and (self._last.steps or running or waiting):  # an idle engine stays quiet
            s = self._rates(self._last, now)
            log.info(
                "engine: running=%d waiting=%d decode=%.1f tok/s prefill=%.1f tok/s step=%.2f ms (model %.2f, "
                "sampling %.2f, other %.2f) steps=%d",
                running, waiting, s["decode_tok_s"], s["prefill_tok_s"], s["step_ms"], s["model_ms"], s["sample_ms"],
                s["overhead_ms"], s["steps"],
            )  # fmt: skip

    @staticmethod
    def _rates(w: _Window, end: float) -> dict:
        dt = max(end - w.start, 1e-9)
        n = max(w.steps, 1)
        return {
            "decode_tok_s": w.decode_tokens / dt,
            "prefill_tok_s": w.prefill_tokens / dt,
            "step_ms": 1000.0 * w.step_s / n,
            "overhead_ms": 1000.0 * (w.step_s - w.model_s - w.sample_s) / n,
            "model_ms": 1000.0 * w.model_s / n,
            "sample_ms": 1000.0 * w.sample_s / n,
            "steps": w.steps,
        }

    def snapshot(self, running: int, waiting: int, slots: int) -> EngineStats:
        with self._lock:
            if self._last is not None:
                r = self._rates(self._last, self._last_end)
            else:
                r = self._rates(self._cur, time.monotonic())
            return EngineStats(
                running=running,
                waiting=waiting,
                slots=slots,
                decode_tok_s=r["decode_tok_s"],
                prefill_tok_s=r["prefill_tok_s"],
                step_ms=r["step_ms"],
                steps=self.steps,
                prompt_tokens_total=self.prompt_tokens_total,
                generation_tokens_total=self.generation_tokens_total,
                extra={
                    "overhead_ms": r["overhead_ms"],
                    "model_ms": r["model_ms"],
                    "sample_ms": r["sample_ms"],
                    "window_steps": r["steps"],
                    "bucket": self.last_bucket,
                    "finished_total": self.finished_total,
                    "step_s_total": self.seconds_total["step"],
                    "model_s_total": self.seconds_total["model"],
                    "sample_s_total": self.seconds_total["sample"],
                },
            )
