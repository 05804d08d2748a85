"""Host (Python) cost of the HTTP path per streamed token: the REAL server (uvicorn, the app, the
engine loop) with a model and a sampler that cost nothing, N concurrent streaming clients.

    PYTHONPATH=. python test/bench/bench_http_host.py                         # N = 64, 256; chat + tasks
    PYTHONPATH=. python test/bench/bench_http_host.py --streams 256 --gpu-ms 12   # simulated 12 ms device step
    PYTHONPATH=. python test/bench/bench_http_host.py --streams 512 --gpu-ms 5 --engines 2   # two engines, 256 each
    PYTHONPATH=. python test/bench/bench_http_host.py --streams 256 --py-spy prof.txt  # + py-spy of the server
    BENCH_CPROFILE=srv.prof BENCH_CPROFILE_SECS=14 PYTHONPATH=. python test/bench/bench_http_host.py ...
        # cProfile of the server's event-loop thread, its stats written 14 s after the start
    BENCH_GC=8,14 PYTHONPATH=. python test/bench/bench_http_host.py ...
        # the server log gets its GC pause totals at 8 s and 14 s after the start

The server runs in a subprocess started through this file (`--serve`: patch server.model.load_model
to return bench_engine_host.FakeModel, put its FakeSampler into the runner, optionally simulate a
device step of --gpu-ms with the GIL released and deferred delivery as on CUDA, then
`server.cli.main(["serve", ...])`). The clients run in another subprocess: raw asyncio sockets,
HTTP/1.1, one connection per stream; they only count `data:` events and read the usage of the
last one (their own CPU time is printed: it must stay well below the server's).

Figures per (route, N): completion tokens / wall (tok/s), server process CPU us per token
(utime+stime from /proc/<pid>/stat; "loop" = the main thread, which runs the event loop; "other"
= the engine thread and the rest), client CPU us per token, inter-event gap p50/p95 per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "test"))

PROMPT = "User: Tell me a long story about a lighthouse keeper.\n\nAssistant:"
CLK = os.sysconf("SC_CLK_TCK")


# --- server side (runs in the server subprocess) --------------------------------------------
def serve(argv: list[str], gpu_ms: float) -> int:
    from bench_engine_host import FakeModel, FakeSampler, simulate_device

    import server.model as sm
    from server.engine import engine as eng_mod
    from server.tokenizer import get_tokenizer

    sm.load_model = lambda *a, **k: FakeModel()
    start = eng_mod.Engine.start
    words = get_tokenizer().encode(" the quick brown fox jumps over the lazy dog, and then it runs away. ")

    def patched_start(self):
        out = start(self)
        self.runner.sampler = FakeSampler(words)
        if gpu_ms > 0:
            simulate_device(self, gpu_ms)
        return out

    eng_mod.Engine.start = patched_start
    from server.cli import main as cli_main

    if os.environ.get("BENCH_GC"):  # the server's GC pauses so far, printed into its log at these seconds
        _gc_report([float(t) for t in os.environ["BENCH_GC"].split(",")])
    prof_out = os.environ.get("BENCH_CPROFILE")
    if not prof_out:
        return cli_main(["serve", *argv])
    import cProfile
    import threading

    prof = cProfile.Profile()  # the main thread only: the event loop
    secs = float(os.environ.get("BENCH_CPROFILE_SECS", "30"))
    threading.Timer(secs, lambda: prof.dump_stats(prof_out)).start()  # the stats so far
    prof.enable()
    return cli_main(["serve", *argv])


def _gc_report(at: list[float]) -> None:
    import gc
    import threading

    acc = {"s": 0.0, "t0": 0.0, "n": [0, 0, 0]}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            acc["t0"] = time.perf_counter()
        else:
            acc["s"] += time.perf_counter() - acc["t0"]
            acc["n"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    for t in at:
        threading.Timer(t, lambda t=t: print(f"GC at {t:.0f} s: {acc['s'] * 1e3:.0f} ms in {acc['n']} collections"
                                             " (generations 0 / 1 / 2)", flush=True)).start()


# --- client side (runs in the client subprocess) --------------------------------------------
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


async def one_stream(host: str, port: int, path: str, body: bytes, res: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    req = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\naccept: text/event-stream\r\n\r\n").encode() + body
    t0 = time.perf_counter()
    writer.write(req)
    stamps: list[float] = []
    counts: list[int] = []  # data events in the read at stamps[i]
    tail = b""
    events = 0
    while True:
        data = await reader.read(65536)
        if not data:
            break
        n = data.count(b"data: ")
        if n and not (n == 1 and b'"role":"assistant"' in data):  # a chat's role chunk is no token
            stamps.append(time.perf_counter())
            counts.append(n)
            events += n
        tail = (tail + data)[-2048:]
        if b"data: [DONE]" in tail:
            break
    writer.close()
    m = _USAGE.findall(tail)
    if not tail.startswith(b"HTTP/1.1 200") and not stamps:
        raise RuntimeError(f"bad answer: {tail[:300]!r}")
    res.append({"start": t0, "end": time.perf_counter(), "stamps": stamps, "counts": counts, "events": events,
                "tokens": int(m[-1]) if m else 0})


async def run_streams(host: str, port: int, path: str, bodies: list[bytes], stagger_ms: float = 0) -> list:
    """One stream per body, stream j started j * stagger_ms / len(bodies) after the first;
    returns one_stream's records."""
    res: list = []
    gap = stagger_ms / 1e3 / max(len(bodies), 1)

    async def later(j: int, body: bytes) -> None:
        await asyncio.sleep(j * gap)
        await one_stream(host, port, path, body, res)

    await asyncio.gather(*(later(j, b) for j, b in enumerate(bodies)))
    return res


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def client_main(host: str, port: int, route: str, n: int, max_tokens: int, stagger_ms: float = 0) -> None:
    if route == "chat":
        path = "/v1/chat/completions"
        mk = lambda i: {"model": "x", "messages": [{"role": "user", "content": "Tell me a story."}],  # noqa: E731
                        "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
                        "stream_options": {"include_usage": True}}
    elif route == "completions":
        path = "/v1/completions"
        mk = lambda i: {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,  # noqa: E731
                        "temperature": 0, "stream_options": {"include_usage": True}}
    else:
        path = "/v1/tasks/tmp" if route == "tmp" else "/v1/tasks/create"
        mk = lambda i: {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0,  # noqa: E731
                        "stop": []}

    bodies = [json.dumps(mk(i)).encode() for i in range(n)]
    c0, t0 = os.times(), time.perf_counter()
    res = asyncio.run(run_streams(host, port, path, bodies, stagger_ms))
    wall, c1 = time.perf_counter() - t0, os.times()
    gaps = [(b - a) * 1e3 for r in res for a, b in itertools.pairwise(r["stamps"])]
    ttft = [(r["stamps"][0] - r["start"]) * 1e3 for r in res if r["stamps"]]
    # the wait for a stream's last chunk (a task's final event comes once its final row is stored)
    last = [(r["stamps"][-1] - r["stamps"][-2]) * 1e3 for r in res if len(r["stamps"]) > 1]
    print(json.dumps({"ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "wall": wall,
                      "tokens": sum(r["tokens"] for r in res), "events": sum(r["events"] for r in res),
                      "client_cpu": (c1.user + c1.system) - (c0.user + c0.system),
                      "gap_p50": pct(gaps, 0.5), "gap_p95": pct(gaps, 0.95),
                      "last_p50": pct(last, 0.5), "last_p95": pct(last, 0.95)}))


# --- driver ---------------------------------------------------------------------------------
def proc_cpu(pid: int) -> tuple[float, float]:
    """(main thread CPU s, whole process CPU s)."""
    def ticks(path: str) -> float:
        with open(path) as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / CLK
    return ticks(f"/proc/{pid}/task/{pid}/stat"), ticks(f"/proc/{pid}/stat")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--routes", default="chat,tasks", help="chat, completions, tasks (/create), tmp")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--gpu-ms", type=float, default=0.0, help="simulated device time per decode step")
    ap.add_argument("--py-spy", default=None, help="record the server with py-spy (raw format) into this file")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--stagger-ms", type=float, default=0, help="spread the stream starts over this window")
    ap.add_argument("--engines", type=int, default=1,
                    help="engines in the server (RWKV_DEVICES=cpu,cpu,...: the host side of one engine per GPU); "
                         "the streams are split over them (each gets max(streams) / engines slots)")
    a, rest = ap.parse_known_args()
    if a.serve:
        sys.exit(serve(rest, a.gpu_ms))
    if a.client:
        host, port, route, n, mt, st = a.client.split(",")
        client_main(host, int(port), route, int(n), int(mt), float(st))
        return

    from util_server import ServerProcess

    streams = [int(s) for s in a.streams.split(",")]

    class Srv(ServerProcess):
        def command(self) -> list[str]:
            return [sys.executable, str(Path(__file__).resolve()), "--serve", "--gpu-ms", str(a.gpu_ms),
                    "--host", "127.0.0.1", "--port", str(self.port), "--db", self.db, "--model", "synthetic:tiny"]

    per_engine = -(-max(streams) // a.engines)
    env = {"RWKV_MAX_BATCH": str(per_engine), "RWKV_LOG_LEVEL": "warning", "RWKV_MAX_QUEUE": "0",
           "RWKV_STEP_TOKEN_BUDGET": str(max(4096, 64 * per_engine))}
    if a.engines > 1:
        env["RWKV_DEVICES"] = ",".join(["cpu"] * a.engines)
    srv = Srv(model="synthetic:tiny", env=env, stop_timeout=20)
    srv.start(timeout=120)
    pid = srv.proc.pid
    spy = None
    rows = []
    try:
        def wave(route: str, n: int, mt: int) -> dict:
            stagger = a.stagger_ms if mt > 8 else 0
            cmd = [sys.executable, str(Path(__file__).resolve()), "--client",
                   f"127.0.0.1,{srv.port},{route},{n},{mt},{stagger}"]
            l0, p0 = proc_cpu(pid)
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            l1, p1 = proc_cpu(pid)
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:] + "\n" + srv.log_tail())
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r.update(loop_cpu=l1 - l0, proc_cpu=p1 - p0)
            return r

        for route in a.routes.split(","):
            wave(route, min(streams), 8)  # warm-up
        if a.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-o", a.py_spy, "--format", "raw",
                                    "-r", "200", "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        print(f"gpu_ms={a.gpu_ms} max_tokens={a.max_tokens} engines={a.engines}; CPU us per completion token "
              f"(server process / its main=event-loop thread / client)")
        print(f"{'route':>8} {'N':>5} {'tok/s':>9} {'srv us':>7} {'loop us':>8} {'other us':>8} {'client us':>9} "
              f"{'gap p50':>8} {'p95 ms':>7} {'ev/tok':>6} {'TTFT p50':>9} {'p95 ms':>7} {'last p50':>9} {'p95 ms':>7}")
        for route in a.routes.split(","):
            for n in streams:
                for _ in range(a.repeat):
                    r = wave(route, n, a.max_tokens)
                    tok = max(r["tokens"], 1)
                    row = {"route": route, "N": n, "tok_s": tok / r["wall"], "srv_us": 1e6 * r["proc_cpu"] / tok,
                           "loop_us": 1e6 * r["loop_cpu"] / tok,
                           "other_us": 1e6 * (r["proc_cpu"] - r["loop_cpu"]) / tok,
                           "client_us": 1e6 * r["client_cpu"] / tok, "gap_p50": r["gap_p50"], "gap_p95": r["gap_p95"],
                           "ev_per_tok": r["events"] / tok, "tokens": tok,
                           "ttft_p50": r["ttft_p50"], "ttft_p95": r["ttft_p95"],
                           "last_p50": r["last_p50"], "last_p95": r["last_p95"]}
                    rows.append(row)
                    print(f"{route:>8} {n:5d} {row['tok_s']:9.0f} {row['srv_us']:7.1f} {row['loop_us']:8.1f} "
                          f"{row['other_us']:8.1f} {row['client_us']:9.1f} {row['gap_p50']:8.2f} {row['gap_p95']:7.2f} "
                          f"{row['ev_per_tok']:6.2f} {row['ttft_p50']:9.1f} {row['ttft_p95']:7.1f} "
                          f"{row['last_p50']:9.1f} {row['last_p95']:7.1f}", flush=True)
                    assert tok == n * a.max_tokens, (tok, n * a.max_tokens)
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        srv.cleanup()  # stops it; removes its temporary directory


if __name__ == "__main__":
    main()
