"""HTTP benchmark: a real server (uvicorn subprocess), N concurrent streaming clients.

    PYTHONPATH=. python test/bench/bench_http.py --model synthetic:2.9b --streams 64,256
    PYTHONPATH=. python test/bench/bench_http.py --model synthetic:tiny --device cpu --streams 8 --max-tokens 16

Each client streams one /v1/completions request (ignore_eos, fixed max_tokens, usage included;
--route chat: /v1/chat/completions with the prompt as the user message; --route tasks: the task
API's /v1/tasks/create, a persistent task whose output, progress and final state are stored;
--route tmp: /v1/tasks/tmp, a task that is never stored. The task API has no ignore_eos: a stream
can end early on a sampled end token, which the token counts show; --route contents: rwkv_lightning's
batch route, /v1/chat/completions with `contents` holding the one prompt, streamed, with the same
sampling and ignore_eos, --chunk-size tokens per event (docs/lightning.md). Its native SSE has no
usage: each stream's tokens are its max_tokens, exact with ignore_eos and no stop strings).
The clients are bench_http_host.py's raw-socket asyncio client (HTTP/1.1, one connection per
stream, no SSE/JSON parsing per event), split over --client-procs processes (default: one per
128 streams) so that the client is never the bottleneck; each process's CPU time is printed.

Figures per N:
- decode_tok_s: SERVER-side steady-state throughput: the server's generated-token counter
  (/metrics rwkv_generation_tokens_total, polled every 0.2 s) over the window where every stream
  is generating (from the last first token to the first stream's end); `delivered_tok_s`: the
  same window measured by the clients (tokens received; see delivered_rate); `wave_tok_s`: all
  completion tokens / wall time of the whole wave (ramp-up and tail included);
- TTFT p50/p95 (request sent -> first content bytes), inter-token p50/p95: the gaps between the
  reads that carried `data:` events of one stream (a read that carries several events counts once);
- client CPU (all client processes: seconds, % of one core, us per token) and server CPU.
Before each measured wave the bench waits until no state waits to be written behind (the
warm-up's task states would otherwise be written during it; `drain_s` in the line says how long
that took, --drain-timeout 0 measures with the writes overlapping).
Prints a table and appends one JSON line per N to test/bench/results.jsonl (mode "http").
The server runs with max_batch >= N (RWKV_MAX_BATCH) and CUDA graphs on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(HERE))

from bench_engine import add_model_args, commit, write_lines
from bench_http_host import pct, proc_cpu, run_streams
from util_server import ServerProcess

STREAMS_PER_CLIENT = 128
CLIENT_START_LEAD_S = 2.0  # client processes are started this long before their streams begin


# --- client process ---------------------------------------------------------------------------
def client_main(spec: str) -> None:
    """spec = host,port,n,max_tokens,seed0,stagger_ms,start_at,prompt-file: n streams (stream j
    starts j * stagger_ms / n after the first), the first at time.perf_counter() == start_at
    (CLOCK_MONOTONIC: the same clock in every process, so all client processes start together);
    prints one JSON line."""
    host, port, n, max_tokens, seed0, stagger_ms, start_at, route, prompt_file = spec.split(",", 8)
    route, _, chunk_size = route.partition(":")
    prompt = Path(prompt_file).read_text()
    what = {"messages": [{"role": "user", "content": prompt}]} if route == "chat" else {"prompt": prompt}
    common = {**what, "max_tokens": int(max_tokens), "stream": True, "temperature": 1.0, "top_p": 0.3}
    if route == "contents":  # lightning's names for the same sampling (our defaults made explicit)
        common = {"contents": [prompt], "max_tokens": int(max_tokens), "stream": True, "temperature": 1.0,
                  "top_p": 0.3, "top_k": 0, "alpha_presence": 0.5, "alpha_frequency": 0.5, "alpha_decay": 0.996,
                  "stop_tokens": [], "ignore_eos": True, "chunk_size": int(chunk_size or 1)}
        extra, path = {}, "/v1/chat/completions"
    elif route in ("tasks", "tmp"):
        extra, path = {"stop": []}, "/v1/tasks/create" if route == "tasks" else "/v1/tasks/tmp"
    else:
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    seed = {} if route == "contents" else {"seed": int(seed0)}  # (lightning has no seed)
    bodies = [json.dumps({**common, **extra, **{k: v + i for k, v in seed.items()}}).encode() for i in range(int(n))]

    time.sleep(max(0.0, float(start_at) - time.perf_counter()))
    c0 = os.times()
    res = asyncio.run(run_streams(host, int(port), path, bodies, float(stagger_ms)))
    c1 = os.times()
    if route == "contents":  # no usage in lightning's stream: ignore_eos, no stop strings -> max_tokens each
        for r in res:
            r["tokens"] = int(max_tokens) if r["stamps"] else 0
    streams = [{"start": r["start"], "first": r["stamps"][0] if r["stamps"] else None, "end": r["end"],
                "tokens": r["tokens"], "stamps": [round(t, 6) for t in r["stamps"]], "counts": r["counts"]}
               for r in res]  # fmt: skip
    print(json.dumps({"cpu": (c1.user + c1.system) - (c0.user + c0.system), "streams": streams}))


# --- driver -----------------------------------------------------------------------------------
def drain_writes(url: str, timeout: float) -> float:
    """Wait until the server's write-behind tier is empty (/metrics
    rwkv_state_cache_entries{tier="write_behind"}), at most `timeout` s; returns the seconds
    waited (0.0 when nothing was pending or timeout is 0)."""
    t0 = time.perf_counter()
    while timeout > 0 and time.perf_counter() - t0 < timeout:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pending = [ln for ln in text.splitlines()
                   if ln.startswith('rwkv_state_cache_entries{tier="write_behind"}')]
        if not pending or float(pending[0].split()[-1]) == 0:
            break
        time.sleep(0.2)
    waited = time.perf_counter() - t0
    return waited if waited > 0.25 else 0.0


class TokenCounter(threading.Thread):
    """Polls the server's generated-token counter: [(perf_counter, tokens)]."""

    def __init__(self, url: str, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.period = url + "/metrics", period
        self.samples: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    text = r.read().decode()
                t = time.perf_counter()
                for line in text.splitlines():
                    if line.startswith("rwkv_generation_tokens_total"):
                        self.samples.append((t, float(line.split()[-1])))
                        break
            except OSError:
                pass
            self.halt.wait(self.period)

    def rate(self, t_a: float, t_b: float) -> float | None:
        """tok/s between the first sample >= t_a and the last sample <= t_b (None: too short)."""
        inside = [s for s in self.samples if t_a <= s[0] <= t_b]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.3:
            return None
        (ta, na), (tb, nb) = inside[0], inside[-1]
        return (nb - na) / (tb - ta)


def wave(srv: ServerProcess, n: int, max_tokens: int, prompt_file: str, procs: int, stagger_ms: float = 0,
         route: str = "completions") -> dict:
    procs = max(1, min(procs, n))
    sizes = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    counter = TokenCounter(srv.url)
    counter.start()
    time.sleep(0.3)
    s0 = proc_cpu(srv.proc.pid)[1]
    # every client process starts its streams at t0: without this, a process still importing
    # while the other's streams run skews the wave (streams of the first process could end
    # before the second's begin, leaving no window where all N streams decode)
    t0 = time.perf_counter() + CLIENT_START_LEAD_S
    children, seed = [], 0
    for size in sizes:
        spec = f"127.0.0.1,{srv.port},{size},{max_tokens},{seed},{stagger_ms},{t0},{route},{prompt_file}"
        children.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client", spec],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        seed += size
    outs = [c.communicate() for c in children]
    wall = time.perf_counter() - t0
    s1 = proc_cpu(srv.proc.pid)[1]
    time.sleep(0.25)
    counter.halt.set()
    counter.join(10)
    for c, (_, err) in zip(children, outs, strict=True):
        if c.returncode:
            raise RuntimeError(f"client failed: {err[-3000:]}\n{srv.log_tail()}")
    parts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    streams = [s for p in parts for s in p["streams"]]
    toks = sum(s["tokens"] for s in streams)
    ttft = [(s["first"] - s["start"]) * 1e3 for s in streams if s["first"] is not None]
    gaps = [(b - a) * 1e3 for s in streams for a, b in itertools.pairwise(s["stamps"])]
    t_all = max((s["first"] for s in streams if s["first"] is not None), default=t0)
    t_end = min(s["end"] for s in streams)
    steady = counter.rate(t_all, t_end)  # None: no window where all N streams decode (printed as such)
    delivered = delivered_rate(streams, t_all)
    client_cpu = sum(p["cpu"] for p in parts)
    # where the wave's wall time goes: until every stream has its first token, the window where
    # all decode, and the tail after the first stream's next-to-last read (final events, exits)
    t_b = min((s["stamps"][-2] for s in streams if len(s["stamps"]) > 1), default=t_all)
    t_last = max(s["end"] for s in streams)
    phases = {"first_s": t_all - t0, "steady_s": max(0.0, t_b - t_all), "tail_s": t_last - t_b,
              "exit_s": t0 + wall - t_last,
              "sent_s": max(s["start"] for s in streams) - t0,  # the last request left its client
              "ttft_max_ms": max(ttft, default=0.0),
              "last_event_p95_ms": max(p.get("last_p95", 0.0) for p in parts)}
    return {"streams": n, "tokens": toks, "wall_s": wall, "wave_tok_s": toks / wall, **phases,
            "decode_tok_s": steady, "steady": steady is not None, "delivered_tok_s": delivered,
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
            "itl_p50": pct(gaps, 0.5), "itl_p95": pct(gaps, 0.95),
            "client_procs": len(sizes), "client_cpu_s": client_cpu,
            "client_cpu_pct": 100 * client_cpu / wall, "client_us_per_tok": 1e6 * client_cpu / max(toks, 1),
            "server_cpu_s": s1 - s0, "server_us_per_tok": 1e6 * (s1 - s0) / max(toks, 1)}  # fmt: skip


def delivered_rate(streams: list[dict], t_a: float) -> float | None:
    """CLIENT-side steady rate: tokens the streams received in (t_a, t_b] / (t_b - t_a), where t_a
    is the last stream's first token and t_b the earliest next-to-last data read of any stream
    (the last read carries the final event, which on the task routes waits for the task's final
    row). A read's tokens are its share of its stream's tokens by data events (ev/tok is ~1).
    No polling, no server clock: the /metrics samples behind decode_tok_s are served by the same
    event loop as the streams, so a busy loop delays them and skews a short window."""
    if any(len(s["stamps"]) < 3 for s in streams):
        return None
    t_b = min(s["stamps"][-2] for s in streams)
    if t_b - t_a < 0.3:
        return None
    got = 0.0
    for s in streams:
        per_event = s["tokens"] / max(sum(s["counts"]), 1)
        got += per_event * sum(c for t, c in zip(s["stamps"], s["counts"], strict=True) if t_a < t <= t_b)
    return got / (t_b - t_a)


def _r(x: float, nd: int) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


ROUTES = ("completions", "chat", "tasks", "tmp", "contents")


def run_route(srv: ServerProcess, a: argparse.Namespace, route: str, streams: list[int], prompt_file: str,
              gpu: str, max_batch: int) -> list[dict]:
    """One route on a running server: a warm-up wave per stream count, then the measured ones."""
    spec = f"contents:{a.chunk_size}" if route == "contents" else route  # (the client spec's route field)
    lines: list[dict] = []
    for n in streams:  # warm-up (HTTP path, graph buckets up to each N)
        wave(srv, n, 8, prompt_file, 1, route=spec)
    for n in streams:
        procs = a.client_procs or math.ceil(n / STREAMS_PER_CLIENT)
        drained = drain_writes(srv.url, a.drain_timeout)
        r = wave(srv, n, a.max_tokens, prompt_file, procs, a.stagger_ms, spec)
        r["drain_s"] = drained
        steady = (f"{r['decode_tok_s']:9.1f} tok/s" if r["steady"]
                  else "(no steady window: not all streams overlapped)")
        got = f"{r['delivered_tok_s']:.1f}" if r["delivered_tok_s"] is not None else "-"
        print(f"  {route} {n:4d} streams: server {steady}, delivered {got} "
              f"(wave {r['wave_tok_s']:.1f})  TTFT p50 {r['ttft_p50']:.0f} p95 {r['ttft_p95']:.0f} ms  "
              f"ITL p50 {r['itl_p50']:.1f} p95 {r['itl_p95']:.1f} ms  client CPU {r['client_cpu_pct']:.0f}% "
              f"of a core in {r['client_procs']} proc(s) ({r['client_us_per_tok']:.1f} us/tok)  "
              f"server CPU {r['server_us_per_tok']:.1f} us/tok", flush=True)
        lines.append({"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu, "model": a.model,
                      "state_dtype": a.state_dtype, "mode": "http", "batch": n,
                      "decode_tok_s": _r(r["decode_tok_s"], 1), "wave_tok_s": round(r["wave_tok_s"], 1),
                      "delivered_tok_s": _r(r["delivered_tok_s"], 1),
                      "ttft_p50_ms": _r(r["ttft_p50"], 1), "ttft_p95_ms": _r(r["ttft_p95"], 1),
                      "itl_p50_ms": _r(r["itl_p50"], 2), "itl_p95_ms": _r(r["itl_p95"], 2),
                      "max_tokens": a.max_tokens, "stagger_ms": a.stagger_ms or None, "dtype": a.dtype,
                      "max_batch": max_batch,
                      "cuda_graphs": not a.no_cuda_graphs, "client_procs": r["client_procs"],
                      "client_cpu_pct": round(r["client_cpu_pct"], 1),
                      "client_us_per_tok": round(r["client_us_per_tok"], 1),
                      "server_us_per_tok": round(r["server_us_per_tok"], 1)})  # fmt: skip
        if r["drain_s"]:
            lines[-1]["drain_s"] = round(r["drain_s"], 2)
            print(f"        (waited {r['drain_s']:.1f} s for the previous waves' states to be written)")
        print(f"        wave {r['wall_s']:.2f} s: first tokens {r['first_s']:.2f}, all decoding "
              f"{r['steady_s']:.2f}, tail {r['tail_s']:.2f}, clients' exit {r['exit_s']:.2f} "
              f"(last event p95 {r['last_event_p95_ms']:.0f} ms); last request sent at {r['sent_s']:.2f} s, "
              f"TTFT max {r['ttft_max_ms']:.0f} ms")
        lines[-1].update({k: round(r[k], 2) for k in ("first_s", "steady_s", "tail_s", "exit_s", "sent_s")})
        lines[-1]["ttft_max_ms"] = round(r["ttft_max_ms"], 1)
        if a.variant:
            lines[-1]["variant"] = a.variant
        if route != "completions":
            lines[-1]["route"] = route
        if route == "contents":
            lines[-1]["chunk_size"] = a.chunk_size
    return lines


def n_engines(devices: str) -> int:
    """Engines a --devices value starts (1 when empty)."""
    if devices == "all":
        import torch

        return max(torch.cuda.device_count(), 1)
    return max(len([d for d in devices.split(",") if d.strip()]), 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    add_model_args(p)
    p.add_argument("--state-dtype", default="fp32")
    p.add_argument("--streams", default="64,256")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=0,
                   help="slots per engine; 0: max(streams) / engines (never less than that)")
    p.add_argument("--devices", default="",
                   help="one engine per GPU in one server (RWKV_DEVICES): cuda:0,cuda:1 or all; lines get 'gpus'")
    p.add_argument("--client-procs", type=int, default=0, help=f"0: one per {STREAMS_PER_CLIENT} streams")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--stagger-ms", type=float, default=0,
                   help="spread the stream starts over this window (0: the whole wave at once); TTFT is then "
                        "measured against a server that is already decoding the earlier streams")
    p.add_argument("--prompt", default="User: Tell me a long story about a lighthouse keeper.\n\nAssistant:")
    p.add_argument("--out", default=str(ROOT / "test/bench/results.jsonl"))
    p.add_argument("--drain-timeout", type=float, default=180,
                   help="before a wave, wait up to this long until no state waits to be written behind "
                        "(task routes: the previous wave's 21 MB states would otherwise be written during "
                        "this one); 0: do not wait")
    p.add_argument("--variant", default=None, help="a tag for the result lines (e.g. what the env changed)")
    p.add_argument("--route", default="completions",
                   help="one or more of completions, chat, tasks, tmp, contents, comma-separated (one server "
                        "runs them in that order). chat: /v1/chat/completions with the prompt as one user "
                        "message (its stop strings apply); "
                        "contents: rwkv_lightning's batch body with the one prompt")
    p.add_argument("--chunk-size", type=int, default=1,
                   help="--route contents: tokens per streamed event (lightning's default is 4)")
    a = p.parse_args()
    if a.client:
        client_main(a.client)
        return
    streams = [int(s) for s in a.streams.split(",")]
    routes = a.route.split(",")
    if bad := [r for r in routes if r not in ROUTES]:
        p.error(f"--route: unknown {bad} (one or more of {', '.join(ROUTES)}, comma-separated)")
    engines = n_engines(a.devices)
    max_batch = max(a.max_batch, math.ceil(max(streams) / engines))  # per engine
    env = {"RWKV_DEVICE": a.device, "RWKV_DEVICES": a.devices, "RWKV_DTYPE": a.dtype, "RWKV_STATE_DTYPE": a.state_dtype,
           "RWKV_MAX_BATCH": str(max_batch), "RWKV_CUDA_GRAPHS": "0" if a.no_cuda_graphs else "1",
           "RWKV_MAX_QUEUE": "0", "RWKV_STEP_TOKEN_BUDGET": str(max(2048, 32 * max_batch)),
           "RWKV_LOG_LEVEL": "warning"}  # fmt: skip
    srv = ServerProcess(model=a.model, env=env, stop_timeout=20)
    prompt_file = str(srv.tmp_dir / "prompt.txt")
    Path(prompt_file).write_text(a.prompt)
    t0 = time.perf_counter()
    srv.start(timeout=300)
    print(f"server up in {time.perf_counter() - t0:.1f}s at {srv.url} (max_batch {max_batch}, "
          f"cuda graphs {'off' if a.no_cuda_graphs else 'on'})", flush=True)
    gpu = "cpu"
    if a.device.startswith("cuda") or a.devices.startswith(("cuda", "all")):
        import torch

        gpu = torch.cuda.get_device_name(0)
    lines = []
    try:
        for route in routes:  # one server: the task routes last (their states are written behind)
            lines += run_route(srv, a, route, streams, prompt_file, gpu, max_batch)
        if a.devices:  # one engine per GPU: how many served the waves (max_batch is per engine)
            for x in lines:
                x["gpus"] = engines
    finally:
        srv.cleanup()  # stops it; removes its temporary directory
        print(f"server log: {srv.log_path}\n{srv.log_tail() if hasattr(srv, 'log_tail') else ''}"[-3000:])
    write_lines(a.out, lines)
    print(f"\n{'streams':>7} {'tok/s':>10} {'delivered':>10} {'wave':>10} {'TTFT p50':>9} {'p95':>7} "
          f"{'ITL p50':>8} {'p95':>7} {'client%':>8}")
    for x in lines:
        tok_s = f"{x['decode_tok_s']:10.1f}" if x["decode_tok_s"] is not None else f"{'-':>10}"
        got = f"{x['delivered_tok_s']:10.1f}" if x["delivered_tok_s"] is not None else f"{'-':>10}"
        print(f"{x['batch']:7d} {tok_s} {got} {x['wave_tok_s']:10.1f} {x['ttft_p50_ms']:9.0f} "
              f"{x['ttft_p95_ms']:7.0f} {x['itl_p50_ms']:8.1f} {x['itl_p95_ms']:7.1f} {x['client_cpu_pct']:8.0f}")


if __name__ == "__main__":
    main()
