"""Where the decode step's GPU time goes: kernel time per category (torch.profiler, eager steps;
kernel durations are the same inside a CUDA graph, only the launch gaps differ), or with --idle
the gaps between them inside the captured decode graph.

    PYTHONPATH=. python test/bench/profile_decode.py --batches 1,256,1024 [--no-fused]
    PYTHONPATH=. python test/bench/profile_decode.py --quant fp8 --state-dtype fp16 --batches 1024 --idle
    PYTHONPATH=. python test/bench/profile_decode.py --state-dtype fp16 --prefill 1x4096,16x512  (eager prefills)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.engine.sampler import SamplerSlots  # noqa: E402
from server.engine.types import SamplingParams  # noqa: E402
from server.model import State, load_model  # noqa: E402
from server.model.graphs import DecodeGraphs  # noqa: E402

CATS = (("wkv7", ("wkv7",)), ("quant", ("quant_rows",)),
        ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "splitk", "w8_mm")),
        ("sort/scan", ("sort", "radix", "scan", "cub::")), ("softmax", ("softmax",)))  # fmt: skip


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATS if any(k in low for k in keys)), "other")


def decode_graphs(model, B: int, state_dtype) -> DecodeGraphs:
    """A pool of B rows with default sampling, random tokens and every row committing."""
    dev, V = model.device, model.shape.vocab_size
    pool = State.zeros(model.shape, B, dev, model.dtype, state_dtype)
    smp = SamplerSlots(B, V, dev)
    smp.reset(range(B), [SamplingParams()] * B, list(range(B)))
    g = DecodeGraphs(model, pool, smp, buckets=[B])
    g.tokens[:B] = torch.randint(1, V, (B,), device=dev)
    g.commit[:B] = True
    return g


def device_events(step, warm: int, n: int) -> list:
    """The profiler's device events (kernels, memsets) of n calls of step, after `warm` unprofiled ones."""
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def profile(model, B: int, state_dtype, steps: int = 2, top: int = 14) -> None:
    g = decode_graphs(model, B, state_dtype)
    per_cat, per_name, count = collections.Counter(), collections.Counter(), 0
    for e in device_events(lambda: g._body(B), 2, steps):
        us = e.time_range.elapsed_us() / steps
        per_cat[category(e.name)] += us
        per_name[e.name[:90]] += us
        count += 1
    total = sum(per_cat.values())
    print(f"B={B}: {count / steps:.0f} kernels/step, GPU busy {total / 1e3:.2f} ms/step: "
          + ", ".join(f"{c} {t / 1e3:.2f}" for c, t in per_cat.most_common()), flush=True)
    for name, us in per_name.most_common(top):
        print(f"    {us / 1e3:7.3f} ms  {name}")


def prefill(model, n: int, T: int, state_dtype, top: int = 14) -> None:
    """model.forward of n random prompts of T tokens on a pool of n rows, after one unprofiled."""
    pool = State.zeros(model.shape, n, model.device, model.dtype, state_dtype)
    prompts = torch.randint(1, model.shape.vocab_size, (n, T)).tolist()
    per_cat, per_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in device_events(lambda: model.forward(prompts, pool), 1, 1):
        per_cat[category(e.name)] += e.time_range.elapsed_us()
        per_name[e.name[:90]] += e.time_range.elapsed_us()
        count[e.name[:90]] += 1
    total = sum(per_cat.values())
    print(f"prefill {n}x{T}: {sum(count.values())} kernels, GPU busy {total / 1e3:.2f} ms: "
          + ", ".join(f"{c} {t / 1e3:.2f}" for c, t in per_cat.most_common()), flush=True)
    for name, us in per_name.most_common(top):
        print(f"    {us / 1e3:7.3f} ms {count[name]:5d}x  {name}")


def idle(model, B: int, state_dtype, replays: int = 3, top: int = 14) -> None:
    """The bucket's decode graph (as the engine captures it, graph edits included) replayed under
    the profiler: the time with no kernel or memset running, a replay, and the largest gaps summed
    by the pair of nodes around them (the one that ended last before the gap, the next to start)."""
    g = decode_graphs(model, B, state_dtype)
    g.capture([B])
    g.step(B, g.tokens[:B].clone(), torch.zeros(B, dtype=torch.long, device=model.device), g.commit[:B].clone())
    events = device_events(lambda: g.step_cont(B), 1, replays)
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.time_range.end > e.time_range.start)
    busy, end, last, gaps = 0.0, ev[0][0], ev[0][2], collections.Counter()
    for start, stop, name in ev:
        if start > end:
            gaps[(last[:44], name[:44])] += start - end
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    wall = end - ev[0][0]
    print(f"B={B}: {len(ev) / replays:.0f} kernels and memsets a replay, {wall / replays / 1e3:.2f} ms a replay, "
          f"idle {(wall - busy) / replays:.0f} us", flush=True)
    for (before, after), us in gaps.most_common(top):
        print(f"    {us / replays:7.1f} us  {before}  ->  {after}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="synthetic:2.9b")
    p.add_argument("--batches", default="1,256,1024")
    p.add_argument("--state-dtype", default="fp32")
    p.add_argument("--top", type=int, default=14, help="kernel names listed per batch")
    p.add_argument("--no-fused", action="store_true", help="decode without the fused time-mix")
    p.add_argument("--quant", default="none", choices=("none", "int8", "fp8"), help="8-bit weights")
    p.add_argument("--idle", action="store_true", help="the idle gaps inside the captured decode graph instead")
    p.add_argument("--prefill", default="", help="eager prefills NxT (comma-separated) instead of decode steps")
    a = p.parse_args()
    model = load_model(a.model, device="cuda", dtype=torch.float16, quant=a.quant)
    if a.no_fused:
        model.fused_decode = False
    sd = {"fp32": torch.float32, "fp16": torch.float16}[a.state_dtype]
    print(f"profile {a.model} state {a.state_dtype} quant {a.quant} fused={model._fused()}")
    for case in filter(None, a.prefill.split(",")):
        n, T = (int(v) for v in case.split("x"))
        prefill(model, n, T, sd, top=a.top)
    for B in (int(b) for b in a.batches.split(",") if not a.prefill):
        (idle if a.idle else profile)(model, B, sd, top=a.top)


if __name__ == "__main__":
    main()
