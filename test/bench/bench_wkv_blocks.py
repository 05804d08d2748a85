"""The prefill's WKV on the GPU: the token-by-token kernel (wkv7_chunk.cu) against the blocked
kernels (wkv7_blocks.cu) on the same inputs, ms per call (median of CUDA-event timings), and how
far their outputs are apart. Shapes are B x T x H at head size 64 (2.9B has 40 heads).

    python test/bench/bench_wkv_blocks.py [--shapes 1x4096x40,16x512x40] [--state-dtype fp16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from server.model import cuda_ops  # noqa: E402

SHAPES = "1x4096x40,1x2048x40,1x512x40,1x128x40,1x64x40,4x128x40,16x512x40,64x64x40"
DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(B: int, T: int, H: int, dtype, seed: int):
    """r, w, k, v, a, b as the model makes them: w <= -0.5, a = -kk, b = kk * gate."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda: torch.randn(B, T, H, 64, device="cuda", generator=g)  # noqa: E731
    kk = torch.nn.functional.normalize(rnd(), dim=-1)
    w = -0.5 - torch.nn.functional.softplus(rnd() - 1.0)
    acts = (rnd() * 0.5, w, rnd() * 0.5, rnd(), -kk, kk * torch.rand(B, T, H, 64, device="cuda", generator=g))
    return tuple(t.to(dtype) for t in acts)


def time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--dtype", default="fp16", choices=DTYPES)
    p.add_argument("--state-dtype", default="fp16", choices=("fp16", "fp32"))
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, acts {a.dtype}, state {a.state_dtype}")
    print(f"{'B x T x H':>12} {'steps ms':>9} {'blocks ms':>9} {'speed-up':>8} {'y rel diff':>10} {'state rel':>10}")
    for shape in a.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        acts = inputs(B, T, H, DTYPES[a.dtype], seed=T + B)
        s0 = (torch.randn(B, H, 64, 64, device="cuda") * 0.3).to(DTYPES[a.state_dtype])
        out = {}
        for name, min_t in (("steps", None), ("blocks", 1)):
            cuda_ops.BLOCKS_MIN_T = min_t
            s = s0.clone()
            y = cuda_ops.wkv_chunk(s, *acts)
            out[name] = (y.float(), s.float())
            ms = time_ms(lambda: cuda_ops.wkv_chunk(s0.clone(), *acts), a.reps)  # noqa: B023
            out[name + "_ms"] = ms
        rel = lambda x, ref: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
        dy = rel(out["blocks"][0], out["steps"][0])
        ds = rel(out["blocks"][1], out["steps"][1])
        st, bl = out["steps_ms"], out["blocks_ms"]
        print(f"{shape:>12} {st:9.3f} {bl:9.3f} {st / bl:7.2f}x {dy:10.2e} {ds:10.2e}")


if __name__ == "__main__":
    main()
