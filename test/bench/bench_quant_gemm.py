"""8-bit GEMM candidates on this GPU at the 2.9B decode shapes, per batch size: fp16 cuBLAS
(the baseline), fp8 e4m3 through torch._scaled_mm with per-row scales (activations quantized per
token; also with fast accumulation, and transposed), int8 weight-only as dequantize-then-cuBLAS,
and int8 x int8 through torch._int_mm.
Prints microseconds per GEMM and what each costs per decode step of the whole model. Answers
"which GEMM path for --quant" before any kernel is written (issue 27).

    python test/bench/bench_quant_gemm.py --batches 1,8,64,256,1024
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"rkvo": (2560, 2560, 4 * 32), "ffn_key": (10240, 2560, 32), "ffn_value": (2560, 10240, 32),
          "head": (65536, 2560, 1)}  # fmt: skip
"""name: (N, K, uses per decode step) at 2.9B (32 layers)."""
FP8 = torch.float8_e4m3fn


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1000.0  # microseconds


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) fp16 -> (M, K) e4m3, (M, 1) fp32 scale: the per-token activation quantization."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 448.0
    return (x.float() / s).to(FP8), s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,256,1024")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(dev))
    out_dt = torch.float16
    try:  # per-row scales with an fp16 output (older torch: bf16 only)
        a = torch.randn(16, 32, device=dev).to(FP8)
        b = torch.randn(32, 32, device=dev).to(FP8)
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=dev), scale_b=torch.ones(1, 32, device=dev),
                         out_dtype=torch.float16)  # fmt: skip
        print("_scaled_mm rowwise fp16 out: ok")
    except Exception as e:  # noqa: BLE001
        out_dt = torch.bfloat16
        print(f"_scaled_mm rowwise fp16 out refused ({str(e)[:120]}); bf16 out")
    totals: dict[tuple[int, str], float] = {}
    for M in [int(b) for b in args.batches.split(",")]:
        for name, (N, K, uses) in SHAPES.items():
            x = torch.randn(M, K, device=dev, dtype=torch.float16)
            w = torch.randn(N, K, device=dev, dtype=torch.float16) * 0.02
            s_w = w.float().abs().amax(dim=1) / 448.0  # (N,)
            wq = (w.float() / s_w[:, None]).to(FP8)  # (N, K)
            s_i = w.float().abs().amax(dim=1) / 127.0
            wi = torch.round(w.float() / s_i[:, None]).to(torch.int8)
            s_i16 = s_i.half()
            xq, sx = quant_rows(x)
            row = {
                "fp16": bench(lambda: F.linear(x, w)),
                "fp8_mm": bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=s_w[None, :], out_dtype=out_dt)),
                # the same product without cuBLASLt's periodic fp32 promotion of the accumulators
                "fp8_fast": bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=s_w[None, :],
                                                           out_dtype=out_dt, use_fast_accum=True)),
                # its transpose (weights as the left operand: other tiles for a short N)
                "fp8_t": bench(lambda: torch._scaled_mm(wq, xq.t(), scale_a=s_w[:, None], scale_b=sx.t(),
                                                        out_dtype=out_dt)),
                "fp8_quant_x": bench(lambda: quant_rows(x)),
                "int8_deq": bench(lambda: F.linear(x, wi.to(torch.float16) * s_i16[:, None])),
                "int8_out_scale": bench(lambda: F.linear(x, wi.to(torch.float16)) * s_i16),
            }
            if M > 16:
                xi = torch.round(x.float() / (x.abs().amax(1, keepdim=True).float() / 127)).to(torch.int8)
                row["int_mm"] = bench(lambda: torch._int_mm(xi, wi.t()))
            for k, v in row.items():
                totals[(M, k)] = totals.get((M, k), 0.0) + v * uses
            print(f"M={M:5d} {name:9s} " + " ".join(f"{k}={v:8.1f}us" for k, v in row.items()), flush=True)
        line = " ".join(f"{k}={totals[(M, k)] / 1000:.2f}ms" for (m, k) in totals if m == M)
        print(f"M={M:5d} per decode step (big linears only): {line}", flush=True)


if __name__ == "__main__":
    main()
