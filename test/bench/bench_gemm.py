"""The decode step's GEMM shapes on this GPU: cuBLAS (F.linear, both BLAS back ends), stacked
bmm, and an autotuned Triton GEMM, per batch size. Prints ms and achieved TB/s / TFLOP/s.

    python test/bench/bench_gemm.py --batches 1,64,256,1024 [--triton]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K) of a (N, K) weight used as F.linear(x, w), 2.9B shape
    "rkvo": (2560, 2560), "ffn_key": (10240, 2560), "ffn_value": (2560, 10240), "head": (65536, 2560),
    "lora_g1": (320, 2560), "lora_w1": (96, 2560),
}  # fmt: skip


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=20, rep=100)


def triton_linear():
    import triton
    import triton.language as tl

    cfgs = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4),
                                     (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
                                     (64, 64, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
                                     (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (32, 32, 128, 2, 5)]]  # fmt: skip

    @triton.autotune(configs=cfgs, key=["M", "N", "K"])
    @triton.jit
    def mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            av = tl.load(a + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            bv = tl.load(b + rn[:, None] * K + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
            acc += tl.dot(av, tl.trans(bv))
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.float16), mask=(rm[:, None] < M) & (rn[None, :] < N))

    def run(x, w):
        M, K = x.shape
        N = w.shape[0]
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(N, meta["BN"]))  # noqa: E731
        mm[grid](x, w, out, M, N, K)
        return out

    return run, mm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64,256,1024")
    p.add_argument("--triton", action="store_true")
    a = p.parse_args()
    dev = "cuda"
    tl_run, tl_mm = triton_linear() if a.triton else (None, None)
    print(torch.cuda.get_device_name(), torch.__version__)
    for M in (int(b) for b in a.batches.split(",")):
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device=dev, dtype=torch.float16) * 0.02
            x = torch.randn(M, K, device=dev, dtype=torch.float16)
            byts = (N * K + M * K + M * N) * 2
            fl = 2 * M * N * K
            row = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[lib] = bench(lambda: F.linear(x, w))
            torch.backends.cuda.preferred_blas_library("cublas")
            wt = w.t().contiguous()  # (K, N)
            row["x@wT(KN)"] = bench(lambda: x @ wt)
            if name == "rkvo":
                w3, x3 = torch.stack([w, w, w]), torch.stack([x, x, x])  # (3, N, K), (3, M, K)
                row["bmm3/3"] = bench(lambda: torch.bmm(x3, w3.transpose(1, 2))) / 3
            if tl_run is not None and M >= 16:
                ref = F.linear(x, w)
                got = tl_run(x, w)
                err = (got.float() - ref.float()).abs().max().item()
                row["triton"] = bench(lambda: tl_run(x, w))
                row["triton_cfg"] = str(tl_mm.best_config).split(",")[:3] + [f"err {err:.1e}"]
            best = min(v for k, v in row.items() if isinstance(v, float))
            txt = "  ".join(f"{k} {v * 1e3:7.1f}us" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            print(f"M={M:5d} {name:9s} N={N:6d} K={K:6d} | {txt} | best {byts / best / 1e6:6.0f} GB/s "
                  f"{fl / best / 1e9:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
