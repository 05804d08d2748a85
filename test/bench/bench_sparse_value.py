"""The one-row FFN value product of --quant fp8 (B=1 decode): the 8-bit gemv against the kernel
that reads only the weight rows of relu^2's nonzero inputs (kernels/gemv_sparse.cu), at a model
size's shape (N = C, K = 4C) and several shares of zero inputs. Each figure is microseconds per
product over a CUDA graph of one product per layer on distinct weights (cold in L2, as in the
decode step), the median of the replays (bench_sampler.time_graph).

    python test/bench/bench_sparse_value.py --embd 2560,4096 --zeros 0.5,0.8,0.9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_sampler import time_graph  # noqa: E402

from server.model import cuda_ops, cuda_quant, load_model, qlinear  # noqa: E402


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

            def chain(x=x):
                for w in ws:
                    cuda_ops.relu2_linear(x, w)

            us = lambda: time_graph(chain, reps=20) * 1000 / len(ws)  # noqa: E731
            cuda_quant.SPARSE_VALUE = False
            gemv = us()
            cuda_quant.SPARSE_VALUE = True
            sparse = us()
            read = N * K * (1 - zeros) / sparse / 1e3
            print(f"C={C} zeros {zeros:.2f}: gemv {gemv:6.2f} us, sparse {sparse:6.2f} us "
                  f"({gemv / sparse:.2f}x; {read:,.0f} GB/s of the codes it reads)", flush=True)  # fmt: skip
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
