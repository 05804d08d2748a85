"""The decode step's GEMM shapes on this GPU: cuBLAS (F.linear, both BLAS back ends), stacked
bmm, the small-batch gemv kernel (cuda_ops.linear, M <= 8; "gemv3/3": the rkvo shape as one
stacked P=3 launch, per matrix), and an autotuned Triton GEMM, per batch size. Prints times and
achieved weight GB/s / TFLOP/s.

    python test/bench/bench_gemm.py --batches 1,64,256,1024 [--triton]
    python test/bench/bench_gemm.py --sweep --batches 1,8   # gemv kernel variants x warps
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


def bench_graph(make_call, wbytes: int, reps: int = 20) -> float:
    """ms per call, measured as CUDA-graph replays (no host overhead, as in the decode step's
    graph) of a sequence of calls over distinct weight copies (>= 256 MB in all, so every call
    reads its weights from HBM, not L2). make_call(i) -> a no-argument callable on copy i."""
    copies = max(2, min(256, -(-(256 << 20) // wbytes)))
    calls = [make_call(i) for i in range(copies)]
    cur = torch.cuda.current_stream()
    s = torch.cuda.Stream()
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        for c in calls:
            c()
    cur.wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / (reps * copies)


def _weights(P: int, N: int, K: int, copies_bytes: int = 256 << 20, dev="cuda") -> list[torch.Tensor]:
    n = max(2, min(256, -(-copies_bytes // (P * N * K * 2))))
    ws = [torch.randn(P, N, K, device=dev, dtype=torch.float16) * 0.02 for _ in range(n)]
    return [w[0] if P == 1 else w for w in ws]


def gemv_sweep(batches: list[int], dev="cuda", quant: str = "") -> None:
    """Every gemv variant (cfg 1-3) x warp split on each shape (and rkvo stacked P=3), timed as
    graph replays over cold weights: weight GB/s, vs cuBLAS timed the same way, and the automatic
    choice. quant int8 / fp8: the 8-bit weights' path (GB/s of their codes; "cublas" is then the
    16-bit product of the dequantized weights)."""
    from server.model import cuda_ops, qlinear

    cases = [(n, 1) for n in SHAPES] + [("rkvo", 3)]
    for M in batches:
        for name, P in cases:
            N, K = SHAPES[name]
            ws = _weights(P, N, K, copies_bytes=(512 if quant else 256) << 20, dev=dev)  # bench_graph's copies
            if quant:
                ws = [qlinear.quantize(w, quant) for w in ws]
            x = torch.randn(P, M, K, device=dev, dtype=torch.float16)
            x = x[0] if P == 1 else x
            ref = cuda_ops.ops.linear(x, ws[0]).float()
            wbytes = P * N * K * (1 if quant else 2)
            res = {}
            for cfg in (1, 2, 3):
                for warps in (1, 2, 4, 5, 8, 10, 16):
                    got = cuda_ops.linear(x, ws[0], warps=warps, cfg=cfg).float()
                    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max(), (name, cfg, warps)
                    res[(cfg, warps)] = bench_graph(
                        lambda i, c=cfg, wp=warps: lambda: cuda_ops.linear(x, ws[i], warps=wp, cfg=c), wbytes
                    )
            auto = bench_graph(lambda i: lambda: cuda_ops.linear(x, ws[i]), wbytes)
            wd = [w.dequantize() if quant else w for w in ws]
            cub = bench_graph(lambda i: lambda: cuda_ops.ops.linear(x, wd[i]), wbytes)
            best = min(res, key=res.get)
            top = sorted(res, key=res.get)[:4]
            txt = "  ".join(f"c{c}w{wp} {wbytes / res[(c, wp)] / 1e6:5.0f}" for c, wp in top)
            print(f"M={M} {name:9s} P={P} | cublas {cub * 1e3:6.1f}us {wbytes / cub / 1e6:5.0f} GB/s | auto "
                  f"{auto * 1e3:6.1f}us {wbytes / auto / 1e6:5.0f} GB/s | best c{best[0]}w{best[1]} "
                  f"{res[best] * 1e3:6.1f}us | top GB/s {txt}", flush=True)  # fmt: skip
            for cfg in (1, 2, 3):
                row = " ".join(f"w{wp}:{wbytes / res[(c, wp)] / 1e6:5.0f}" for c, wp in res if c == cfg)
                print(f"      cfg{cfg} GB/s {row}")
            del ws, wd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64,256,1024")
    p.add_argument("--triton", action="store_true")
    p.add_argument("--sweep", action="store_true", help="gemv kernel variants x warps only")
    p.add_argument("--quant", default="", choices=("", "int8", "fp8"), help="--sweep over 8-bit weights")
    a = p.parse_args()
    dev = "cuda"
    if a.sweep:
        print(torch.cuda.get_device_name(), torch.__version__)
        gemv_sweep([int(b) for b in a.batches.split(",")], dev, a.quant)
        return
    from server.model import cuda_ops

    use_gemv = cuda_ops.available(dev)
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
            if use_gemv and M <= cuda_ops.GEMV_MAX_M:
                ws = _weights(1, N, K, dev=dev)
                row["graph:cublas"] = bench_graph(lambda i: lambda: F.linear(x, ws[i]), N * K * 2)
                row["graph:gemv"] = bench_graph(lambda i: lambda: cuda_ops.linear(x, ws[i]), N * K * 2)
                if name == "rkvo":
                    ws3 = _weights(3, N, K, dev=dev)
                    x3g = x3
                    row["graph:bmm3/3"] = bench_graph(lambda i: lambda: torch.bmm(x3g, ws3[i].transpose(1, 2)),
                                                      3 * N * K * 2) / 3  # fmt: skip
                    row["graph:gemv3/3"] = bench_graph(lambda i: lambda: cuda_ops.linear(x3g, ws3[i]), 3 * N * K * 2) / 3
                    del ws3
                del ws
                row["gemv"] = bench(lambda: cuda_ops.linear(x, w))
                wb = N * K * 2
                if name == "rkvo":
                    row["gemv3/3"] = bench(lambda: cuda_ops.linear(x3, w3)) / 3
                    row["graph_GBs"] = (f"cublas {wb / row['graph:cublas'] / 1e6:.0f} gemv {wb / row['graph:gemv'] / 1e6:.0f} "
                                        f"bmm3 {wb / row['graph:bmm3/3'] / 1e6:.0f} gemv3 {wb / row['graph:gemv3/3'] / 1e6:.0f}")  # fmt: skip
                else:
                    row["graph_GBs"] = f"cublas {wb / row['graph:cublas'] / 1e6:.0f} gemv {wb / row['graph:gemv'] / 1e6:.0f}"
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
