"""The one-row FFN value product (B=1 decode): the gemv against the kernel that reads only the
weight rows of relu^2's nonzero inputs (kernels/gemv_sparse.cu, --sparse-ffn), at a model
size's shape (N = C, K = 4C) and several shares of zero inputs. Each figure is microseconds per
product over a CUDA graph of one product per layer on distinct weights (cold in L2, as in the
decode step), the median of the replays (bench_sampler.time_graph).

    python test/bench/bench_sparse_value.py --embd 2560,4096 --zeros 0.5,0.8,0.9 --weights fp8,fp16
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
    ap.add_argument("--weights", default="fp8", help="fp8, int8 and / or fp16 value weights")
    a = ap.parse_args()
    dev = torch.device("cuda")
    load_model("synthetic:tiny", device=dev, dtype=torch.float16, quant="fp8")  # the kernel library
    gen = torch.Generator(device=dev).manual_seed(0)
    for mode, C in [(m, int(c)) for m in a.weights.split(",") for c in a.embd.split(",")]:
        N, K = C, 4 * C
        ws, sps = [], []
        for _ in range(a.layers):
            w = torch.randn(N, K, device=dev, generator=gen, dtype=torch.float16) * 0.05
            ws.append(w if mode == "fp16" else qlinear.quantize(w, mode))
            sps.append(cuda_quant.sparse_codes(ws[-1]))
        for zeros in [float(z) for z in a.zeros.split(",")]:
            x = torch.randn(1, K, device=dev, generator=gen, dtype=torch.float16).abs()  # (1, K)
            x[:, torch.rand(K, device=dev, generator=gen) < zeros] *= -1

            def chain(x=x):
                for w, sp in zip(ws, sps):
                    cuda_ops.relu2_linear(x, w, sp)

            us = lambda: time_graph(chain, reps=20) * 1000 / len(ws)  # noqa: E731
            cuda_quant.SPARSE_VALUE = False
            gemv = us()
            cuda_quant.SPARSE_VALUE = True
            sparse = us()
            read = N * K * (1 - zeros) * (2 if mode == "fp16" else 1) / sparse / 1e3
            print(f"{mode} C={C} zeros {zeros:.2f}: gemv {gemv:6.2f} us, sparse {sparse:6.2f} us "
                  f"({gemv / sparse:.2f}x; {read:,.0f} GB/s of the weights it reads)", flush=True)  # fmt: skip
        ws.clear(), sps.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
