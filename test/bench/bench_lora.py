"""The decode LoRAs of one layer (2.9B shape) in two layouts, timed inside a CUDA graph of 32
repetitions (as 32 layers replay), per batch size; no activations (the same in both):

  split : first stages lin((3, B, C) planes w a v, (3, 96, C)) + lin(g plane, (320, C));
          second stages lin(mid (3, B, 96), (3, C, 96)) + lin(hg (B, 320), (C, 320))  [the model's]
  merged: lin((4, B, C) planes, (4, 320, C)) then lin((4, B, 320), (4, C, 320)): the w/a/v
          LoRAs zero-padded to the gate's width, 2 launches instead of 4

    PYTHONPATH=. python test/bench/bench_lora.py --batches 1,8,64,256,512,1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.model import cuda_ops  # noqa: E402

C, D, DG, REPS = 2560, 96, 320, 32


def graph_ms(fn, iters: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / iters / REPS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64,256,512,1024")
    a = p.parse_args()
    cuda_ops.is_available()
    lin, dev, dt = cuda_ops.linear, "cuda", torch.float16
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt) * 0.02  # noqa: E731
    lora1, g1, lora2, g2 = r(3, D, C), r(DG, C), r(3, C, D), r(C, DG)
    m1, m2 = r(4, DG, C), r(4, C, DG)
    print(f"{'B':>6} {'split us/layer':>15} {'merged us/layer':>16}")
    for B in (int(b) for b in a.batches.split(",")):
        xs = r(6, B, C)  # planes in the merged order g w a v k r (the split one only slices)

        def split():
            mid = lin(xs[1:4], lora1)
            hg = lin(xs[0], g1)
            return lin(mid, lora2), lin(hg, g2)

        def merged():
            return lin(lin(xs[0:4], m1), m2)

        ts, tm = graph_ms(split), graph_ms(merged)
        print(f"{B:6d} {ts * 1e3:15.1f} {tm * 1e3:16.1f}", flush=True)


if __name__ == "__main__":
    main()
