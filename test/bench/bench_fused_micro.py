"""Micro-bench of add_ln_mix (fast path vs the general kernel, forced by a 8-byte-aligned x) and
of the WKV decode kernel (fp32 / fp16 state), 2.9B shape (C=2560, H=40).

    PYTHONPATH=. python test/bench/bench_fused_micro.py

The add_ln_mix figures are wall time per eager call (cuda_ops wrapper: allocations + ctypes,
~15-25 us), so they do not resolve the kernel itself (3-12 us); use the engine bench (graphs) or
profile_decode.py for that. The decode figures are kernel-bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import bench_decode  # noqa: E402

from server.model import cuda_ops  # noqa: E402

C = 2560


def bench_ln(B: int, K: int, aligned: bool) -> float:
    dev, dt = "cuda", torch.float16
    buf = torch.randn(B, C + 8, device=dev, dtype=dt)
    x = buf[:, :C] if aligned else buf[:, 4 : 4 + C]  # 8-byte aligned only: the general kernel
    dx = torch.randn(B, C, device=dev, dtype=dt)
    w, b = torch.rand(C, device=dev, dtype=dt), torch.rand(C, device=dev, dtype=dt)
    mix = torch.rand(K, C, device=dev, dtype=dt) if K else None
    shift = torch.randn(B, C, device=dev, dtype=dt) if K else None
    f = lambda: cuda_ops.add_ln_mix(x, dx, w, b, mix, shift)  # noqa: E731
    return do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    assert cuda_ops.available()
    for B in (1, 256):
        for K in (6, 1, 0):
            old, new = bench_ln(B, K, False), bench_ln(B, K, True)
            print(f"add_ln_mix B={B:<4} K={K}  general {old:7.1f} us  fast {new:7.1f} us", flush=True)
    for sd, sn in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        for B in (256, 1024):
            ms, gbs = bench_decode(B, sd, cuda_ops.wkv_decode)
            print(f"decode B={B:<5} state={sn}  {ms:8.4f} ms {gbs:8.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
