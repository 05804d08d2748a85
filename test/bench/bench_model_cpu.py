"""CPU throughput of the pure-torch RWKV-7 forward (synthetic weights, fp32).

    python test/bench/bench_model_cpu.py [--presets tiny,0.1b] [--threads N]

Prints decode tok/s at B=1 and B=16 and prefill tok/s (B=1 x 512 tokens, B=16 x 64 tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from server.model import load_model  # noqa: E402


def _timed(fn, min_s: float = 2.0) -> float:
    """Seconds per call (after one warm-up call), averaged over at least min_s."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def bench(spec: str) -> None:
    model = load_model(spec)
    V = model.shape.vocab_size
    g = torch.Generator().manual_seed(0)
    for B in (1, 16):
        state = model.zero_state(B)
        tok = torch.randint(0, V, (B,), generator=g)
        s = _timed(lambda: model.decode(tok, state))
        print(f"{spec:16s} decode  B={B:<3d}          {B / s:9.1f} tok/s  ({s * 1e3:.1f} ms/step)")
    for B, T in ((1, 512), (16, 64)):
        prompts = torch.randint(0, V, (B, T), generator=g).tolist()
        s = _timed(lambda: model.forward(prompts, model.zero_state(B)))
        print(f"{spec:16s} prefill B={B:<3d} T={T:<4d}   {B * T / s:9.1f} tok/s  ({s * 1e3:.0f} ms/call)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="tiny,0.1b")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    for p in args.presets.split(","):
        bench(p if p.startswith("synthetic:") else f"synthetic:{p}")


if __name__ == "__main__":
    main()
