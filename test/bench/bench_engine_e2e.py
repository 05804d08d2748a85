"""End-to-end engine benchmark: B real requests through `Engine.submit` (scheduler, runner,
CUDA graphs, GPU sampler with its overflow resolution, detokenizer, event delivery to the
handles), default sampling parameters (temperature 1, top_p 0.3, penalties on). Events are not
consumed while the window is timed (consumer threads would measure the GIL, not the engine; the
HTTP benchmark measures real consumers).

    PYTHONPATH=. python test/bench/bench_engine_e2e.py --model synthetic:2.9b --batches 1,64,256
    PYTHONPATH=. python test/bench/bench_engine_e2e.py --model synthetic:tiny --device cpu --batches 1,8 --tokens 32

    PYTHONPATH=. python test/bench/bench_engine_e2e.py --model synthetic:2.9b --batches 256 --constrained 0.25

Decode tok/s is measured in the steady state from the engine's generated-token counter.
--constrained F: each batch runs twice, unconstrained, then with round(F * B) of its rows
constrained by a JSON schema (test/bench/bench_grammar.SCHEMA; masks filled on the host while
the device runs each step's forward): those rows are resubmitted as soon as one ends (a
constrained output ends when its document does), so the batch stays full; the line reports
both rates and their ratio ("constrained_ratio", the issue's bar: >= 0.9).
Appends one JSON line per figure (mode "engine-e2e") to test/bench/results.jsonl (--out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench_engine import DTYPES, add_model_args, commit, gpu_name, peak_gb, write_lines  # noqa: E402

from server.config import Settings  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.engine.types import GrammarSpec, SamplingParams  # noqa: E402
from server.model import load_model  # noqa: E402
from server.tokenizer import get_tokenizer  # noqa: E402


def _steady_window(engine, B: int, tokens: int, timeout: float, base: int = 0) -> dict:
    """Poll the engine's generated-token counter (from base): the window from every request
    having ~4 tokens to ~4 tokens before the end (all requests run in lockstep: same prompt
    length and max_tokens; resubmitted constrained rows keep B rows running meanwhile)."""
    marks: dict[str, float] = {}
    lo, hi = B * 4, B * max(tokens - 4, 5)
    t_end = time.perf_counter() + timeout
    while time.perf_counter() < t_end:
        n = engine.stats().generation_tokens_total - base
        now = time.perf_counter()
        if "start" not in marks and n >= lo:
            marks["start"], marks["start_tokens"] = now, n
        if n >= hi:
            marks["end"], marks["end_tokens"] = now, n
            return marks
        time.sleep(0.002)
    raise TimeoutError("the batch did not finish in time")


def _resubmit(engine, prompt: list[int], spec, n: int, tokens: int, stop: threading.Event) -> threading.Thread:
    """n constrained requests kept running until stop: each one that ends is submitted again."""
    seed = [0]

    def new():
        seed[0] += 1
        return engine.submit(prompt, SamplingParams(max_tokens=tokens, seed=seed[0], grammar=spec))

    def loop():
        live = [new() for _ in range(n)]
        while not stop.is_set():
            live = [new() if h.done else h for h in live]
            time.sleep(0.002)
        for h in live:
            h.abort()

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    return th


def run_batch(model, tok, B: int, tokens: int, prompt_len: int, args, constrained: int = 0) -> dict:
    settings = Settings(max_batch=B, step_token_budget=max(2048, B * prompt_len), stats_interval=0,
                        cuda_graphs=args.graphs, state_dtype=args.state_dtype)  # fmt: skip
    engine = Engine(model, tok, settings).start()
    rng = random.Random(B)
    stop, th = threading.Event(), None
    try:
        if constrained:
            from bench_grammar import SCHEMA  # noqa: PLC0415 - only this mode needs it

            spec = GrammarSpec.json_schema(SCHEMA)
            engine.compile_grammar(spec)
            th = _resubmit(engine, [rng.randrange(1, 65530) for _ in range(prompt_len)], spec, constrained, tokens, stop)
            while engine.stats().running < constrained:
                time.sleep(0.01)
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i) for i in range(B - constrained)]
        handles = [engine.submit([rng.randrange(1, 65530) for _ in range(prompt_len)], q) for q in params]
        base = engine.stats().generation_tokens_total
        marks = _steady_window(engine, B, tokens, args.timeout, base)
        for h in handles:
            h.result(timeout=args.timeout)
        stats = engine.stats()
    finally:
        stop.set()
        if th is not None:
            th.join()
        engine.shutdown()
    dt_s = marks["end"] - marks["start"]
    rate = (marks["end_tokens"] - marks["start_tokens"]) / dt_s if dt_s > 0 else float("nan")
    return {"batch": B, "decode_tok_s": round(rate, 1), "step_ms": round(stats.step_ms, 3),
            "peak_mem_gb": peak_gb(model.device)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--state-dtype", default="fp32")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--constrained", type=float, default=0.0,
                   help="also run each batch with this fraction of rows constrained by a JSON schema")
    p.add_argument("--out", default=str(ROOT / "test/bench/results.jsonl"))
    a = p.parse_args()
    dev = torch.device(a.device)
    model = load_model(a.model, device=dev, dtype=DTYPES[a.dtype], state_dtype=DTYPES[a.state_dtype])
    tok = get_tokenizer()
    tok.encode("warm up")
    base = {"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu_name(dev), "model": a.model,
            "mode": "engine-e2e", "dtype": a.dtype, "state_dtype": a.state_dtype, "graphs": a.graphs,
            "sampling": "T=1 top_p=0.3 penalties on"}  # fmt: skip
    lines = []
    for B in [int(b) for b in a.batches.split(",") if b]:
        r = {**base, **run_batch(model, tok, B, a.tokens, a.prompt_len, a)}
        lines.append(r)
        print(f"  engine e2e B={B:5d}: {r['decode_tok_s']:10.1f} tok/s  (step {r['step_ms']:.2f} ms)", flush=True)
        C = round(a.constrained * B)
        if C:
            c = {**base, **run_batch(model, tok, B, a.tokens, a.prompt_len, a, constrained=C), "constrained_rows": C}
            c["constrained_ratio"] = round(c["decode_tok_s"] / r["decode_tok_s"], 3)
            lines.append(c)
            print(f"  engine e2e B={B:5d}, {C} rows constrained: {c['decode_tok_s']:10.1f} tok/s "
                  f"(step {c['step_ms']:.2f} ms): {c['constrained_ratio']:.3f} of unconstrained", flush=True)
    write_lines(a.out, lines)


if __name__ == "__main__":
    main()
