"""SM-partition probe: can the decode's tensor-core GEMMs and its HBM-bound time-mix share the GPU
when each gets its own SMs (CUDA green contexts)?

Session 4's two-lane decode interleaved two half-batches on two plain streams and lost: concurrent
kernels compete for every SM. This measures, per half batch of the 2.9B shape (M rows):
- one layer's GEMMs (r/k/v stacked, output, FFN key and value) and one fused time-mix launch,
  each alone on n SMs for several n;
- both at once on two plain streams, and on two green contexts splitting the SMs;
- whether such a fork/join captures into a CUDA graph.
Prints ms per call; nothing is asserted. Usage: python test/bench/bench_partition.py [--rows 512]
"""

from __future__ import annotations

import argparse
import time
import types

import torch

from server.model import cuda_ops


def tmix_call(B: int, C: int, N: int, state_dtype: torch.dtype, dev):
    H = C // N
    dt = torch.float16
    acts = [torch.randn(B, C, device=dev, dtype=dt) * 0.1 for _ in range(8)]  # 8 x (B, C)
    vec = lambda: torch.randn(C, device=dev, dtype=dt) * 0.1  # noqa: E731  (C,)
    lw = types.SimpleNamespace(k_k=vec(), k_a=vec(), r_k=vec(), lnx_w=vec() + 1, lnx_b=vec(), w0=vec(),
                               a0=vec(), v0=vec())  # fmt: skip
    state = torch.zeros(B, H, N, N, device=dev, dtype=state_dtype)  # (B, H, N, N)
    return lambda: cuda_ops.tmix_decode(state, *acts, lw, False, bias=True)


def gemm_call(B: int, C: int, dev):
    dt = torch.float16
    w = [torch.randn(C, 3 * C, device=dev, dtype=dt) * 0.02, torch.randn(C, C, device=dev, dtype=dt) * 0.02,
         torch.randn(C, 4 * C, device=dev, dtype=dt) * 0.02, torch.randn(4 * C, C, device=dev, dtype=dt) * 0.02]
    x = torch.randn(B, C, device=dev, dtype=dt)  # (B, C)
    h = torch.randn(B, 4 * C, device=dev, dtype=dt)  # (B, 4C)

    def run():
        x @ w[0]  # (B, 3C)
        x @ w[1]  # (B, C)
        x @ w[2]  # (B, 4C)
        h @ w[3]  # (B, C)

    return run


def timed(work: list[tuple], iters: int) -> float:
    """work: (fn, stream, repeats); all start together; wall ms per iteration until all are done."""
    for fn, s, _ in work:  # warm-up (kernel loading per context, cuBLAS handles)
        with torch.cuda.stream(s):
            fn()
    for _, s, _ in work:
        s.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        for fn, s, n in work:
            with torch.cuda.stream(s):
                for _ in range(n):
                    fn()
    for _, s, _ in work:
        s.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


_contexts: list = []  # a green context is destroyed with its Python object: keep them all


def green_stream(n: int):
    from torch.cuda.green_contexts import GreenContext

    _contexts.append(GreenContext.create(num_sms=n, device_id=0))
    return _contexts[-1].Stream()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--sms", default="16,24,32,40,48,64,96,112")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    B, C, N = args.rows, 2560, 64
    tmix, gemm = tmix_call(B, C, N, torch.float16, dev), gemm_call(B, C, dev)
    main_s = torch.cuda.current_stream(dev)
    t_full = {"tmix": timed([(tmix, main_s, 4)], args.iters) / 4, "gemm": timed([(gemm, main_s, 1)], args.iters)}
    print(f"rows {B}: all {sms} SMs: time-mix {t_full['tmix']:.3f} ms, layer GEMMs {t_full['gemm']:.3f} ms")
    streams = {}
    for n in [int(s) for s in args.sms.split(",")]:
        try:
            s = streams[n] = green_stream(n)
        except Exception as e:  # noqa: BLE001  (report and go on: a probe)
            print(f"green context of {n} SMs: {type(e).__name__}: {e}")
            continue
        tt, tg = timed([(tmix, s, 4)], args.iters) / 4, timed([(gemm, s, 1)], args.iters)
        print(f"{n:4d} SMs alone: time-mix {tt:.3f} ms ({t_full['tmix'] / tt:.0%} of all-SM speed), "
              f"GEMMs {tg:.3f} ms ({t_full['gemm'] / tg:.0%})")
    # Both at once, repeats chosen so both sides take about as long as one layer's GEMMs.
    k = max(1, round(t_full["gemm"] / t_full["tmix"]))
    seq = t_full["gemm"] + k * t_full["tmix"]
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    both = timed([(tmix, s1, k), (gemm, s2, 1)], args.iters)
    print(f"GEMMs + {k} time-mix: one after the other {seq:.3f} ms; two plain streams {both:.3f} ms")
    for n in streams:
        rest = sms - n
        try:
            g = streams.get(rest) or green_stream(rest)
        except Exception as e:  # noqa: BLE001
            print(f"green context of {rest} SMs: {type(e).__name__}: {e}")
            continue
        t = timed([(tmix, streams[n], k), (gemm, g, 1)], args.iters)
        print(f"  time-mix on {n} SMs + GEMMs on {rest}: {t:.3f} ms ({seq / t:.2f}x)")
    probe_graph(tmix, gemm, streams, sms, dev)


def probe_graph(tmix, gemm, streams, sms, dev) -> None:
    """Fork/join into two green-context streams inside a capture; replay time vs eager."""
    if not streams:
        return
    n = sorted(streams)[len(streams) // 2]
    try:
        sm, sg = streams[n], green_stream(sms - n)
        cap = torch.cuda.Stream(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=cap):
            sm.wait_stream(cap)
            sg.wait_stream(cap)
            with torch.cuda.stream(sm):
                for _ in range(3):
                    tmix()
            with torch.cuda.stream(sg):
                gemm()
            cap.wait_stream(sm)
            cap.wait_stream(sg)
        t = timed([(g.replay, cap, 1)], 20)
        e = timed([(tmix, sm, 3), (gemm, sg, 1)], 20)
        print(f"graph with a green-context fork ({n} / {sms - n} SMs): replay {t:.3f} ms, eager {e:.3f} ms")
    except Exception as e:  # noqa: BLE001
        print(f"graph capture across green contexts: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
