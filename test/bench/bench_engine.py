"""Engine-level benchmark: decode tok/s per batch (forward + GPU sampling + one D2H copy of the
token ids per step, as the engine runner does it), prefill tok/s, peak memory; optional accuracy
check of the fp16 WKV state against the fp32 one.

    PYTHONPATH=. python test/bench/bench_engine.py --model synthetic:2.9b --state-dtypes fp16,fp32
    PYTHONPATH=. python test/bench/bench_engine.py --model synthetic:tiny --device cpu --no-graphs

Prints a table and appends one JSON line per figure to test/bench/results.jsonl (--out).
The commit comes from $COMMIT, else `git rev-parse --short HEAD`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from server.engine.sampler import SamplerSlots  # noqa: E402
from server.engine.types import SamplingParams  # noqa: E402
from server.model import State, load_model  # noqa: E402
from server.model.graphs import DecodeGraphs  # noqa: E402
from server.model.loader import SPARSE_FFN  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_lines(path: str, lines: list[dict]) -> None:
    """Append one JSON line per figure (fields that are None left out)."""
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps({k: v for k, v in line.items() if v is not None}) + "\n")


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None


def decode_graphs(model, state_dtype, batches: list[int], capture: bool = True) -> DecodeGraphs:
    """A slot pool of max(batches) rows with default sampling in every slot, and its decode graphs
    (captured for `batches` when capture)."""
    M = max(batches)
    pool = State.zeros(model.shape, M, model.device, model.dtype, state_dtype)
    sampler = SamplerSlots(M, model.shape.vocab_size, model.device)
    sampler.reset(range(M), [SamplingParams()] * M, list(range(M)))
    g = DecodeGraphs(model, pool, sampler, buckets=sorted(set(batches)))
    if capture:
        t0 = time.perf_counter()
        g.capture(sorted(set(batches)))
        print(f"  captured {len(g.graphs)} graphs in {time.perf_counter() - t0:.1f}s", flush=True)
    return g


def bench_decode(model, state_dtype, batches: list[int], steps: int, graphs: bool,
                 feed: str = "device") -> list[dict]:  # fmt: skip
    """feed="device": steps after the first are continuations fed on the device, as the engine
    runner's steady state runs them (graphs: a bare replay, `DecodeGraphs.step_cont`), with the
    runner's pinned id copy + event wait; "host": every step's ids go to the host and back
    (the benchmark's loop before 2026-12-01)."""
    dev, V = model.device, model.shape.vocab_size
    g = decode_graphs(model, state_dtype, batches, capture=graphs)
    out = []
    for B in batches:
        tok = torch.randint(1, V, (B,), device=dev)  # (B,)
        commit_ = torch.ones(B, dtype=torch.bool, device=dev)
        times = []
        cont = graphs and feed == "device"
        pinned = torch.zeros(B, dtype=torch.long, pin_memory=True) if cont else None
        done = torch.cuda.Event() if cont else None
        for i in range(steps + 3):
            t0 = time.perf_counter()
            if cont:  # the runner's steady state: a bare replay, pinned copy, event wait
                zero = torch.zeros(B, dtype=torch.long, device=dev)
                new = g.step_cont(B) if i else g.step(B, tok, zero, commit_)
                pinned.copy_(new, non_blocking=True)
                done.record()
                done.synchronize()
                _ = pinned.tolist()
                times.append(time.perf_counter() - t0)
                continue
            pos = torch.full((B,), i, dtype=torch.long, device=dev)
            if graphs:
                new = g.step(B, tok, pos, commit_)
            else:
                g.tokens[:B].copy_(tok), g.positions[:B].copy_(pos), g.commit[:B].copy_(commit_)
                new = g._body(B)[1]
            host = new.cpu()  # the one device->host copy per step (syncs)
            times.append(time.perf_counter() - t0)
            tok = torch.as_tensor(host, device=dev).clamp_(min=1)  # feed back; avoid EOS id 0
        med = statistics.median(times[3:])
        out.append({"batch": B, "decode_tok_s": round(B / med, 1), "step_ms": round(med * 1e3, 3),
                    "peak_mem_gb": peak_gb(dev)})  # fmt: skip
        print(f"  decode B={B:5d}: {B / med:10.1f} tok/s  ({med * 1e3:.2f} ms/step)", flush=True)
    del g
    return out


def bench_prefill(model, state_dtype, cases: list[tuple[int, int]], reps: int, graph_len: int = 0) -> list[dict]:
    """Prefill tok/s per case NxT; graph_len > 0: through server.model.prefill_graphs where it
    covers the case (its capture is in the untimed first run), as the engine's runner does."""
    dev, V = model.device, model.shape.vocab_size
    out = []
    for n, T in cases:
        state = State.zeros(model.shape, n, dev, model.dtype, state_dtype)
        gen = torch.Generator().manual_seed(n * T)
        prompts = torch.randint(1, V, (n, T), generator=gen).tolist()
        run = lambda: model.forward(prompts, state)  # noqa: E731
        if graph_len > 0:
            from server.model.prefill_graphs import PrefillGraphs

            pg = PrefillGraphs(model, state, max_len=graph_len)
            if pg.covers(prompts):
                run = lambda: pg.run(prompts, range(n))  # noqa: E731
        times = []
        for _ in range(reps + 1):
            sync(dev)
            t0 = time.perf_counter()
            run()
            sync(dev)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        out.append({"batch": n, "prompt": f"{n}x{T}", "prefill_tok_s": round(n * T / med, 1),
                    "ttft_p50_ms": round(med * 1e3, 2), "peak_mem_gb": peak_gb(dev),
                    **({"prefill_graph_len": graph_len} if graph_len else {})})  # fmt: skip
        print(f"  prefill {n}x{T}: {n * T / med:10.1f} tok/s  ({med * 1e3:.1f} ms)"
              f"{f'  graph_len {graph_len}' if graph_len else ''}", flush=True)  # fmt: skip
        del state
    return out


@torch.no_grad()
def accuracy(model, steps: int, prompt_len: int = 32) -> dict:
    """fp16 vs fp32 WKV state: teacher-forced logits along the fp32 greedy path, and how many
    free-running greedy tokens agree."""
    dev, V = model.device, model.shape.vocab_size
    prompt = torch.randint(1, V, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    s32 = State.zeros(model.shape, 1, dev, model.dtype, torch.float32)
    s16 = State.zeros(model.shape, 1, dev, model.dtype, torch.float16)
    l32, l16 = model.forward([prompt], s32), model.forward([prompt], s16)
    free16 = s16.clone()
    lf = l16.clone()
    max_abs, rel, agree, path32, path16 = 0.0, 0.0, 0, [], []
    for _ in range(steps):
        max_abs = max(max_abs, (l32 - l16).abs().max().item())
        rel = max(rel, ((l32 - l16).norm() / l32.norm()).item())
        t32 = l32.argmax(-1)  # (1,)
        agree += int(t32.item() == l16.argmax(-1).item())
        path32.append(t32.item())
        t16 = lf.argmax(-1)
        path16.append(t16.item())
        l32, l16 = model.decode(t32, s32), model.decode(t32, s16)
        lf = model.decode(t16, free16)
    same = next((i for i, (a, b) in enumerate(zip(path32, path16)) if a != b), steps)
    res = {"steps": steps, "logits_max_abs_diff": max_abs, "logits_max_rel_diff": rel,
           "teacher_forced_argmax_agree": agree / steps, "free_greedy_identical_prefix": same,
           "logit_std": l32.std().item()}  # fmt: skip
    print(f"  accuracy fp16 vs fp32 state: {res}", flush=True)
    return res


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options every GPU bench shares: checkpoint, device, compute dtype."""
    p.add_argument("--model", default="synthetic:2.9b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="fp16")


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--state-dtypes", default="fp16,fp32")
    p.add_argument("--batches", default="1,8,64,256,512,1024")
    p.add_argument("--prefill", default="1x4096,16x512", help="cases NxT, comma-separated ('' = none)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "cuda"))
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--feed", default="device", choices=("device", "host"),
                   help="decode inputs: device = the runner's self-fed continuation; host = ids round-trip (old loop)")
    p.add_argument("--no-fused", action="store_true", help="decode without the fused time-mix (model.fused_decode=False)")
    p.add_argument("--chunk-len", type=int, default=None, help="the model's prefill chunk length (default: the model's)")
    p.add_argument("--accuracy", type=int, default=0, help="steps of the fp16-vs-fp32 state check")
    p.add_argument("--out", default=str(ROOT / "test/bench/results.jsonl"))
    p.add_argument("--variant", default="", help="free-text tag stored with each line")
    p.add_argument("--quant", default="none", choices=("none", "int8", "fp8"), help="8-bit weights (load_model quant)")
    p.add_argument("--sparse-ffn", default="auto", choices=SPARSE_FFN, help="load_model sparse_ffn")
    for key, what in SWITCH_HELP.items():
        p.add_argument("--" + key.replace("_", "-"), default="",
                       help=f"decode runs at each of these {SWITCHES[key]} values ({what}), alternating: an A/B in "
                            "one process ('' = the module's value)")  # fmt: skip
    p.add_argument("--prefill-graph-len", default="",
                   help="prefill runs at each of these PrefillGraphs max_len values (0 = eager), alternating")  # fmt: skip
    p.add_argument("--blocks-min-t", default="",
                   help="prefill runs at each of these cuda_ops.BLOCKS_MIN_T values (0 = the blocked WKV off), "
                        "alternating ('' = the module's value)")  # fmt: skip
    a = p.parse_args()
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    model = load_model(a.model, device=dev, dtype=DTYPES[a.dtype], kernels=a.kernels, chunk_len=a.chunk_len,
                       quant=a.quant, sparse_ffn=a.sparse_ffn)  # fmt: skip
    if a.no_fused:
        model.fused_decode = False
    wkv = getattr(model.ops.wkv_decode, "__module__", "?").rsplit(".", 1)[-1]
    print(f"loaded {a.model} on {gpu_name(dev)} in {time.perf_counter() - t0:.1f}s; wkv ops: {wkv}", flush=True)
    base = {"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu_name(dev), "model": a.model,
            "mode": "engine", "dtype": a.dtype, "wkv": wkv, "graphs": not a.no_graphs, "fused_tmix": model._fused(),
            "chunk_len": model.chunk_len, "quant": a.quant}  # fmt: skip
    if a.variant:
        base["variant"] = a.variant
    if a.feed != "device":
        base["feed"] = a.feed
    lines = []
    batches = [int(b) for b in a.batches.split(",") if b]
    cases = [tuple(int(x) for x in c.split("x")) for c in a.prefill.split(",") if c]
    for sd in a.state_dtypes.split(","):
        print(f"state dtype {sd}:", flush=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        graphs = not a.no_graphs and dev.type == "cuda"
        for tag in _switches(a):
            for r in bench_decode(model, DTYPES[sd], batches, a.steps, graphs, a.feed) if batches else []:
                lines.append({**base, "state_dtype": sd, **tag, **r})
        for gl in [int(v) for v in a.prefill_graph_len.split(",") if v] or [0]:
            for tag in _blocks_runs(a.blocks_min_t):
                for r in bench_prefill(model, DTYPES[sd], cases, a.reps, gl):
                    lines.append({**base, "state_dtype": sd, **tag, **r})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.accuracy:
        lines.append({**base, "state_dtype": "fp16-vs-fp32", "accuracy": accuracy(model, a.accuracy)})
    write_lines(a.out, lines)
    print_table(lines)


SWITCHES = {"fp8_fast_accum": "cuda_quant.FP8_FAST_ACCUM", "sparse_value": "cuda_quant.SPARSE_VALUE",
            "scaled_min_rows": "cuda_quant.SCALED_MIN_ROWS", "tmix_per_sm": "cuda_ops.TMIX_PIPE_PER_SM",
            "lora_apart_min_rows": "decode_pack.LORA_APART_MIN_ROWS", "hoist_memsets": "graphs.HOIST_MEMSETS",
            "memset_kernels": "graphs.MEMSET_KERNELS"}  # fmt: skip
"""bench arguments that set a switch of a server.model module per decode run: argument -> module.attribute
(flags 0/1, but the COUNTS)"""
COUNTS = ("scaled_min_rows", "tmix_per_sm", "lora_apart_min_rows")
SWITCH_HELP = {
    "fp8_fast_accum": "0/1",
    "sparse_value": "0/1: B=1's FFN value skips relu^2's zeros",
    "scaled_min_rows": "fp8: the rows from which the output / FFN value products leave their scales to add_ln_mix",
    "tmix_per_sm": "the pipelined time-mix's resident blocks per SM, 0 = as many as fit",
    "lora_apart_min_rows": "the rows from which the gate's LoRA runs apart from the others",
    "hoist_memsets": "0/1: cuBLAS's workspace memsets moved off the critical path of the captured graphs",
    "memset_kernels": "0/1: the moved memsets as one-thread store kernels",
}
"""What each switch's values mean (its --argument's help)."""


def _switches(a: argparse.Namespace):
    """Each decode run's switch settings, set in their modules before it runs, yielded as the tag that
    its result lines carry ({} once when no switch is given)."""
    conv = lambda k, v: int(v) if k in COUNTS else bool(int(v))  # noqa: E731
    runs = [(k, conv(k, v)) for k in SWITCHES for v in getattr(a, k).split(",") if v]
    if not runs:
        yield {}
        return
    for key, on in runs:
        module, attr = SWITCHES[key].split(".")
        setattr(importlib.import_module(f"server.model.{module}"), attr, on)
        yield {key: on}


def _blocks_runs(values: str):
    """Each prefill run's cuda_ops.BLOCKS_MIN_T (0: None, the blocked WKV off), set before it
    runs, yielded as its lines' tag ({} once when none is given)."""
    if not values:
        yield {}
        return
    from server.model import cuda_ops

    for v in (int(x) for x in values.split(",")):
        cuda_ops.BLOCKS_MIN_T = v or None
        print(f"  blocks_min_t {v}", flush=True)
        yield {"blocks_min_t": v}


def print_table(lines: list[dict]) -> None:
    print(f"\n{'state':6} {'batch':>6} {'what':10} {'tok/s':>12} {'ms':>9} {'peak GB':>8}")
    for r in lines:
        if "accuracy" in r:
            continue
        what = "decode" if "decode_tok_s" in r else "prefill " + r["prompt"]
        if "prefill_graph_len" in r:
            what += f" g{r['prefill_graph_len']}"
        rate = r.get("decode_tok_s") or r.get("prefill_tok_s")
        ms = r.get("step_ms") or r.get("ttft_p50_ms")
        pf = "".join(f"  {k} {r[k]}" for k in (*SWITCHES, "blocks_min_t") if k in r)
        peak = r.get("peak_mem_gb") or 0
        print(f"{r['state_dtype']:6} {r['batch']:6d} {what:10} {rate:12.1f} {ms:9.2f} {peak:8.2f}{pf}")


if __name__ == "__main__":
    main()
