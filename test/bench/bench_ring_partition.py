"""Can a time-mix on a share of the SMs keep HBM busy while the GEMMs run on the rest?

Issue 27's B=1,024 targets need the memory-bound time-mix to overlap the compute-bound products
(docs/performance.md, "Where B=1024's step goes"). Session 7's probe (bench_partition.py) found
the time-mix of that day scaling with its SM count (~33 GB/s of state traffic in flight per SM),
so an SM split lost. This probe asks the prior question for a kernel built for the split: an
in-place read + write stream of one layer's fp16 state through a deep ring of bulk copies
(ring_copy.cu), one CTA per SM:

1. its HBM rate on n SMs alone (ring depths, chunk sizes; with no compute, a light touch of every
   element, ~the WKV's arithmetic per element), against torch's copy of the same bytes;
2. on a green context of n SMs beside one layer's products (fp8 `_scaled_mm` with per-row scales
   and fp16 matmuls, 512 rows, the shapes of 2.9B) on a green context of the other SMs, with and
   without cuBLAS's SM carveout (its grid sized for its share).

Prints figures; nothing is asserted. Needs a Hopper GPU and nvcc.

    PYTHONPATH=. python test/bench/bench_ring_partition.py [--rows 512] [--chunk 16384 --cfg 2]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_partition import timed  # noqa: E402  (work launched together, ms per iteration)

CFG = {0: (4, 2), 1: (6, 4), 2: (8, 6), 3: (12, 8)}  # ring slots S, loads ahead LA (ring_copy.cu)
C, H, N = 2560, 40, 64  # 2.9B


def build() -> ctypes.CDLL:
    out = Path(tempfile.gettempdir()) / "rwkv_ring_copy.so"
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
           "-o", str(out), str(HERE / "ring_copy.cu")]  # fmt: skip
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.ring_copy_launch.argtypes = [ctypes.c_void_p, ctypes.c_longlong] + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    return lib


def ev_time(fn, stream, iters: int = 20, warm: int = 3) -> float:
    """us per call on `stream` (CUDA events)."""
    with torch.cuda.stream(stream):
        for _ in range(warm):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(iters):
            fn()
        b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / iters * 1e3


def layer_products(rows: int, dev):
    """One layer's products at `rows` rows: fp8 (r, k, v, o, FFN key, FFN value with per-row
    scales, as the server's past-the-gemv path) and fp16 (r/k/v stacked, o, FFN key, value)."""
    e4 = torch.float8_e4m3fn
    w8 = [(torch.randn(n, k, device=dev) * 0.05).to(e4) for n, k in [(C, C)] * 4 + [(4 * C, C), (C, 4 * C)]]
    x8, h8 = torch.randn(rows, C, device=dev).to(e4), torch.randn(rows, 4 * C, device=dev).to(e4)
    sa = torch.rand(rows, 1, device=dev) + 0.5
    sc, s4 = torch.rand(1, C, device=dev) + 0.5, torch.rand(1, 4 * C, device=dev) + 0.5

    def fp8():
        for w in w8[:4]:
            torch._scaled_mm(x8, w.t(), scale_a=sa, scale_b=sc, out_dtype=torch.float16)
        torch._scaled_mm(x8, w8[4].t(), scale_a=sa, scale_b=s4, out_dtype=torch.float16)
        torch._scaled_mm(h8, w8[5].t(), scale_a=sa, scale_b=sc, out_dtype=torch.float16)

    f16 = torch.float16
    w16 = [torch.randn(k, n, device=dev, dtype=f16) * 0.02 for k, n in [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]]
    x16, h16 = torch.randn(rows, C, device=dev, dtype=f16), torch.randn(rows, 4 * C, device=dev, dtype=f16)

    def fp16():
        x16 @ w16[0], x16 @ w16[1], x16 @ w16[2], h16 @ w16[3]

    return {"fp8": fp8, "fp16": fp16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512, help="rows of one lane (half of B=1,024)")
    ap.add_argument("--chunk", type=int, default=16384, help="bytes per bulk copy in the split runs")
    ap.add_argument("--cfg", type=int, default=2, choices=sorted(CFG), help="ring depth in the split runs")
    ap.add_argument("--sms", default="16,20,24,32,40,48,132")
    ap.add_argument("--split", default="16,20,24,32,40")
    args = ap.parse_args()
    lib, dev = build(), torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), sms, "SMs", flush=True)
    buf = torch.randn(args.rows * H * N * N, device=dev, dtype=torch.float16)  # one layer's state
    gb = 2 * buf.numel() * 2 / 1e9  # read + written
    rate = lambda us: f"{gb / us * 1e3:.2f}"  # noqa: E731  TB/s

    def ring(chunk: int, grid: int, cfg: int, compute: int):
        def f():
            rc = lib.ring_copy_launch(buf.data_ptr(), buf.numel() * 2, chunk, grid, cfg, compute,
                                      torch.cuda.current_stream().cuda_stream)  # fmt: skip
            assert rc == 0, f"launch error {rc}"

        return f

    main_s, dst = torch.cuda.current_stream(), torch.empty_like(buf)
    print(f"{args.rows} rows' layer state, {gb / 2 * 1e3:.0f} MB read + written; TB/s:")
    print(f"  torch copy_ {rate(ev_time(lambda: dst.copy_(buf), main_s))}, in place mul_ "
          f"{rate(ev_time(lambda: buf.mul_(1.0), main_s))}")  # fmt: skip
    ns = [int(n) for n in args.sms.split(",")]
    for chunk in (8192, 16384, 32768):
        for cfg, (s, la) in CFG.items():
            if s * chunk > 227 * 1024:
                continue
            t = {(n, c): ev_time(ring(chunk, n, cfg, c), main_s) for n in ns for c in (0, 2)}
            cells = [f"{n}:{rate(t[n, 0])}/{rate(t[n, 2])}" for n in ns]
            print(f"  ring {chunk // 1024}K x {s} ({la} ahead), n SMs: copy / with WKV-like compute: {' '.join(cells)}",
                  flush=True)  # fmt: skip
    split(args, sms, ring, rate, layer_products(args.rows, dev))


_contexts: list = []  # a green context is destroyed with its Python object: keep them all


def split(args, sms: int, ring, rate, products) -> None:
    """The ring (WKV-like compute) on a green context of n SMs beside the products on the rest."""
    from torch.cuda.green_contexts import GreenContext

    def stream(n: int):
        _contexts.append(GreenContext.create(num_sms=n, device_id=0))
        return _contexts[-1].Stream()

    main_s = torch.cuda.current_stream()
    full = {k: ev_time(f, main_s) for k, f in products.items()}
    print(f"layer products at {args.rows} rows on all SMs: " + ", ".join(f"{k} {v:.1f} us" for k, v in full.items()))
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    for n in (int(x) for x in args.split.split(",")):
        try:
            sr, sg = stream(n), stream(sms - n)
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            print(f"  green contexts {n} / {sms - n}: {type(e).__name__}: {e}")
            continue
        r = ring(args.chunk, n, args.cfg, 2)
        t = ev_time(r, sr)
        cells = [f"ring alone on {n} SMs {t:.1f} us ({rate(t)} TB/s)"]
        for name, g in products.items():
            for cv in (0, n) if carve else (0,):
                if carve:
                    carve(cv or None)
                tg, both = ev_time(g, sg), timed([(r, sr, 2), (g, sg, 2)], 10) * 1e3 / 2
                cells.append(f"{name}{' carved' if cv else ''} alone on {sms - n} {tg:.1f}, both {both:.1f} us")
            if carve:
                carve(None)
        print("  " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
