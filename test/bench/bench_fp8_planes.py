"""fp8's r/k/v stack (three 2560 x 2560 planes on e4m3 rows) per batch size, as CUDA-graph
replays: w8_gemm's fp8a8 tiles (the TABLE's shapes), and cuda_quant's torch._scaled_mm path with
the planes one after another and side by side on three streams (cuda_quant.PLANE_STREAMS).
Prints microseconds per product (the median of 7 replays of 20 products).

    PYTHONPATH=. python test/bench/bench_fp8_planes.py --batches 128,256,512,1024
"""

from __future__ import annotations

import argparse
import statistics

import torch

from server.model import cuda_quant, qlinear, w8_gemm

TILES = {
    "fp8a8 128x256": w8_gemm._c(128, 256, 128, 1, True, warps=8),  # r/k/v past 256 rows: not in the TABLE (slower)
    "fp8a8 128x64": w8_gemm._c(128, 64, 128, 1, True, warps=8),  # r/k/v at 129-256 rows: not in the TABLE (slower)
    "fp8a8 64x64": w8_gemm._c(64, 64, 128),  # at 65-128 rows
}


def replay_us(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median microseconds per fn() over `rounds` replays of a graph of `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocates) off the capture
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record(), graph.replay(), t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / reps)
    return statistics.median(times)


def scaled(xq: torch.Tensor, sx: torch.Tensor, w: qlinear.QWeight, side_by_side: bool) -> torch.Tensor:
    cuda_quant.PLANE_STREAMS = side_by_side
    try:
        return cuda_quant._scaled(xq, sx, w)
    finally:
        cuda_quant.PLANE_STREAMS = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="128,256,512,1024")
    a = ap.parse_args()
    dev, C = torch.device("cuda"), 2560
    g = torch.Generator(device=dev).manual_seed(0)
    w = qlinear.quantize(torch.randn(3, C, C, device=dev, generator=g, dtype=torch.float16) * 0.05, "fp8")
    for M in (int(b) for b in a.batches.split(",")):
        x = torch.randn(3, M, C, device=dev, generator=g, dtype=torch.float16)
        xq, sx = cuda_quant.quant_like(x)  # (3, M, C) e4m3, (3, M, 1)
        row = {name: replay_us(lambda c=cfg: w8_gemm.mm(xq, w, c, xs=sx)) for name, cfg in TILES.items()}
        row["_scaled_mm in a row"] = replay_us(lambda: scaled(xq, sx, w, False))
        row["_scaled_mm side by side"] = replay_us(lambda: scaled(xq, sx, w, True))
        print(f"M={M:5d}  " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
