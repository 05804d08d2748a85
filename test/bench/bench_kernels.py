"""WKV-7 kernel micro-benchmark: CUDA kernels vs the pure-torch ops, 2.9B head shape (H=40).

    PYTHONPATH=. python test/bench/bench_kernels.py

Decode: one layer's state update for B sequences; achieved bandwidth counts the state read +
written once (the floor) plus the activations. Prefill: one layer, T tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.model import cuda_ops, ops  # noqa: E402

H, N = 40, 64


def acts(shape, dtype=torch.float16):
    r, k, v = (torch.randn(*shape, H, N, device="cuda", dtype=dtype) * 0.5 for _ in range(3))
    w = (-0.5 - torch.nn.functional.softplus(torch.randn(*shape, H, N, device="cuda"))).to(dtype)
    kk = torch.nn.functional.normalize(torch.randn(*shape, H, N, device="cuda"), dim=-1)
    return r, w, k, v, (-kk).to(dtype), (kk * torch.rand_like(kk)).to(dtype)


def bench_decode(B: int, sd: torch.dtype, impl) -> tuple[float, float]:
    state = torch.randn(B, H, N, N, device="cuda").to(sd) * 0.1  # (B, H, N, N)
    a = acts((B,))
    ms = do_bench(lambda: impl(state, *a), warmup=25, rep=100, return_mode="median")
    nbytes = 2 * state.numel() * state.element_size() + 7 * B * H * N * 2
    return ms, nbytes / ms / 1e6  # ms, GB/s


def bench_chunk(B: int, T: int, sd: torch.dtype, impl, rep: int = 50) -> float:
    state = torch.randn(B, H, N, N, device="cuda").to(sd) * 0.1
    a = acts((B, T))
    return do_bench(lambda: impl(state, *a), warmup=10, rep=rep, return_mode="median")


def bench_tmix(B: int, sd: torch.dtype, split: bool) -> float:
    import types

    C = H * N
    state = torch.randn(B, H, N, N, device="cuda").to(sd) * 0.1
    xs = [torch.randn(B, C, device="cuda", dtype=torch.float16) for _ in range(8)]
    lw = types.SimpleNamespace(**{n: torch.rand(C, device="cuda", dtype=torch.float16) for n in
                                  ("k_k", "k_a", "r_k", "lnx_w", "lnx_b")})  # fmt: skip
    f = lambda: cuda_ops.tmix_decode(state, *xs, lw, layer0=False)  # noqa: E731
    cuda_ops.TMIX_SPLIT_MIN_BATCH = 1 if split else 1 << 30
    return do_bench(f, warmup=25, rep=100, return_mode="median")


def main() -> None:
    assert cuda_ops.available(), "kernels did not build"
    print(f"{'what':28} {'impl':6} {'ms':>9} {'GB/s':>8}")
    for sd, sn in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        for B in (1, 64, 256, 1024):
            for name, impl in (("cuda", cuda_ops.wkv_decode), ("torch", ops.wkv_decode)):
                if name == "torch" and B == 1:
                    continue
                ms, gbs = bench_decode(B, sd, impl)
                print(f"decode B={B:<5} state={sn:4}      {name:6} {ms:9.4f} {gbs:8.0f}", flush=True)
    for sd, sn in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        for B in (1, 64, 256, 1024):
            for split in (False, True):
                ms = bench_tmix(B, sd, split)
                print(f"tmix  B={B:<5} state={sn:4}      {'split' if split else 'fused':6} {ms:9.4f}", flush=True)
    for B, T in ((1, 4096), (16, 512), (1, 256), (64, 16)):
        ms = bench_chunk(B, T, torch.float32, cuda_ops.wkv_chunk)
        print(f"chunk {B}x{T} state=fp32      cuda   {ms:9.3f}  ({B * T / ms * 1e3:,.0f} tok/s/layer)", flush=True)
    ms = bench_chunk(1, 256, torch.float32, ops.wkv_chunk, rep=20)
    print(f"chunk 1x256 state=fp32      torch  {ms:9.3f}", flush=True)


if __name__ == "__main__":
    main()
