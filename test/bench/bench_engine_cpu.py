"""CPU engine benchmark: N concurrent requests vs the same requests one after another, and the
engine's per-step time outside the model (scheduler, bookkeeping, detokenizing, events).

    PYTHONPATH=. python test/bench/bench_engine_cpu.py                      # tiny and 0.1b
    PYTHONPATH=. python test/bench/bench_engine_cpu.py --presets tiny --sampling default

Per step the engine time splits into: model (forward + decode), sampling (+ the token-id copy),
and "other" (everything else: the overhead this benchmark is about).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.config import Settings  # noqa: E402
from server.engine import Engine, SamplingParams  # noqa: E402
from server.model import load_model  # noqa: E402
from server.tokenizer import get_tokenizer  # noqa: E402


def make_requests(n: int, prompt_len: int, max_tokens: int, sampling: str) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 65530) for _ in range(rng.randrange(prompt_len // 2, prompt_len + 1))]
        if sampling == "greedy":
            p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        else:
            p = SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
        out.append((prompt, p))
    return out


def run(engine: Engine, reqs, concurrent: bool) -> dict:
    s0 = engine.stats()
    t0 = time.perf_counter()
    if concurrent:
        handles = [engine.submit(p, q) for p, q in reqs]
        results = [h.result(3600) for h in handles]
    else:
        results = [engine.submit(p, q).result(3600) for p, q in reqs]
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    steps = s1.steps - s0.steps
    ms = {k: 1000 * (s1.extra[f"{k}_s_total"] - s0.extra[f"{k}_s_total"]) / max(steps, 1)
          for k in ("step", "model", "sample")}  # fmt: skip
    gen = sum(r.completion_tokens for r in results)
    return {
        "wall_s": wall,
        "gen_tok_s": gen / wall,
        "total_tok_s": (gen + sum(r.prompt_tokens for r in results)) / wall,
        "steps": steps,
        "step_ms": ms["step"],
        "model_ms": ms["model"],
        "sample_ms": ms["sample"],
        "other_ms": ms["step"] - ms["model"] - ms["sample"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,0.1b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", default="tiny=32,0.1b=8", help="per preset, or one number")
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "default"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu (the point of this file) or cuda (same run on a GPU)")
    ap.add_argument("--no-sequential", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    mt = dict(kv.split("=") for kv in a.max_tokens.split(",")) if "=" in a.max_tokens else {}
    tok = get_tokenizer()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.requests} requests, "
          f"prompts {a.prompt_len // 2}-{a.prompt_len} tokens, sampling={a.sampling}")  # fmt: skip
    print(f"{'preset':6} {'mode':10} {'gen tok/s':>10} {'all tok/s':>10} {'wall s':>8} {'steps':>6} "
          f"{'step ms':>8} {'model':>8} {'sampling':>9} {'other':>7}")  # fmt: skip
    for preset in a.presets.split(","):
        max_tokens = int(mt.get(preset, a.max_tokens if not mt else 16))
        dtype = torch.float16 if a.device.startswith("cuda") else torch.float32
        model = load_model(f"synthetic:{preset}", device=a.device, dtype=dtype)
        settings = Settings(max_batch=a.requests, step_token_budget=max(4096, a.requests), prefill_chunk=512,
                            stats_interval=0.0)  # fmt: skip
        engine = Engine(model, tok, settings).start()
        try:
            engine.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            reqs = make_requests(a.requests, a.prompt_len, max_tokens, a.sampling)
            rows = {"concurrent": run(engine, reqs, True)}
            if not a.no_sequential:
                rows["sequential"] = run(engine, reqs, False)
        finally:
            engine.shutdown()
        for mode, r in rows.items():
            print(f"{preset:6} {mode:10} {r['gen_tok_s']:10.1f} {r['total_tok_s']:10.1f} {r['wall_s']:8.2f} "
                  f"{r['steps']:6d} {r['step_ms']:8.2f} {r['model_ms']:8.2f} {r['sample_ms']:9.2f} "
                  f"{r['other_ms']:7.3f}")  # fmt: skip
        if "sequential" not in rows:
            continue
        ratio = rows["concurrent"]["gen_tok_s"] / rows["sequential"]["gen_tok_s"]
        print(f"{preset:6} batching speed-up (generated tok/s, concurrent / sequential): {ratio:.1f}x")


if __name__ == "__main__":
    main()
