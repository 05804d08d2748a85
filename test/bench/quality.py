"""Quality of the lossy modes against the exact path (issue 27), on CPU.

    python test/bench/quality.py --model synthetic:tiny --tokens 1024 --prompts 8 --gen 64 \
        [--modes ref,state_fp16,act_fp16,act_bf16,int8,fp8] [--stride 1] [--source random]

The reference is the most exact thing the CPU model runs: fp32 weights, fp32 activations, fp32
WKV state. A mode is "+"-joined parts over it: state_fp16 (fp16 WKV state), act_fp16 / act_bf16
(model dtype: activations, weights and token-shift state), int8 / fp8 (the large linears
replaced by their quantize -> dequantize round trip, server/model/quant.py); e.g. int8+act_fp16.
What the server runs: `served` (fp16 activations, fp16 state, the CUDA kernels where there are
any) and `wint8` / `wfp8` (the 8-bit weights of --quant, loaded as the server loads them: on a
GPU the 8-bit gemv for batches up to 8, and for fp8 the fp8 x fp8 GEMMs beyond, which also
quantize activations per token); e.g. served+wfp8.
`ref` is the reference loaded again: its row must read KL 0, 100% top-1 (a self-check).

Figures per mode:
- teacher-forced: every model reads the same sequence; after every `stride`-th token the
  next-token logits are compared with the reference's: KL(ref || mode) per position (mean, p99)
  and top-1 agreement. The sequence goes through forward() in chunks of `stride` tokens (the
  prefill path; forward returns only the last position's logits, so stride 1 scores every
  position and a larger stride scores every stride-th one for less CPU: the state still sees
  every token). All models run in lockstep, so no logits are stored.
- greedy drift: M random prompts, G greedy tokens each from the reference and the mode; the
  mean number of tokens before the first difference (G when none) and the % of identical runs.
- the reference's confidence: the share of scored positions whose top-two logits are within
  1e-3 (near ties), the median top-two gap and the mean top-1 probability. Random weights give
  flat, unconfident distributions (no token stands out the way a trained model's does), so a
  synthetic model's top-1 flips on small errors and its KL says nothing of a trained model's:
  its figures rank the modes, no more.

Sequence (--source): `random` (default) draws uniform token ids: for random weights that is what
sampling the model itself gives (its distribution is near-uniform), at no cost. `model` samples it
from the reference at temperature 1 (in-distribution: use it for a trained checkpoint; one
extra token-by-token pass). `bytes` reads the held-out end of the byte-level model's corpus
(test/data/train_bytes.py: Python's standard library sources), and its greedy prompts are cut
from there too: the text the trained byte model was made for. Prints a markdown table and appends one JSON line per mode
(`mode: "quality"`, `gpu`: "cpu" or the GPU's name) to --out. `--device cuda` runs the models there
(pure-torch ops all the same: the 2.9B runs are too slow on a CPU). The commit comes from $COMMIT, else git.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import commit, write_lines  # noqa: E402

sys.path.insert(0, str(ROOT / "test" / "data"))
from train_bytes import held_out  # noqa: E402

from server.model import load_model  # noqa: E402
from server.model.quant import MODES as QUANT_MODES  # noqa: E402
from server.model.quant import fake_quantize  # noqa: E402
from server.model.rwkv7 import RWKV7  # noqa: E402

DEFAULT_MODES = "ref,state_fp16,act_fp16,act_bf16,int8,fp8"
NEAR_TIE = 1e-3
LOAD_QUANT = {"wint8": "int8", "wfp8": "fp8"}
PARTS = {"ref", "state_fp16", "act_fp16", "act_bf16", "served", *LOAD_QUANT, *QUANT_MODES}


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype = torch.float32  # model dtype: activations and weights
    state_dtype: torch.dtype = torch.float32  # WKV state
    quant: str | None = None  # int8 | fp8: fake-quantized large linears
    kernels: str = "torch"  # the model's ops (load_model kernels=)
    load_quant: str = "none"  # the --quant weights (load_model quant=)


def parse_variant(name: str) -> Variant:
    parts = name.split("+")
    bad = [p for p in parts if p not in PARTS]
    if bad or len(set(parts)) != len(parts):
        raise ValueError(f"bad mode {name!r}: '+'-join distinct parts of {', '.join(sorted(PARTS))}")
    quant = [p for p in parts if p in QUANT_MODES]
    real = [LOAD_QUANT[p] for p in parts if p in LOAD_QUANT]
    if len(quant) + len(real) > 1 or ("act_fp16" in parts and "act_bf16" in parts):
        raise ValueError(f"bad mode {name!r}: one weight format and one activation dtype at most")
    served = "served" in parts
    dtype = torch.float16 if "act_fp16" in parts or served else torch.bfloat16 if "act_bf16" in parts else torch.float32
    state = torch.float16 if "state_fp16" in parts or served else torch.float32
    kernels = "auto" if served else "torch"
    return Variant(name, dtype, state, quant[0] if quant else None, kernels, real[0] if real else "none")


def load_variant(spec: str, v: Variant, device: str = "cpu") -> tuple[RWKV7, dict | None]:
    """The model of a variant (pure-torch ops, on `device`) and its quantization report, if any."""
    model = load_model(spec, device, v.dtype, v.state_dtype, kernels=v.kernels, quant=v.load_quant)
    report = fake_quantize(model, v.quant).as_dict() if v.quant else None
    return model, report


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sample_tokens(model: RWKV7, n: int, seed: int, temperature: float = 1.0) -> list[int]:
    """n tokens sampled from the model itself (the first one uniform)."""
    g = torch.Generator().manual_seed(seed)
    toks = [int(torch.randint(0, model.shape.vocab_size, (1,), generator=g))]
    state = model.zero_state(1)
    while len(toks) < n:
        logits = model.decode(torch.tensor(toks[-1:], device=model.device), state)  # (1, V)
        probs = torch.softmax(logits.double().cpu() / temperature, -1)
        toks.append(int(torch.multinomial(probs, 1, generator=g)))
    return toks


def kl_and_top1(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ref, other: (B, V) logits -> KL(ref || other) per row (fp64) and top-1 equality (bool)."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # (B,): exactly 0 for bit-identical logits
    return kl, ref.argmax(-1) == other.argmax(-1)


@dataclass
class Forced:
    """Teacher-forced figures: per model (the reference first) KL and top-1 agreement at each
    scored position; per position the reference's top-two logit gap and top-1 probability."""

    kl: list[list[float]]
    top1: list[list[bool]]
    gap: list[float]
    p1: list[float]


def teacher_forced(models: list[RWKV7], seq: list[int], stride: int) -> Forced:
    """Feed seq to every model in lockstep (models[0] is the reference), scoring the logits
    after every stride-th token."""
    states = [m.zero_state(1) for m in models]
    out = Forced([[] for _ in models], [[] for _ in models], [], [])
    for c in range(0, len(seq) - stride + 1, stride):
        logits = [m.forward([seq[c : c + stride]], s) for m, s in zip(models, states)]  # each (1, V)
        top2 = logits[0].topk(2, -1).values[0]
        out.gap.append(float(top2[0] - top2[1]))
        out.p1.append(float(torch.softmax(logits[0].double(), -1).max()))
        for i, lg in enumerate(logits):
            kl, same = kl_and_top1(logits[0], lg)
            out.kl[i].append(float(kl[0]))
            out.top1[i].append(bool(same[0]))
    return out


def greedy(model: RWKV7, prompts: list[list[int]], gen: int) -> torch.Tensor:
    """(M, gen) greedy continuations of M equal-length prompts, batched (the model's state dtype)."""
    state = model.zero_state(len(prompts))
    tok = model.forward(prompts, state).argmax(-1)  # (M,)
    out = [tok]
    for _ in range(gen - 1):
        tok = model.decode(tok, state).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)  # (M, gen)


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """(M, G) x2 -> per row the index of the first differing token (G when identical)."""
    diff = a != b  # (M, G)
    G = a.shape[1]
    return [int(row.nonzero()[0]) if row.any() else G for row in diff]


def percentile(xs: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q)) if xs else float("nan")


def measure(spec: str, modes: list[str], tokens: int, prompts: int, gen: int, stride: int = 1,
            prompt_len: int = 16, seed: int = 0, source: str = "random",
            device: str = "cpu") -> list[dict]:  # fmt: skip
    """One figure dict per mode (see the module doc)."""
    variants = [parse_variant(m) for m in modes]
    ref, _ = load_variant(spec, Variant("ref"), device)
    V = ref.shape.vocab_size
    if source == "bytes":
        if V != 256:
            raise SystemExit(f"--source bytes needs a byte-level model (vocabulary 256, not {V})")
        seq = held_out(tokens + prompts * prompt_len)
        plist = [seq[tokens + i * prompt_len : tokens + (i + 1) * prompt_len] for i in range(prompts)]
        seq = seq[:tokens]
    else:
        seq = sample_tokens(ref, tokens, seed) if source == "model" else random_tokens(V, tokens, seed)
        plist = [random_tokens(V, prompt_len, seed + 1 + i) for i in range(prompts)]
    models, reports = [ref], [None]
    for v in variants:  # an fp32 variant of the reference's weights only differs in its state
        if v.dtype == torch.float32 and v.quant is None and v.load_quant == "none" and v.name != "ref":
            m = RWKV7(ref.w, ref.shape, ref.name, device, ref.dtype, v.state_dtype, kernels="torch")
            models.append(m)
            reports.append(None)
        else:
            m, rep = load_variant(spec, v, device)
            models.append(m)
            reports.append(rep)
    f = teacher_forced(models, seq, stride)
    kls, top1, n = f.kl, f.top1, max(1, len(f.gap))
    ref_stats = {"near_tie_pct": 100.0 * sum(g < NEAR_TIE for g in f.gap) / n,
                 "ref_gap_p50": percentile(f.gap, 0.5), "ref_top1_prob_mean": sum(f.p1) / n}  # fmt: skip
    ref_gen = greedy(ref, plist, gen) if prompts and gen else None
    rows = []
    for i, v in enumerate(variants, start=1):
        row: dict = {"variant": v.name, "quant": v.quant or v.load_quant, "dtype": _dt(v.dtype), "state_dtype": _dt(v.state_dtype),
                     "tokens": tokens, "stride": stride, "positions": len(kls[i]), "source": source, "seed": seed,
                     "kl_mean": sum(kls[i]) / max(1, len(kls[i])), "kl_p99": percentile(kls[i], 0.99),
                     "top1_agree_pct": 100.0 * sum(top1[i]) / max(1, len(top1[i])),
                     **ref_stats, "quant_report": reports[i]}  # fmt: skip
        if ref_gen is not None:
            div = first_divergence(ref_gen, greedy(models[i], plist, gen))
            row.update(prompts=prompts, prompt_len=prompt_len, gen=gen, drift_mean_tokens=sum(div) / len(div),
                       drift_identical_pct=100.0 * sum(d == gen for d in div) / len(div))  # fmt: skip
        rows.append(row)
    return rows


def _dt(d: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[d]


def table(model: str, rows: list[dict]) -> str:
    head = ("| model | mode | positions | KL mean | KL p99 | top-1 agree | greedy: tokens before divergence"
            " | greedy: identical runs | ref near ties | ref top-2 gap p50 | ref top-1 p |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        drift = f"{r['drift_mean_tokens']:.1f} / {r['gen']}" if "gen" in r else "-"
        same = f"{r['drift_identical_pct']:.0f}% of {r['prompts']}" if "gen" in r else "-"
        lines.append(f"| {model} | {r['variant']} | {r['positions']} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} "
                     f"| {r['top1_agree_pct']:.1f}% | {drift} | {same} | {r['near_tie_pct']:.1f}% "
                     f"| {r['ref_gap_p50']:.3f} | {r['ref_top1_prob_mean']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny", help="synthetic spec or an official .pth path")
    ap.add_argument("--tokens", type=int, default=1024, help="length of the teacher-forced sequence")
    ap.add_argument("--stride", type=int, default=1, help="score every stride-th position")
    ap.add_argument("--prompts", type=int, default=8, help="greedy runs (M)")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens per run (G)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--source", choices=("random", "model", "bytes"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--device", default="cpu", help="where the models run (pure-torch ops): cpu or cuda")
    ap.add_argument("--out", default=str(ROOT / "test" / "bench" / "results.jsonl"))
    ap.add_argument("--fp8-fast-accum", action="store_true",
                    help="the wfp8 GEMMs past 8 rows with cuBLASLt's fast accumulation (cuda_quant.FP8_FAST_ACCUM)")
    args = ap.parse_args()
    if args.fp8_fast_accum:
        from server.model import cuda_quant

        cuda_quant.FP8_FAST_ACCUM = True
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.model, args.modes.split(","), args.tokens, args.prompts, args.gen, args.stride,
                   args.prompt_len, args.seed, args.source, args.device)  # fmt: skip
    print(table(args.model, rows))
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    stamp = {"date": dt.date.today().isoformat(), "commit": commit(), "gpu": gpu, "model": args.model,
             "mode": "quality", "batch": 1, **({"fp8_fast_accum": True} if args.fp8_fast_accum else {})}  # fmt: skip
    write_lines(args.out, [{**stamp, **r} for r in rows])


if __name__ == "__main__":
    main()
