"""Bitwise A/B of two versions of the fused sampler kernel (kernels/sampler.cu): a git ref's vs the
working tree's. For a kernel change that must not change any result (a speed-up): every token,
the updated penalty and seen rows, and the dbg output (m, S, c*, n kept, top-k threshold, limit,
total weight, target) must be bitwise equal, over many random rows and parameter mixes.

    PYTHONPATH=. python test/bench/ab_sampler.py                 (old = main)
    PYTHONPATH=. python test/bench/ab_sampler.py --ref HEAD~3 --rounds 20
    PYTHONPATH=. python test/bench/ab_sampler.py --old /path/to/old/sampler.cu
    PYTHONPATH=. python test/bench/ab_sampler.py --cl 3          (the new kernel's 3-CTA clusters only)

Each version is built on its own with nvcc (-O3, this GPU's arch) into a shared library and
called through ctypes (the C entry point sampler_step), so neither the kernel cache nor the
loader is involved. The new kernel runs once per cluster size in --cl (each compared with the old
kernel's default). Exit status 1 (and the first differing rows) on any difference.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def build(src: Path, out: Path, arch: str) -> ctypes.CDLL:
    """src's own folder is the include path: an old version builds with its own headers."""
    cmd = ["nvcc", "-O3", f"-arch={arch}", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fno-gnu-unique", "-Xlinker", "-Bsymbolic",
           "-I", str(src.parent), "-o", str(out), str(src)]  # fmt: skip
    subprocess.run(cmd, check=True)
    # both versions define the same C++ symbols (sampler_k::launch<4>, ...): each library binds
    # its own (-Bsymbolic, RTLD_DEEPBIND), or the second one's calls may land in the first; and
    # the function-local statics of inline functions (prepare's "smem opt-in done" table) must not
    # become one process-wide GNU unique symbol (-fno-gnu-unique), or the second library skips the
    # opt-in for its own kernel and its launch fails (CUDA error 1)
    lib = ctypes.CDLL(str(out), mode=os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    f = lib.sampler_step
    P, LL, I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int  # noqa: E741
    lib.has_cl = "int lg_dt, int cl," in src.read_text()  # the cluster-size argument (newer kernels)
    f.argtypes = [P, LL, P, LL, P, LL, P, P, P, P, I, I, I, P, P, I] + ([I] if lib.has_cl else []) + [P]
    f.restype = I
    return lib


def logits_for(case: str, B: int, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, V, generator=g)
    if case == "random":
        x = x * 2
    elif case == "flat":
        x = x * 0.1
    elif case == "peaked":
        hot = torch.randint(0, V, (B, 5), generator=g)
        x.scatter_add_(1, hot, torch.full((B, 5), 9.0) + torch.rand(B, 5, generator=g) * 4)
    elif case == "tied":
        x = (x * 1.5).round()
    elif case == "allzero":
        x = torch.zeros(B, V)
    elif case == "narrow":  # p within a factor 1.1: at V = 50277 / 100000, 11-bit digits
        x = torch.rand(B, V, generator=g) * 0.1
    elif case == "masked":  # -inf over most of the row (a grammar / banned-token mask)
        x = torch.where(torch.rand(B, V, generator=g) < 0.9, torch.full_like(x, -math.inf), x * 3)
    elif case == "huge":  # one token far above the rest: p of the others underflows
        x[:, 7] = 200.0
    return x


def make_inputs(case: str, B: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = logits_for(case, B, V, g)
    seen = torch.rand(B, V, generator=g) < (0.0 if case == "narrow" else 0.01)  # narrow: keep it narrow
    penalty = torch.rand(B, V, generator=g) * 1.5 * seen
    temps = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.05, 2.5, 1.0, 1.0])
    top_ps = torch.tensor([0.3, 0.0, 0.05, 0.9, 1.0, 0.3, 0.999, float("nan"), 0.6, 1e-6])
    top_ks = torch.tensor([0, 0, 1, 5, 300, 40000, 0, 2, 70000, 17])
    i = torch.arange(B)
    fp = torch.stack([temps[(i + seed) % len(temps)], top_ps[(i * 3 + seed) % len(top_ps)],
                      torch.full((B,), 0.5), torch.full((B,), 0.3), torch.full((B,), 0.996)], 1)  # fmt: skip
    ip = torch.stack([top_ks[(i * 7 + seed) % len(top_ks)], 1000 + 7 * i + seed], 1).long()
    pos = (i * 3 + 5 + seed).long()
    commit = (i % 5) != 4
    return logits, penalty, seen, fp, ip, pos, commit


def run(lib, dev, logits, penalty, seen, fp, ip, pos, commit, greedy_only: int, cl: int = 0):
    B, V = logits.shape
    lg, pen, sn = logits.to(dev), penalty.to(dev).clone(), seen.to(dev).clone()
    out = torch.empty(B, dtype=torch.long, device=dev)
    dbg = torch.zeros(B, 8, device=dev)
    fpd, ipd, posd, cmd = fp.to(dev).contiguous(), ip.to(dev).contiguous(), pos.to(dev), commit.to(dev)
    rc = lib.sampler_step(lg.data_ptr(), lg.stride(0), pen.data_ptr(), pen.stride(0), sn.data_ptr(), sn.stride(0),
                          fpd.data_ptr(), ipd.data_ptr(), posd.data_ptr(), cmd.data_ptr(), greedy_only, B, V,
                          out.data_ptr(), dbg.data_ptr(), DT[lg.dtype], *([cl] if lib.has_cl else []),
                          torch.cuda.current_stream(dev).cuda_stream)  # fmt: skip
    torch.cuda.synchronize(dev)
    if rc != 0:
        raise SystemExit(f"{lib._name}: sampler_step returned {rc} (B={B} V={V} {lg.dtype} cl={cl})")
    return out.cpu(), pen.cpu(), sn.cpu(), dbg.cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row bitwise equality (floats compared as their bits)."""
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return (a == b).reshape(a.shape[0], -1).all(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main", help="git ref of the old kernel (default: main)")
    ap.add_argument("--old", help="the old kernel's source file instead of --ref (where no .git is at hand)")
    ap.add_argument("--rounds", type=int, default=6, help="seeds per (case, V, dtype, B)")
    ap.add_argument("--cl", default="4,3", help="the new kernel's cluster sizes to run (each vs the old kernel)")
    a = ap.parse_args()
    a.cl = [int(c) for c in a.cl.split(",")]
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    tmp = Path(tempfile.mkdtemp(prefix="ab_sampler_"))
    old_src = Path(a.old) if a.old else tmp / "kernels" / "sampler.cu"
    if not a.old:  # the ref's whole kernels/ folder (sampler.cu includes its headers since the split)
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", a.ref, "kernels"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=tar, check=True)
    old = build(old_src, tmp / "old.so", arch)
    new = build(ROOT / "kernels" / "sampler.cu", tmp / "new.so", arch)
    cases = ["flat", "random", "peaked", "tied", "allzero", "masked", "huge", "narrow"]
    n_rows = n_bad = 0
    for V in (65536, 50277, 131072, 100000, 1000, 50):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            for case in cases:
                for r in range(a.rounds):
                    B = (1, 7, 64, 300)[r % 4]
                    inp = make_inputs(case, B, V, seed=r * 101 + V % 97)
                    inp = (inp[0].to(dt),) + inp[1:]
                    for greedy_only in (0, 1) if r == 0 else (0,):
                        ro = run(old, dev, *inp, greedy_only)
                        for cl in a.cl:
                            rn = run(new, dev, *inp, greedy_only, cl)
                            ok = same(ro[0], rn[0]) & same(ro[1], rn[1]) & same(ro[2], rn[2]) & same(ro[3], rn[3])
                            n_rows += B
                            n_bad += report(ok, ro, rn, f"V={V} {dt} {case} round={r} greedy={greedy_only} cl={cl}")
        print(f"V={V}: {n_rows} rows compared, {n_bad} differ", flush=True)
    if n_bad:
        sys.exit(1)
    print("bitwise identical")


def report(ok: torch.Tensor, ro, rn, label: str) -> int:
    """Print the first differing rows of one comparison; returns their count."""
    if ok.all():
        return 0
    bad = (~ok).nonzero().flatten()[:5].tolist()
    print(f"DIFF {label} rows {bad}: tokens old {ro[0][bad].tolist()} new {rn[0][bad].tolist()} "
          f"dbg old {ro[3][bad[0]].tolist()} new {rn[3][bad[0]].tolist()}")  # fmt: skip
    return int((~ok).sum())


if __name__ == "__main__":
    main()
