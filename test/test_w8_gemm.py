"""server.model.w8_gemm without a GPU: its configuration table, and the Triton kernel itself run
by Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the switch is read when the kernel
is defined) against the pure-torch twin, for the tile shapes the table uses: split-K slices
summed by the last program, transposed tiles, stacked planes, relu^2 on x, int8 codes made fp16
by their bits, rows and K that do not fill a tile. The GPU runs and timings are in
test_quant_gpu.py and test/bench/bench_w8_gemm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.model import w8_gemm
from server.model.w8_gemm import W8Config

ROOT = Path(__file__).resolve().parents[1]


def test_table_names_each_product_by_its_shape():
    assert w8_gemm.product(2560, 2560, 3) == "stack"
    assert w8_gemm.product(2560, 2560, 1) == "square"
    assert w8_gemm.product(10240, 2560, 1) == "wide"
    assert w8_gemm.product(2560, 10240, 1) == "deep"
    # rows pick the first bucket that holds them; int8 has this path up to 256 rows, fp8 up to 64
    assert w8_gemm.pick("int8", 9, 2560, 2560, 1) == w8_gemm.TABLE["int8"][0][1]["square"]
    assert w8_gemm.pick("int8", 17, 2560, 2560, 1) == w8_gemm.TABLE["int8"][1][1]["square"]
    assert w8_gemm.pick("int8", 256, 10240, 2560, 1) is not None
    assert w8_gemm.pick("int8", 257, 10240, 2560, 1) is None  # dequantized, then cuBLAS
    assert w8_gemm.pick("fp8", 16, 10240, 2560, 1) is not None
    assert w8_gemm.pick("fp8", 64, 10240, 2560, 1) is None  # _scaled_mm measured faster there
    assert w8_gemm.pick("fp8", 257, 2560, 2560, 3) is None
    # past 64 rows fp8 quantizes its activations: e4m3 tiles where they beat torch._scaled_mm
    assert w8_gemm.pick("fp8", 65, 2560, 2560, 3) is None
    assert w8_gemm.pick("fp8a8", 65, 2560, 2560, 3) == w8_gemm.TABLE["fp8a8"][0][1]["stack"] is not None
    assert w8_gemm.pick("fp8a8", 1024, 10240, 2560, 1) is None  # FFN key: _scaled_mm
    assert w8_gemm.pick("fp8a8", 1025, 2560, 2560, 3) is None  # past the rows measured
    assert w8_gemm.pick("none", 16, 2560, 2560, 1) is None
    for mode, rows in w8_gemm.TABLE.items():
        assert [most for most, _ in rows] == sorted(most for most, _ in rows), mode
        for most, row in rows:
            assert set(row) == {"stack", "square", "wide", "deep"}, (mode, most)
            for cfg in row.values():  # one tile of rows holds a bucket's rows up to 64
                assert cfg is None or cfg.bm >= min(most, 64)


CASES = [  # (mode, planes, M, N, K, act, config)
    ("int8", 1, 5, 64, 256, False, W8Config(16, 32, 64)),
    ("int8", 3, 20, 96, 512, False, W8Config(32, 32, 128, split=2, swap=True)),
    ("int8", 1, 33, 128, 384, True, W8Config(64, 64, 64, split=3)),  # K slices of unequal length
    ("fp8", 1, 7, 64, 256, False, W8Config(16, 64, 128, split=2)),
    ("fp8", 3, 16, 40, 256, False, W8Config(16, 32, 64, swap=True)),  # N not a multiple of the tile
    ("fp8", 1, 18, 96, 512, True, W8Config(32, 32, 128, split=4, swap=True)),
    ("fp8a8", 1, 20, 64, 256, False, W8Config(32, 32, 64)),  # e4m3 rows with their scales
    ("fp8a8", 3, 16, 40, 256, False, W8Config(16, 32, 64, swap=True)),
    ("fp8a8", 1, 33, 96, 512, False, W8Config(64, 32, 128, split=3)),
]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from server.model import qlinear, w8_gemm
    from server.model.w8_gemm import W8Config
    out = []
    for mode, P, M, N, K, act, cfg in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(M * N + K)
        x = torch.randn(*((P,) if P > 1 else ()), M, K, generator=g).half()
        w = qlinear.quantize(torch.randn(*((P,) if P > 1 else ()), N, K, generator=g) * 0.05, mode.removesuffix("a8"))
        w = qlinear.QWeight(w.q, w.scale, torch.float16)
        h = torch.relu(x.float()).square().half() if act else x
        xs = None
        if mode == "fp8a8":  # the exact product of the rows' codes
            x, xs = qlinear.quant_rows_native(x.reshape(-1, K))
            x, xs = x.view(*h.shape), xs.view(*h.shape[:-1], 1)
            h = x.double() * xs.double()
        ref = torch.matmul(h.double(), w.dequantize().double().transpose(-1, -2))
        y = w8_gemm.mm(x, w, W8Config(*cfg), act, xs)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        again = torch.equal(w8_gemm.mm(x, w, W8Config(*cfg), act, xs), y)
        out.append([list(y.shape), list(ref.shape), err, again])
    print(json.dumps(out))
    """
)


def test_interpreted_kernel_matches_its_twin():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    cases = [[m, p, M, N, K, a, list(c.__dict__.values())] for m, p, M, N, K, a, c in CASES]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for case, (shape, ref_shape, err, again) in zip(CASES, results, strict=True):
        assert shape == ref_shape, case
        assert err < 2e-3, f"{case}: max error {err:.2e} of the output scale"  # fp16 output rounding
        assert again, f"{case}: a second run differs"


RUN_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from server.model import qlinear, w8_gemm
    g = torch.Generator().manual_seed(5)
    w = qlinear.quantize(torch.randn(96, 256, generator=g) * 0.05, "int8")  # N < K: a "deep" product
    w = qlinear.QWeight(w.q, w.scale, torch.float16)
    x = torch.randn(100, 256, generator=g).half()
    calls = []
    real = w8_gemm.mm
    w8_gemm.mm = lambda x, w, cfg, act=False, xs=None: calls.append((x.shape[0], cfg)) or real(x, w, cfg, act, xs)
    y = w8_gemm.run(x, w)
    n_first = len(calls)
    y2 = w8_gemm.run(x, w)
    ref = x.double() @ w.dequantize().double().t()
    out = {
        "warm_calls": n_first, "second_calls": len(calls) - n_first,
        "warm_rows": [c[0] for c in calls[: n_first - 1]],
        "table_configs": sum(r[w8_gemm.product(96, 256, 1)] is not None for _, r in w8_gemm.TABLE["int8"]),
        "last_is_pick": calls[-1][1] == w8_gemm.pick("int8", 100, 96, 256, 1),
        "err": ((y.double() - ref).abs().max() / ref.abs().max()).item(), "same": torch.equal(y, y2),
        "strided_codes": w8_gemm.run(x, qlinear.QWeight(w.q.t().contiguous().t(), w.scale, w.dtype)) is None,
    }
    w8_gemm.COUNTERS = 0  # more tiles than counters: the other path
    out["no_counters"] = w8_gemm.pick("int8", 100, 96, 256, 1).split > 1 and w8_gemm.run(x, w) is None
    print(json.dumps(out))
    """
)


def test_run_compiles_every_table_shape_on_the_first_call_then_takes_its_row():
    """w8_gemm.run (interpreted): the first call for a product launches each of the TABLE's
    configurations for it once on a few rows of x (so that later calls, CUDA-graph captures
    among them, find them compiled), then the one pick() names; later calls launch that one
    alone. Codes whose rows are not contiguous, or more tiles than counters, take the other path."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", RUN_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["warm_calls"] == out["table_configs"] + 1 and out["second_calls"] == 1, out
    assert all(rows <= 128 for rows in out["warm_rows"]), out  # a few rows each, not all of x
    assert out["last_is_pick"] and out["same"] and out["err"] < 2e-3, out
    assert out["strided_codes"] and out["no_counters"], out


DEQUANT_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from server.model import qlinear, w8_gemm
    g = torch.Generator().manual_seed(9)
    out = []
    for mode, shape in (("int8", (3, 40, 72)), ("fp8", (50, 96)), ("int8", (5000, 16))):
        w = qlinear.quantize(torch.randn(*shape, generator=g) * 0.05, mode)
        w = qlinear.QWeight(w.q, w.scale, torch.float16)
        got = torch.empty(shape, dtype=torch.float16)
        w8_gemm._dequant_kernel()[(-(-got.numel() // 4096),)](w.q, w.scale, got, got.numel(), shape[-1], BLOCK=4096)
        out.append(torch.equal(got, w.dequantize()))
    print(json.dumps(out))
    """
)


def test_interpreted_dequantization_is_the_twins():
    """w8_gemm.dequantize's kernel (interpreted): bitwise QWeight.dequantize() (q * scale in
    fp32, rounded once), planes and a partial last block included."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", DEQUANT_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_a_table_shape_that_does_not_run_here_gives_way_to_its_stand_in(monkeypatch):
    """On a GPU with less shared memory than the H200 the TABLE was measured on, a shape fails to
    compile (Triton's OutOfResources): run() then uses its small-tile stand-in, and where that
    fails too, the other path (None), instead of failing the server's start."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")
    import torch

    from server.model import qlinear

    monkeypatch.setattr(w8_gemm, "_warm", set())
    monkeypatch.setattr(w8_gemm, "_usable", {})
    w = qlinear.quantize(torch.randn(96, 256) * 0.05, "int8")  # N < K: "deep"
    x = torch.randn(20, 256).half()
    big = w8_gemm.pick("int8", 20, 96, 256, 1)
    refused = {big}
    launched = []

    def fake_mm(x, w, cfg, act=False, xs=None):
        if cfg in refused:
            raise RuntimeError("out of resource: shared memory")
        launched.append(cfg)
        return torch.zeros(x.shape[0], 96, dtype=x.dtype)

    monkeypatch.setattr(w8_gemm, "mm", fake_mm)
    assert w8_gemm.run(x, w) is not None
    assert launched[-1] == w8_gemm.stand_in(big) and big not in launched
    others = [c for _, r in w8_gemm.TABLE["int8"] if (c := r["deep"]) is not None and c != big]
    assert all(c in launched for c in others)  # the shapes that run are kept as they are

    refused.add(w8_gemm.stand_in(big))  # a new product: neither runs
    w2 = qlinear.quantize(torch.randn(96, 512) * 0.05, "int8")
    assert w8_gemm.run(torch.randn(20, 512).half(), w2) is None
