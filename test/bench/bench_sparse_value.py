"""The one-row FFN value product of --quant fp8 (B=1 decode): the 8-bit gemv against the kernel
that reads only the weight rows of relu^2's nonzero inputs (kernels/gemv_sparse.cu), at a model
size's shape (N = C, K = 4C) and several shares of zero inputs. Each figure is microseconds per
product over a CUDA graph of one product per layer on distinct weights (cold in L2, as in the
decode step), the median of the replays.

    python test/bench/bench_sparse_value.py --embd 2560,4096 --zeros 0.5,0.8,0.9
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from server.model import cuda_ops, cuda_quant, load_model, qlinear  # noqa: E402


def graph_us(calls, reps: int = 20) -> float:
    """Median microseconds per call of the calls replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / len(calls))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embd", default="2560,4096", help="model widths C (the product is C x 4C)")
    ap.add_argument("--zeros", default="0.5,0.8,0.9", help="shares of the inputs that relu^2 zeroes")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    dev = torch.device("cuda")
    load_model("synthetic:tiny", device=dev, dtype=torch.float16, quant="fp8")  # the kernel library
    gen = torch.Generator(device=dev).manual_seed(0)
    for C in [int(c) for c in a.embd.split(",")]:
        N, K = C, 4 * C
        ws = []
        for _ in range(a.layers):
            w = qlinear.quantize(torch.randn(N, K, device=dev, generator=gen, dtype=torch.float16) * 0.05, "fp8")
            w.sparse = cuda_quant.sparse_codes(w)
            ws.append(w)
        for zeros in [float(z) for z in a.zeros.split(",")]:
            x = torch.randn(1, K, device=dev, generator=gen, dtype=torch.float16).abs()  # (1, K)
            x[:, torch.rand(K, device=dev, generator=gen) < zeros] *= -1
            calls = [lambda w=w: cuda_ops.relu2_linear(x, w) for w in ws]
            cuda_quant.SPARSE_VALUE = False
            gemv = graph_us(calls)
            cuda_quant.SPARSE_VALUE = True
            sparse = graph_us(calls)
            read = N * K * (1 - zeros) / sparse / 1e3
            print(f"C={C} zeros {zeros:.2f}: gemv {gemv:6.2f} us, sparse {sparse:6.2f} us "
                  f"({gemv / sparse:.2f}x; {read:,.0f} GB/s of the codes it reads)", flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
