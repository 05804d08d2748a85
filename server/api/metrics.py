"""Prometheus text-format metrics, without a client library.

The HTTP side records what only it sees (requests, time to first token, inter-token latency:
the latency histograms here, fed by server.api.latency's `Recorder`, one per request or task
run); engine and cache figures are read from `engine.stats()` and the caches' stats when /metrics
is scraped (server.api.ops). Histograms are cumulative-bucket counters as the text format
expects. `openmetrics` rewrites the text as OpenMetrics for a scraper that asks for it. No two
families share a name once a counter's `_total` goes (OpenMetrics names a counter without it):
test_metrics_expositions parses both.
"""

from __future__ import annotations

import bisect
import gc
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from server.engine.protocol import EngineAPI
from server.engine.router import EngineRouter

log = logging.getLogger("server.metrics")

PROBE_ROUTES = ("/health", "/metrics")
"""Routes of monitoring probes: counted, but no sign of activity (the HTTP stats line)."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CLIENT_GONE = 499
"""The status of a non-streamed answer whose client left before it: every route that waits for a
whole answer (OpenAI, lightning, responses) aborts the generation then and answers this. Such a
request counts as aborted when it is answered; a stream's abort is counted by its SSE response
(a stream answers 200, so no request counts twice)."""


class Histogram:
    def __init__(self, name: str, doc: str, buckets: Iterable[float]) -> None:
        self.name, self.doc = name, doc
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self.counts[i] += times
            self.sum += value * times
            self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        with self._lock:
            acc = 0
            for bound, c in zip(self.buckets, self.counts, strict=False):  # counts: one more (+Inf)
                acc += c
                lines.append(f'{self.name}_bucket{{le="{bound}"}} {acc}')
            lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
            lines.append(f"{self.name}_sum {self.sum:.6f}")
            lines.append(f"{self.name}_count {self.count}")
        return lines


class Metrics:
    """HTTP-side counters and histograms; `render(engine, tiers)` adds engine and cache figures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http_requests: dict[tuple[str, str, int], int] = {}
        self.streams_open = 0
        self.ttft = Histogram(
            "rwkv_time_to_first_token_seconds",
            "Seconds from request arrival to its first generated token.",
            LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "rwkv_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request (one per token after the first).",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "rwkv_request_duration_seconds", "Seconds from arrival to the end of a generation request.", LATENCY_BUCKETS
        )
        self.aborted = 0
        self.sources: list[Callable[[], list[str]]] = []
        """More lines for /metrics, each a callable giving complete families (HELP, TYPE, samples),
        e.g. the conversation cache's counters (add_source)."""
        self.stream_paths: dict[str, int] = {}
        """Ended SSE streams by how they were written: "loop" (the event loop), or
        "<source path>_<why direct mode ended>" (server.api.streaming.direct; why: ended, slow, gone,
        stopped, failed): "direct_*" for OpenAI streams (the engine thread writes), "task_direct_*"
        for task streams (their Output's notifications write)."""

    def add_source(self, lines: Callable[[], list[str]]) -> None:
        """Render `lines()` into /metrics (once loaded); a source that fails is left out."""
        self.sources.append(lines)

    def count_stream(self, path: str) -> None:
        with self._lock:
            self.stream_paths[path] = self.stream_paths.get(path, 0) + 1

    def count_request(self, method: str, route: str, status: int) -> None:
        """One answered request (the middleware's access log); a CLIENT_GONE one is an abort too."""
        key = (method, route, status)
        with self._lock:
            self.http_requests[key] = self.http_requests.get(key, 0) + 1
            if status == CLIENT_GONE:
                self.aborted += 1

    def http_totals(self) -> tuple[int, int]:
        """(requests, errors >= 500) so far, monitoring probes (PROBE_ROUTES) left out."""
        with self._lock:
            items = [(k, v) for k, v in self.http_requests.items() if k[1] not in PROBE_ROUTES]
        return sum(v for _, v in items), sum(v for (_, _, s), v in items if s >= 500)

    def render(self, engine: EngineAPI | None = None, tiers: dict[str, dict[str, Any]] | None = None) -> str:
        """The text format: HTTP figures, then (once loaded) the engine's and the cache tiers'."""
        out: list[str] = []
        with self._lock:
            items = sorted(self.http_requests.items())
            paths = sorted(self.stream_paths.items())
        _family(out, "rwkv_http_requests_total", "counter", "HTTP requests answered.")
        for (method, route, status), v in items:
            out.append(f'rwkv_http_requests_total{{method="{method}",route="{_esc(route)}",code="{status}"}} {v}')
        _sample(out, "rwkv_http_streams_open", "gauge", "SSE streams open now.", self.streams_open)
        _sample(
            out,
            "rwkv_requests_aborted_total",
            "counter",
            "Generations aborted because the client went away.",
            self.aborted,
        )
        _family(
            out,
            "rwkv_http_streams_total",
            "counter",
            "SSE streams ended, by writer: the event loop, the engine thread (direct_*, by how it ended), "
            "or the task streams' direct writes (task_direct_*).",
        )
        for path, v in paths:
            out.append(f'rwkv_http_streams_total{{path="{path}"}} {v}')
        for h in (self.ttft, self.itl, self.e2e):
            out.extend(h.render())
        _gc_lines(out)
        _sample(
            out,
            "rwkv_ready",
            "gauge",
            "1 once the model is loaded (whether the engine loop runs: rwkv_engine_alive).",
            int(engine is not None),
        )
        if engine is not None:
            _engine_lines(out, engine)
        if tiers is not None:
            _cache_lines(out, tiers)
        for source in list(self.sources):
            try:
                out.extend(source())
            except Exception:  # a failing figure must not break /metrics
                log.exception("a /metrics source failed")
        return "\n".join(out) + "\n"


def _gc_lines(out: list[str]) -> None:
    """The server process's cyclic garbage collector (each collection pauses every stream)."""
    _family(out, "rwkv_gc_collections_total", "counter", "Cyclic garbage collections, per generation.")
    for generation, st in enumerate(gc.get_stats()):
        out.append(f'rwkv_gc_collections_total{{generation="{generation}"}} {st["collections"]}')


def _engine_lines(out: list[str], engine: EngineAPI) -> None:
    try:
        st = engine.stats()
    except Exception:
        return
    _sample(out, "rwkv_requests_running", "gauge", "Sequences holding a slot, or queued for a free one.", st.running)
    _sample(out, "rwkv_requests_waiting", "gauge", "Sequences queued beyond the free slots.", st.waiting)
    _sample(out, "rwkv_slots", "gauge", "Slots in the state pool.", st.slots)
    _sample(out, "rwkv_prompt_tokens_total", "counter", "Prompt tokens prefilled.", st.prompt_tokens_total)
    _sample(out, "rwkv_generation_tokens_total", "counter", "Tokens generated.", st.generation_tokens_total)
    _sample(out, "rwkv_engine_steps_total", "counter", "Engine steps run.", st.steps)
    _sample(out, "rwkv_engine_step_seconds", "gauge", "Recent mean engine step time.", st.step_ms / 1000.0)
    _sample(out, "rwkv_decode_tokens_per_second", "gauge", "Recent decode throughput.", st.decode_tok_s)
    _sample(out, "rwkv_prefill_tokens_per_second", "gauge", "Recent prefill throughput.", st.prefill_tok_s)
    _sample(out, "rwkv_engine_alive", "gauge", "1 while the engine loop runs.", int(engine.is_alive))
    for key, value in sorted((st.extra or {}).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name, help_, scale = ENGINE_FIGURES.get(key, (f"rwkv_engine_{_name(key)}", f"Engine figure {key}.", 1))
            kind = "counter" if name.endswith("_total") else "gauge"  # a running sum is a counter
            _sample(out, name, kind, help_, value * scale)
    if isinstance(engine, EngineRouter):  # one engine per device (--devices): the counts, then each's figures
        _sample(out, "rwkv_engine_engines", "gauge", "Engine figure engines.", st.engines)
        _sample(out, "rwkv_engine_engines_alive", "gauge", "Engine figure engines_alive.", st.engines_alive)
        _device_lines(out, engine)


ENGINE_FIGURES: dict[str, tuple[str, str, float]] = {
    # EngineStats.extra key -> (family, help, factor to the family's unit: seconds, not ms)
    "overhead_ms": ("rwkv_engine_overhead_seconds", "Recent mean host time of a step beside model and sampler.", 1e-3),
    "model_ms": ("rwkv_engine_model_seconds", "Recent mean time of a step's model forward.", 1e-3),
    "sample_ms": ("rwkv_engine_sample_seconds", "Recent mean time of a step's sampling.", 1e-3),
    "window_steps": ("rwkv_engine_window_steps", "Steps the recent means are taken over.", 1),
    "bucket": ("rwkv_engine_graph_rows", "Rows of the batch size bucket (CUDA graph) the last step ran.", 1),
    "finished_total": ("rwkv_engine_finished_total", "Sequences finished.", 1),
    "step_s_total": ("rwkv_engine_step_time_seconds_total", "Seconds spent in engine steps.", 1),
    "model_s_total": ("rwkv_engine_model_time_seconds_total", "Seconds spent in the model forward.", 1),
    "sample_s_total": ("rwkv_engine_sample_time_seconds_total", "Seconds spent sampling.", 1),
}
"""The engine's extra figures as Prometheus families (another key: rwkv_engine_<key>, as it is).
The running sums are `*_time_seconds_total`, not `*_seconds_total`: OpenMetrics names a counter's
family without `_total`, which would clash with the recent-mean gauges `rwkv_engine_*_seconds`."""

DEVICE_FAMILIES = (  # (name, kind, help, the EngineStats field; "alive": the engine's is_alive)
    ("rwkv_device_engine_alive", "gauge", "1 while this device's engine loop runs.", "alive"),
    ("rwkv_device_requests_running", "gauge", "Sequences holding or queued for a free slot on this device.", "running"),
    ("rwkv_device_requests_waiting", "gauge", "Sequences queued beyond this device's free slots.", "waiting"),
    ("rwkv_device_slots", "gauge", "Slots in this device's state pool.", "slots"),
    ("rwkv_device_prompt_tokens_total", "counter", "Prompt tokens prefilled on this device.", "prompt_tokens_total"),
    ("rwkv_device_generation_tokens_total", "counter", "Tokens generated on this device.", "generation_tokens_total"),
    ("rwkv_device_decode_tokens_per_second", "gauge", "Recent decode throughput of this device.", "decode_tok_s"),
)


def _device_lines(out: list[str], router: EngineRouter) -> None:
    """One engine per device (--devices): the engine figures per device, labelled device and
    engine (its index in --devices; a device may be named twice on the CPU)."""
    try:
        rows = router.engines()
    except Exception:
        return
    for name, kind, doc, field in DEVICE_FAMILIES:
        _family(out, name, kind, doc)
        for i, (device, alive, st) in enumerate(rows):
            value = int(alive) if field == "alive" else getattr(st, field)
            out.append(f'{name}{{device="{_esc(device)}",engine="{i}"}} {_num(value)}')


def _cache_lines(out: list[str], tiers: dict[str, dict[str, Any]]) -> None:
    """State cache bytes / entries / hits / misses per tier."""
    docs = {
        "bytes": ("gauge", "State bytes held"),
        "entries": ("gauge", "States held"),
        "hits": ("counter", "Lookups that found the state"),
        "misses": ("counter", "Lookups that did not find the state"),
    }
    for key, (kind, doc) in docs.items():
        name = f"rwkv_state_cache_{key}" + ("_total" if kind == "counter" else "")
        _family(out, name, kind, f"{doc}, per cache tier.")
        for tier, d in sorted(tiers.items()):
            if isinstance(d.get(key), (int, float)):
                out.append(f'{name}{{tier="{_esc(tier)}"}} {_num(d[key])}')


def _family(out: list[str], name: str, kind: str, doc: str) -> None:
    out.append(f"# HELP {name} {doc}")
    out.append(f"# TYPE {name} {kind}")


def _sample(out: list[str], name: str, kind: str, doc: str, value: float) -> None:
    _family(out, name, kind, doc)
    out.append(f"{name} {_num(value)}")


def _num(v: float) -> str:
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() else f"{v:.6g}"


def _name(key: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in key.lower())


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


OPENMETRICS = "application/openmetrics-text"
OPENMETRICS_TYPE = f"{OPENMETRICS}; version=1.0.0; charset=utf-8"


def openmetrics(text: str) -> str:
    """The text format (render's) as OpenMetrics 1.0: a counter's family is named without its
    samples' `_total`, a quote in a HELP is escaped, no blank line, "# EOF" at the end."""
    lines = [ln for ln in text.splitlines() if ln]
    counters = {ln.split()[2] for ln in lines if ln.startswith("# TYPE ") and ln.endswith(" counter")}
    out = []
    for ln in lines:
        if ln.startswith(("# HELP ", "# TYPE ")):
            _, kind, name, rest = ln.split(" ", 3)
            if name in counters and name.endswith("_total"):
                name = name[: -len("_total")]
            if kind == "HELP":
                rest = rest.replace('"', '\\"')
            ln = f"# {kind} {name} {rest}"
        out.append(ln)
    return "\n".join([*out, "# EOF"]) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text into {"name{labels}": value} (tests and tools)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            values[key] = float(val)
        except ValueError:
            continue
    return values
