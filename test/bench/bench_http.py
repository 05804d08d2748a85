"""HTTP benchmark: a real server (uvicorn subprocess), N concurrent streaming clients.

    PYTHONPATH=. python test/bench/bench_http.py --model synthetic:2.9b --streams 64,256
    PYTHONPATH=. python test/bench/bench_http.py --model synthetic:tiny --device cpu --streams 4 --max-tokens 16

Each client streams one /v1/completions request (ignore_eos, fixed max_tokens, usage included).
Figures per N: output tok/s (all completion tokens / wall time of the whole wave), TTFT and
inter-token latency (gaps between content chunks) p50/p95. Prints a table and appends one JSON
line per N to test/bench/results.jsonl (mode "http").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))

from bench_engine import commit  # noqa: E402
from util_server import ServerProcess  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_stream(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                usage = msg["usage"]
            if any(c.get("text") for c in msg.get("choices", [])):
                stamps.append(time.perf_counter())
    n = (usage or {}).get("completion_tokens", len(stamps))
    return {"start": t0, "end": time.perf_counter(), "stamps": stamps, "tokens": n}


async def wave(url: str, n: int, max_tokens: int, prompt: str) -> dict:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        bodies = [{"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                   "temperature": 1.0, "top_p": 0.3, "seed": i, "stream_options": {"include_usage": True}}
                  for i in range(n)]  # fmt: skip
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_stream(client, b) for b in bodies))
        wall = time.perf_counter() - t0
    ttft = [(r["stamps"][0] - r["start"]) * 1e3 for r in res if r["stamps"]]
    itl = [(b - a) * 1e3 for r in res for a, b in zip(r["stamps"], r["stamps"][1:])]
    toks = sum(r["tokens"] for r in res)
    return {"streams": n, "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
            "itl_p50": pct(itl, 0.5), "itl_p95": pct(itl, 0.95)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="synthetic:2.9b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--state-dtype", default="fp32")
    p.add_argument("--streams", default="64,256")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=0, help="0: max(streams)")
    p.add_argument("--prompt", default="User: Tell me a long story about a lighthouse keeper.\n\nAssistant:")
    p.add_argument("--out", default=str(ROOT / "test/bench/results.jsonl"))
    a = p.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    env = {"RWKV_DEVICE": a.device, "RWKV_DTYPE": a.dtype, "RWKV_STATE_DTYPE": a.state_dtype,
           "RWKV_MAX_BATCH": str(a.max_batch or max(streams)), "RWKV_LOG_LEVEL": "warning"}  # fmt: skip
    srv = ServerProcess(model=a.model, env=env, stop_timeout=20)
    t0 = time.perf_counter()
    srv.start(timeout=300)
    print(f"server up in {time.perf_counter() - t0:.1f}s at {srv.url}", flush=True)
    gpu = "cpu"
    if a.device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0)
    lines = []
    try:
        asyncio.run(wave(srv.url, min(streams), 8, a.prompt))  # warm-up (HTTP path, buckets)
        for n in streams:
            r = asyncio.run(wave(srv.url, n, a.max_tokens, a.prompt))
            print(f"  {n:4d} streams: {r['tok_s']:9.1f} tok/s  TTFT p50 {r['ttft_p50']:.0f} ms "
                  f"p95 {r['ttft_p95']:.0f} ms  ITL p50 {r['itl_p50']:.1f} ms p95 {r['itl_p95']:.1f} ms", flush=True)
            lines.append({"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu, "model": a.model,
                          "state_dtype": a.state_dtype, "mode": "http", "batch": n, "decode_tok_s": round(r["tok_s"], 1),
                          "ttft_p50_ms": round(r["ttft_p50"], 1), "ttft_p95_ms": round(r["ttft_p95"], 1),
                          "itl_p50_ms": round(r["itl_p50"], 2), "itl_p95_ms": round(r["itl_p95"], 2),
                          "max_tokens": a.max_tokens, "dtype": a.dtype})  # fmt: skip
    finally:
        srv.stop()
        print(f"server log: {srv.log_path}\n{srv.log_tail() if hasattr(srv, 'log_tail') else ''}"[-3000:])
    with open(a.out, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"\n{'streams':>7} {'tok/s':>10} {'TTFT p50':>9} {'p95':>7} {'ITL p50':>8} {'p95':>7}")
    for x in lines:
        print(f"{x['batch']:7d} {x['decode_tok_s']:10.1f} {x['ttft_p50_ms']:9.0f} {x['ttft_p95_ms']:7.0f} "
              f"{x['itl_p50_ms']:8.1f} {x['itl_p95_ms']:7.1f}")


if __name__ == "__main__":
    main()
