"""A/B of decode variants in ONE process (model loaded once), run alternately so that machine
drift hits every variant alike: graph-replayed decode + sampling tok/s per batch, as
bench_engine.bench_decode measures it.

    PYTHONPATH=. python test/bench/ab_decode.py --batches 512,1024 --variants base,lanes512,base,lanes512
    PYTHONPATH=. python test/bench/ab_decode.py --batches 1,8 --variants base,lag1,base,lag1

Variants: base (the defaults); splitlora (RWKV_LORA_MERGED=0: the gate LoRA apart, 4 LoRA
launches per layer instead of 2); hostfed (every step's ids through the host and back, the engine
benchmark's loop before the graphs fed themselves); lanesN (two lanes from batch N, i.e.
RWKV_TWO_LANE_MIN=N, LoRAs on the lane's stream); lag1 (the defaults, but step n+1 is launched
before step n's ids are read on the host, as an engine that runs one step ahead would: the bubble
between steps, measured); padread (RWKV_GEMV_SKIP_PADDING=0: the small-batch gemv reads the
merged LoRAs' zero padding too); noside (RWKV_SIDE_STREAM=0: the LoRAs on the main stream, no
fork / join per layer); late (RWKV_PDL_EARLY=0: add_ln_mix and the time-mix load their weight
vectors after the PDL wait, not before); cl4 (RWKV_SAMPLER_CLUSTER=4: the sampler's 4-CTA clusters
at every batch).
Prints one line per (variant, batch) and a summary table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench_engine import DTYPES, add_model_args, bench_decode, decode_graphs  # noqa: E402
from server.model import cuda_ops, cuda_sampler, decode_pack, lanes, load_model, rwkv7  # noqa: E402

SAMPLER_CLUSTER = cuda_sampler.SAMPLER_CLUSTER  # the default, restored by the other variants


def configure(name: str, model) -> None:
    lanes.TWO_LANE_MIN, rwkv7.SIDE_STREAM = 0, True
    cuda_ops.GEMV_SKIP_PADDING = name != "padread"
    cuda_ops._lib(model.device).pdl_mode(2 if name == "late" else 3)  # early weight loads off / on
    cuda_sampler.SAMPLER_CLUSTER = 4 if name == "cl4" else SAMPLER_CLUSTER
    merged = name != "splitlora"
    if name.startswith("lanes"):
        lanes.TWO_LANE_MIN, rwkv7.SIDE_STREAM = int(name[5:]), False
    elif name == "noside":
        rwkv7.SIDE_STREAM = False
    elif name not in ("base", "hostfed", "lag1", "splitlora", "padread", "late", "cl4"):
        raise SystemExit(f"unknown variant {name!r}")
    if model._decode_packs()[0].merged != merged:  # re-stack the LoRAs (the fields are views)
        decode_pack.LORA_MERGED = merged
        model._packs = None
        model._decode_packs()


def bench_lagged(model, state_dtype, batches: list[int], steps: int) -> list[dict]:
    """Decode with step n+1 launched before step n's ids reach the host (ids fed on the device,
    one pinned D2H copy per step, the host waits for step n while n+1 runs)."""
    dev, V = model.device, model.shape.vocab_size
    g = decode_graphs(model, state_dtype, batches)
    out = []
    for B in batches:
        host = torch.zeros(2, B, dtype=torch.long, pin_memory=True)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        tok = torch.randint(1, V, (B,), device=dev)
        commit = torch.ones(B, dtype=torch.bool, device=dev)
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        times, t_prev = [], None
        for i in range(steps + 4):
            new = g.step_cont(B) if i else g.step(B, tok, pos, commit)  # (B,) static output
            host[i % 2].copy_(new, non_blocking=True)
            events[i % 2].record()
            if i:
                events[(i - 1) % 2].synchronize()  # step i-1's ids on the host while step i runs
                _ = host[(i - 1) % 2].tolist()
                t = time.perf_counter()
                if t_prev is not None:
                    times.append(t - t_prev)
                t_prev = t
        med = statistics.median(times[3:])
        out.append({"batch": B, "decode_tok_s": round(B / med, 1), "step_ms": round(med * 1e3, 3)})
        print(f"  decode B={B:5d}: {B / med:10.1f} tok/s  ({med * 1e3:.3f} ms/step)", flush=True)
    del g
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--state-dtype", default="fp16")
    p.add_argument("--batches", default="512,1024")
    p.add_argument("--variants", default="base,lanes512,base,lanes512")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    model = load_model(a.model, device=torch.device(a.device), dtype=DTYPES[a.dtype])
    batches = [int(b) for b in a.batches.split(",")]
    rows: dict[str, list[list[float]]] = {}
    for name in a.variants.split(","):
        print(f"variant {name}:", flush=True)
        configure(name, model)
        try:
            if name == "lag1":
                res = bench_lagged(model, DTYPES[a.state_dtype], batches, a.steps)
            else:
                feed = "host" if name == "hostfed" else "device"
                res = bench_decode(model, DTYPES[a.state_dtype], batches, a.steps, graphs=True, feed=feed)
        except Exception as exc:  # an experiment may not run here: say so and go on
            print(f"  {name} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            torch.cuda.empty_cache()
        rows.setdefault(name, []).append([r["decode_tok_s"] for r in res])
    print(f"\n{'variant':10} " + " ".join(f"{'B=' + str(b):>22}" for b in batches))
    for name, runs in rows.items():
        cells = [" / ".join(f"{run[j]:,.0f}" for run in runs) for j in range(len(batches))]
        print(f"{name:10} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
