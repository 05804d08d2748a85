"""Tile shapes of the 8-bit weight-only Triton GEMM (server.model.w8_gemm) at the 2.9B decode
shapes, per batch size, against what the server ran there before: fp16 cuBLAS (16-bit weights),
fp8 activations + torch._scaled_mm, and int8 through the first Triton GEMM (cuda_quant.large).
Mode fp8a8: the same kernel on e4m3 activations (quantized per row, as torch._scaled_mm's; the
quantization launch is timed with both).

Timed as the decode step runs them: one CUDA graph of back-to-back launches over enough copies of
the weights that every launch reads them cold from HBM. Prints, per (mode, rows, shape), the
baselines and the best configurations (us per launch, GB/s of weight bytes), then per mode and
rows the sum over one decode step's big linears (the best configuration of each shape).

    python test/bench/bench_w8_gemm.py --batches 16,32,64,128,256 --modes int8,fp8 [--jobs 12]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = {"vkr": (3, 2560, 2560, False), "wo": (1, 2560, 2560, False), "ffn_key": (1, 10240, 2560, False),
          "ffn_value": (1, 2560, 10240, True)}  # fmt: skip
"""name: (planes, N, K, relu^2 on x) at 2.9B; each runs once per layer (32 per step)."""
COLD_BYTES = 256 << 20  # weight copies: bench_gemm.bench_graph's (far more than the 50 MB L2)


def configs(M: int, mode: str = "") -> list:
    from server.model.w8_gemm import W8Config

    out = []
    if mode == "fp8a8":  # the fp8 tensor cores: wider tiles, more stages
        shapes = itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2), (False, True),
                                   ((4, 3), (4, 4), (8, 3), (8, 4)))  # fmt: skip
        return [W8Config(bm, bn, bk, split, swap, warps, stages) for bm, bn, bk, split, swap, (warps, stages) in shapes]
    if M <= 64:
        for bn, bk, split, swap, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (False, True),
                                                             (4, 6)):  # fmt: skip
            out.append(W8Config(max(16, M), bn, bk, split, swap, 4, stages))
    else:  # compute counts here: square-ish tiles, either orientation
        shapes = itertools.product((64, 128), (64, 128), (64, 128), (1, 2), (False, True), ((4, 3), (8, 3), (4, 4)))
        for bm, bn, bk, split, swap, (warps, stages) in shapes:
            out.append(W8Config(bm, bn, bk, split, swap, warps, stages))
    return out


def _weights(mode: str, P: int, N: int, K: int, dev) -> list:
    from server.model import qlinear

    mode = mode.removesuffix("a8")
    w = qlinear.quantize(torch.randn(P, N, K, device=dev) * 0.02 if P > 1 else torch.randn(N, K, device=dev) * 0.02,
                         mode)  # fmt: skip
    w = qlinear.QWeight(w.q, w.scale, torch.float16)
    copies = max(2, COLD_BYTES // w.q.numel())
    return [qlinear.QWeight(w.q.clone(), w.scale.clone(), w.dtype) for _ in range(copies)]


def product(mode: str, x: torch.Tensor, act: bool, cfg):
    """The timed call of one configuration: w -> act(x) @ w^T (fp8a8: x's rows quantized first)."""
    from server.model import cuda_quant
    from server.model.w8_gemm import mm

    if mode != "fp8a8":
        return lambda w: mm(x, w, cfg, act)

    def a8(w):
        xq, sx = cuda_quant.quant_like(x, act)
        return mm(xq, w, cfg, False, sx)

    return a8


def _compile(job) -> int:
    """Compile (and run once) every configuration of one mode: fills Triton's on-disk cache."""
    mode, cfgs = job
    from server.model import cuda_ops

    dev = torch.device("cuda")
    cuda_ops.available(dev)  # loads the project's kernels (fp8a8's quantization)
    n = 0
    for name, (P, N, K, act) in SHAPES.items():
        w = _weights(mode, P, N, K, dev)[0]
        for cfg in cfgs:
            x = torch.randn(*((P,) if P > 1 else ()), cfg.bm, K, device=dev, dtype=torch.float16)
            try:
                product(mode, x, act, cfg)(w)
                n += 1
            except Exception:  # noqa: BLE001  (out of shared memory: the timing pass skips it too)
                pass
    torch.cuda.synchronize()
    return n


def graph_us(fn, ws: list) -> float:
    """us per launch of fn(w) over the cold copies ws (QWeights or 16-bit tensors), as
    bench_gemm.bench_graph's graph replays."""
    from bench_gemm import bench_graph  # test/bench is the script's directory

    w = ws[0].q if hasattr(ws[0], "q") else ws[0]
    return bench_graph(lambda i: lambda: fn(ws[i % len(ws)]), w.numel() * w.element_size()) * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,32,64,128,256")
    ap.add_argument("--modes", default="int8,fp8")
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the configurations first")
    ap.add_argument(
        "--top", type=int, default=3, help="configurations printed per shape (0: none timed, baselines only)"
    )
    ap.add_argument("--json", default="", help="write the best configuration per (mode, rows, shape) here")
    args = ap.parse_args()
    import torch.nn.functional as F

    from server.model import cuda_ops, cuda_quant, w8_gemm
    from server.model.w8_gemm import mm

    dev = torch.device("cuda")
    assert cuda_ops.available(dev), "the project's kernels (fp8 activation quantization for the baseline)"
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(dev), flush=True)
    if args.jobs > 0 and args.top:  # compile in parallel, each process a slice of the configurations
        jobs = []
        for m in modes:
            cfgs = sorted({c for M in batches for c in configs(M, m)}, key=str)
            jobs += [(m, cfgs[i :: args.jobs]) for i in range(args.jobs)]
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as ex:
            print(f"compiled {sum(ex.map(_compile, jobs))} launches", flush=True)
    best: dict[str, dict] = {}
    for mode in modes:
        for M in batches:
            step: dict[str, float] = {}
            for name, (P, N, K, act) in SHAPES.items():
                ws = _weights(mode, P, N, K, dev)
                x = torch.randn(*((P,) if P > 1 else ()), M, K, device=dev, dtype=torch.float16)
                nbytes = ws[0].q.numel()
                w16 = [w.dequantize() for w in ws[: max(2, len(ws) // 2)]]
                xs = x.clone()  # relu2_linear squares it in place (inf after a few: the time is the same)
                base = {"fp16": graph_us(lambda w: cuda_ops.relu2_linear(xs, w) if act else F.linear(x, w) if P == 1
                                         else torch.bmm(x, w.transpose(1, 2)), w16),
                        "before": graph_us(lambda w: cuda_quant.large(x, w, act), ws)}  # fmt: skip
                if mode.startswith("fp8"):
                    base["scaled_mm"] = graph_us(lambda w: cuda_quant.fp8_scaled(x, w, act), ws)
                if mode == "int8":  # large() without the Triton path: dequantize, then cuBLAS
                    table, w8_gemm.TABLE = w8_gemm.TABLE, {}
                    try:
                        base["dequant"] = graph_us(lambda w: cuda_quant.large(x, w, act), ws)
                    finally:
                        w8_gemm.TABLE = table
                del w16
                rows, failed = [], 0
                for cfg in configs(M, mode) if args.top else ():
                    try:
                        rows.append((graph_us(product(mode, x, act, cfg), ws), cfg))
                    except Exception:  # noqa: BLE001  (out of shared memory)
                        failed += 1
                rows.sort(key=lambda r: r[0])
                for k, v in base.items():
                    step[k] = step.get(k, 0.0) + v * 32
                if not rows:  # --top 0: the baselines alone
                    print(f"{mode} M={M:4d} {name:9s} " + "  ".join(f"{k} {v:7.1f}us" for k, v in base.items()))
                    continue
                step["w8"] = step.get("w8", 0.0) + rows[0][0] * 32
                print(f"{mode} M={M:4d} {name:9s} ({failed} out of resources) "
                      + "  ".join(f"{k} {v:7.1f}us" for k, v in base.items()) + "  "
                      + "  ".join(f"{us:7.1f}us {nbytes / us / 1e3:5.0f}GB/s {c}" for us, c in rows[: args.top]),
                      flush=True)  # fmt: skip
                best[f"{mode},{M},{name}"] = {"us": rows[0][0], **base, **rows[0][1].__dict__}
                if mode == "int8":  # the same best configuration with the conversion instructions
                    w8_gemm.INT8_MAGIC = False
                    cvt = graph_us(lambda w: mm(x, w, rows[0][1], act), ws)
                    w8_gemm.INT8_MAGIC = True
                    print(f"    int8 codes by cvt instead of bits: {cvt:7.1f}us", flush=True)
            print(f"{mode} M={M:4d} per step (32 layers x 4 products): "
                  + "  ".join(f"{k} {v / 1000:.3f}ms" for k, v in step.items()), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
