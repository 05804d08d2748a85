"""CPU time of the prefill's WKV recurrence: step by step (ops.wkv_steps) against the blocked
form (server.model.wkv_chunked) at a few block sizes, on the model's kind of inputs.

    python test/bench/bench_wkv_cpu.py [--shapes 1x512x2,1x512x12,4x128x12] [--blocks 16,32,64]

Prints milliseconds per call (the best of --reps) for each B x T x H (head size 64).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from server.model import ops  # noqa: E402
from server.model.wkv_chunked import wkv_blocked  # noqa: E402


def inputs(B: int, T: int, H: int, N: int = 64) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    w = torch.log(torch.rand(B, T, H, N, generator=g) * 0.6 + 1e-6)  # decay in (0.55, 1), as a model's
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    return torch.randn(B, H, N, N, generator=g) * 0.3, [r, w, k, v, -kk, kk * torch.rand(B, T, H, N, generator=g)]


def best_ms(fn, s0: torch.Tensor, x: list[torch.Tensor], reps: int) -> float:
    times = []
    for _ in range(reps):
        s = s0.clone()
        t0 = time.perf_counter()
        fn(s, *x)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x64x2,1x512x2,1x512x12,4x128x12,1x2048x40")
    ap.add_argument("--blocks", default="16,32,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    blocks = [int(b) for b in a.blocks.split(",")]
    print(f"{'B x T x H':>12} {'steps':>9}" + "".join(f" {'L=' + str(b):>9}" for b in blocks) + "   (ms)")
    for shape in a.shapes.split(","):
        B, T, H = (int(n) for n in shape.split("x"))
        s0, x = inputs(B, T, H)
        row = [best_ms(ops.wkv_steps, s0, x, a.reps)]
        row += [best_ms(lambda *t, b=b: wkv_blocked(*t, block=b), s0, x, a.reps) for b in blocks]
        print(f"{shape:>12}" + "".join(f" {ms:9.1f}" for ms in row), flush=True)


if __name__ == "__main__":
    main()
