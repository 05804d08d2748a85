"""The decode LoRAs of one layer (2.9B shape) in two layouts, timed as CUDA-graph replays over
distinct weight copies (bench_gemm.bench_graph: weights read from HBM, as in the decode step), per
batch size; no activations (the same in both):

  split : first stages lin((3, B, C) planes w a v, (3, 96, C)) + lin(g plane, (320, C));
          second stages lin(mid (3, B, 96), (3, C, 96)) + lin(hg (B, 320), (C, 320))
  merged: lin((4, B, C) planes, (4, 320, C)) then lin((4, B, 320), (4, C, 320)): the w/a/v
          LoRAs zero-padded to the gate's width, 2 launches instead of 4
  skip  : merged, with the widths passed (rows= / cols=): at B <= 8 the gemv does not read the
          zero padding [the model's default]

    PYTHONPATH=. python test/bench/bench_lora.py --batches 1,8,64,256,512,1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_gemm import bench_graph  # noqa: E402
from server.model import cuda_ops  # noqa: E402

C, D, DG = 2560, 96, 320


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64,256,512,1024")
    a = p.parse_args()
    cuda_ops.is_available()
    lin, dev, dt = cuda_ops.linear, "cuda", torch.float16
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt) * 0.02  # noqa: E731
    split_w, merged_w = (3 * D + DG) * C * 2 * 2, 4 * DG * C * 2 * 2  # weight bytes per call
    split_ws, merged_ws = {}, {}

    def split(i):
        if i not in split_ws:
            split_ws[i] = r(3, D, C), r(DG, C), r(3, C, D), r(C, DG)
        lora1, g1, lora2, g2 = split_ws[i]
        return lambda: (lin(lin(xs[1:4], lora1), lora2), lin(lin(xs[0], g1), g2))

    def merged(i):
        if i not in merged_ws:
            merged_ws[i] = r(4, DG, C), r(4, C, DG)
        m1, m2 = merged_ws[i]
        return lambda: lin(lin(xs[0:4], m1), m2)

    def skip(i):
        m1, m2 = merged_ws.setdefault(i, (r(4, DG, C), r(4, C, DG)))  # padding not zero: timing only
        widths = (DG, D, D, D)
        return lambda: lin(lin(xs[0:4], m1, rows=widths), m2, cols=widths)

    print(f"{'B':>6} {'split us/layer':>15} {'merged us/layer':>16} {'skip us/layer':>14}")
    for B in (int(b) for b in a.batches.split(",")):
        xs = r(6, B, C)  # planes in the model's order g w a v k r
        ts, tm, tk = bench_graph(split, split_w), bench_graph(merged, merged_w), bench_graph(skip, split_w)
        print(f"{B:6d} {ts * 1e3:15.1f} {tm * 1e3:16.1f} {tk * 1e3:14.1f}", flush=True)


if __name__ == "__main__":
    main()
