"""Sampler step: torch sampler (what the engine runs today) vs the fused kernel (kernels/sampler.cu).

    PYTHONPATH=. python test/bench/bench_sampler.py                  (flat + random logits)
    PYTHONPATH=. python test/bench/bench_sampler.py --case flat --B 256 1024

Each step is timed as a CUDA-graph replay (as in the engine's decode graph): torch = sample()
with the default CANDIDATES (top-1024 fast path; overflow rows come back -1 and would be resolved
eagerly, their count is printed), torch-full = the exact full-sort reference (CANDIDATES = ()),
kernel = cuda_sampler.fused_sample (the cluster size it picks for B; then each forced: 4-CTA /
3-CTA clusters, fused_sample's cl). Defaults of SamplingParams (T=1, top_p=0.3, penalties on),
every row commits. V = 65536. ms per step = median over replays (CUDA events).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import server.engine.sampler as S  # noqa: E402
from server.engine.sampler import SamplerSlots  # noqa: E402
from server.engine.types import SamplingParams  # noqa: E402
from server.model import cuda_ops, cuda_sampler  # noqa: E402

V = 65536


LOGITS_DTYPE = torch.float32  # --logits fp16: as the engine's head writes them (the model dtype)


def logits_for(case: str, B: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, V, device="cuda", generator=g)
    return (x * (0.1 if case == "flat" else 2.0)).to(LOGITS_DTYPE)


def time_graph(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()  # warm-up (library init, kernel build) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def run(case: str, B: int, full: bool) -> dict:
    logits = logits_for(case, B)
    slots = SamplerSlots(B, V, "cuda")
    slots.reset(range(B), [SamplingParams(seed=i) for i in range(B)], list(range(B)))
    pos = torch.arange(B, device="cuda")
    commit = torch.ones(B, dtype=torch.bool, device="cuda")
    args = (slots.penalty, slots.seen, slots.fparams, slots.iparams, pos, commit)
    out = {"case": case, "B": B}
    tok = S.sample(logits, *args)
    out["overflow"] = int((tok < 0).sum())
    out["torch"] = time_graph(lambda: S.sample(logits, *args))
    if full:
        old = S.CANDIDATES
        S.CANDIDATES = ()
        try:
            out["torch-full"] = time_graph(lambda: S.sample(logits, *args))
        finally:
            S.CANDIDATES = old
    if cuda_sampler.fused_sample(logits, *args) is None:
        raise SystemExit("the fused sampler kernel is not available here (see the log)")
    out["kernel"] = time_graph(lambda: cuda_sampler.fused_sample(logits, *args))  # the cluster size for B
    for cl in (4, 3):
        out[f"cl{cl}"] = time_graph(lambda: cuda_sampler.fused_sample(logits, *args, cl=cl))
    return out


PHASES = {  # what each setting adds to the kernel's work per row
    "greedy": dict(temperature=0.0),  # load pass (z, penalty decay) + max
    "top_p=1": dict(top_p=1.0),  # + exp / S + keys + the id-order draw (weights, prefix scan, walk)
    "default": {},  # + the top-p mass select (top_p = 0.3)
    "top_k=50": dict(top_k=50),  # + the top-k count select
}


def phases(case: str, B: int) -> None:
    """Kernel ms per step for settings that switch the kernel's phases on one by one."""
    logits = logits_for(case, B)
    pos = torch.arange(B, device="cuda")
    commit = torch.ones(B, dtype=torch.bool, device="cuda")
    cells = []
    for name, kw in PHASES.items():
        slots = SamplerSlots(B, V, "cuda")
        slots.reset(range(B), [SamplingParams(seed=i, **kw) for i in range(B)], list(range(B)))
        args = (slots.penalty, slots.seen, slots.fparams, slots.iparams, pos, commit)
        cells.append(f"{name} {time_graph(lambda: cuda_sampler.fused_sample(logits, *args)):.3f}")
    print(f"{case:7} B={B:5d} kernel ms: " + ", ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", action="store_true", help="kernel time per setting (greedy, top_p=1, ...)")
    ap.add_argument("--logits", choices=["fp32", "fp16"], default="fp32", help="the logits' dtype")
    ap.add_argument("--case", choices=["flat", "random", "both"], default="both")
    ap.add_argument("--B", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--full", action="store_true", help="also time the full-sort torch reference")
    a = ap.parse_args()
    if not cuda_ops.available("cuda"):  # the sampler runs the library the model would load
        raise SystemExit("the CUDA kernels did not build here (see the log)")
    cases = ["flat", "random"] if a.case == "both" else [a.case]
    global LOGITS_DTYPE
    LOGITS_DTYPE = torch.float16 if a.logits == "fp16" else torch.float32
    if a.phases:
        for case in cases:
            for B in a.B:
                phases(case, B)
        return
    print(f"{'case':7} {'B':>5} {'torch ms':>9} {'full ms':>8} {'kernel ms':>9} {'speedup':>8} {'overflow':>8}"
          f" {'4-CTA ms':>9} {'3-CTA ms':>9}")  # fmt: skip
    for case in cases:
        for B in a.B:
            r = run(case, B, a.full)
            full = f"{r['torch-full']:8.3f}" if "torch-full" in r else f"{'-':>8}"
            print(f"{case:7} {B:5d} {r['torch']:9.3f} {full} {r['kernel']:9.3f} {r['torch'] / r['kernel']:7.2f}x "
                  f"{r['overflow']:8d} {r['cl4']:9.3f} {r['cl3']:9.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
