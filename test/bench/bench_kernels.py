"""WKV-7 kernel micro-benchmark: CUDA kernels vs the pure-torch ops, 2.9B head shape (H=40).

    PYTHONPATH=. python test/bench/bench_kernels.py          (everything)
    PYTHONPATH=. python test/bench/bench_kernels.py --tmix   (only the time-mix table: head vs pipelined kernel)

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


ROUTES = {"head": 1 << 30, "pipe": 1, "default": cuda_ops.TMIX_PIPE_MIN_B}
"""cuda_ops.TMIX_PIPE_MIN_B per route: the head-per-block kernel at every batch, the pipelined one
(16-bit state only: an fp32 state always runs the head kernel), the model's choice."""


def bench_tmix(B: int, sd: torch.dtype, route: str = "default") -> float:
    """One layer's decode time-mix core (cuda_ops.tmix_decode, model call: bias inside, layer > 0)."""
    import types

    C = H * N
    state = torch.randn(B, H, N, N, device="cuda").to(sd) * 0.1
    xs = [torch.randn(B, C, device="cuda", dtype=torch.float16) for _ in range(8)]
    xs[3] = xs[3] - 2.0  # wz: realistic decays
    lw = types.SimpleNamespace(**{n: torch.rand(C, device="cuda", dtype=torch.float16) for n in
                                  ("k_k", "k_a", "r_k", "lnx_w", "lnx_b", "w0", "a0", "v0")})  # fmt: skip
    f = lambda: cuda_ops.tmix_decode(state, *xs, lw, layer0=False, bias=True)  # noqa: E731
    saved = cuda_ops.TMIX_PIPE_MIN_B
    cuda_ops.TMIX_PIPE_MIN_B = ROUTES[route]
    try:
        return do_bench(f, warmup=25, rep=100, return_mode="median")
    finally:
        cuda_ops.TMIX_PIPE_MIN_B = saved


def tmix_table(batches=(1, 8, 64, 128, 256, 512, 1024)) -> None:
    """Decode time-mix: the head-per-block kernel, the pipelined one (fp16 state) and the default
    choice; ms per call (one layer, H=40, N=64) and state TB/s (state read + written once / time)."""
    routes = ("head", "pipe", "default")
    print(f"\ntmix_decode, one layer, H={H} N={N}: ms per call (state TB/s)")
    print(f"{'B':>5} {'state':5} " + " ".join(f"{n:>17}" for n in routes) + f" {'default/head':>12}")
    for sd, sn in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        for B in batches:
            sbytes = 2 * B * H * N * N * torch.finfo(sd).bits // 8
            ms = [bench_tmix(B, sd, r) for r in routes]
            cells = " ".join(f"{m:8.4f} ({sbytes / m / 1e9:5.2f})" for m in ms)
            print(f"{B:5d} {sn:5} {cells} {ms[-1] / ms[0]:12.2f}", flush=True)


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
    tmix_table()
    for B, T in ((1, 4096), (16, 512), (1, 256), (64, 16)):
        ms = bench_chunk(B, T, torch.float32, cuda_ops.wkv_chunk)
        print(f"chunk {B}x{T} state=fp32      cuda   {ms:9.3f}  ({B * T / ms * 1e3:,.0f} tok/s/layer)", flush=True)
    ms = bench_chunk(1, 256, torch.float32, ops.wkv_chunk, rep=20)
    print(f"chunk 1x256 state=fp32      torch  {ms:9.3f}", flush=True)


if __name__ == "__main__":
    if "--tmix" in sys.argv:  # only the large-batch time-mix table
        assert cuda_ops.available(), "kernels did not build"
        tmix_table()
    else:
        main()
