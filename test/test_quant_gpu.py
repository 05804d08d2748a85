"""The 8-bit weight paths of --quant on the GPU against their pure-torch twins
(server.model.qlinear): the gemv kernel's int8 / fp8 codes (M <= 8, plain, stacked, relu^2),
the per-token fp8 activation quantization kernel (bitwise), the weight-only Triton GEMM, the fp8 x
fp8 products (w8_gemm's e4m3 tiles and torch._scaled_mm), int8's dequantize-then-cuBLAS path,
CUDA-graph replay, and a quantized model's decode and prefill against the same weights on the
pure-torch ops.

Supported layouts run with the fallbacks patched to raise, so a silent fallback fails the test.
"""

from __future__ import annotations

import pytest
import torch

from server.model import cuda_ops, cuda_quant, load_model, qlinear
from server.model.qlinear import QWeight

MODES = ["int8", "fp8"]


@pytest.fixture
def no_large(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the 8-bit gemv fell back for a layout it covers")

    monkeypatch.setattr(cuda_quant, "large", boom)


def _data(shape, dev, seed, scale=1.0, dtype=torch.float16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)


def _qweight(shape, mode, dev, seed) -> QWeight:
    return qlinear.quantize(_data(shape, dev, seed, 0.05), mode)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 2.0**-10) -> None:
    """got (model dtype) vs an fp32/fp64 reference: its own rounding plus 1e-3 of the scale."""
    assert got.shape == ref.shape and torch.isfinite(got).all()
    err = (got.double() - ref.double()).abs()
    bound = rel * ref.double().abs() + 1e-3 * ref.double().abs().amax().clamp_min(1e-30)
    bad = err > bound
    assert not bad.any(), f"{bad.sum().item()} of {err.numel()} off, max err {err.max().item():.3e}"


def _weight_only_ref(x: torch.Tensor, w: QWeight, relu2: bool = False) -> torch.Tensor:
    """x @ (q * scale)^T in fp64 (planes: per plane)."""
    h = torch.relu(x).square() if relu2 else x
    deq = w.q.double() * w.scale.double().unsqueeze(-1)
    return torch.matmul(h.double(), deq.transpose(-1, -2))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N,K", [(2560, 2560), (10240, 2560), (2560, 10240), (96, 2560), (40, 48)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gemv_8bit_matches_its_twin(dev, no_large, mode, N, K, M):
    x, w = _data((M, K), dev, 1), _qweight((N, K), mode, dev, 2)
    _close(cuda_ops.linear(x, w), _weight_only_ref(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [1, 5])
def test_gemv_8bit_stacked_and_relu2(dev, no_large, mode, M):
    x3, w3 = _data((3, M, 2560), dev, 3), _qweight((3, 2560, 2560), mode, dev, 4)
    _close(cuda_ops.linear(x3, w3), _weight_only_ref(x3, w3))
    h, wv = _data((M, 10240), dev, 5), _qweight((2560, 10240), mode, dev, 6)
    before = h.clone()
    _close(cuda_ops.relu2_linear(h, wv), _weight_only_ref(h, wv, relu2=True))
    assert torch.equal(h, before)  # the gemv squares as it loads


@pytest.mark.gpu
@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activation_quantization_kernel_matches_its_twin(dev, act, dtype):
    """Scales within an ulp (torch divides by a scalar through its reciprocal, the kernel does not)
    and the same codes but for the rare value on a rounding boundary (one code step apart)."""
    x = _data((37, 2560), dev, 7, 3.0, dtype)
    x[5] = 0  # an all-zero row: scale 1, codes 0
    q, s = cuda_quant.quant_rows(x, act)
    h = cuda_ops.ops.relu_square(x) if act else x
    q_ref, s_ref = qlinear.quant_rows_native(h)
    assert s.shape == (37, 1) and s[5].item() == 1.0 and not q[5].float().any()
    torch.testing.assert_close(s, s_ref, rtol=2.0**-22, atol=0)
    diff = q.view(torch.uint8).int() != q_ref.view(torch.uint8).int()
    assert diff.float().mean().item() < 1e-2
    steps = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    assert steps.max().item() <= 1  # e4m3 codes of one sign are ordered: 1 = the next value


def _fp8_ref(x: torch.Tensor, w: QWeight, act: bool = False) -> torch.Tensor:
    """The fp8 product of the kernel's own activation codes, in fp32: the GEMM alone is compared
    (the codes may differ from quant_rows_native's by one step on rounding boundaries, which
    test_activation_quantization_kernel_matches_its_twin bounds)."""
    xq, sx = cuda_quant.quant_rows(x, act)  # (M, K) e4m3, (M, 1)
    return (xq.float() @ w.q.float().t()) * sx * w.scale.float()  # (M, N)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 64, 256])
def test_fp8_gemm_past_the_gemv_matches_its_twin(dev, monkeypatch, M):
    """The fp8 x fp8 path (per-token activations, torch._scaled_mm) at every row count, the
    weight-only Triton GEMM that takes some of them in the server turned off."""
    from server.model import w8_gemm

    assert cuda_quant.fp8_gemm_ok(dev), "the H200 runs fp8 GEMMs"
    monkeypatch.setattr(w8_gemm, "run", lambda *a, **k: None)
    x, w = _data((M, 2560), dev, 8), _qweight((10240, 2560), "fp8", dev, 9)
    _close(cuda_ops.linear(x, w), _fp8_ref(x, w))
    x3, w3 = _data((3, M, 2560), dev, 10), _qweight((3, 2560, 2560), "fp8", dev, 11)
    got3 = cuda_ops.linear(x3, w3)
    for p in range(3):
        _close(got3[p], _fp8_ref(x3[p], w3.plane(p)))
    h, wv = _data((M, 10240), dev, 12), _qweight((2560, 10240), "fp8", dev, 13)
    _close(cuda_ops.relu2_linear(h.clone(), wv), _fp8_ref(h, wv, act=True))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [257, 1024])
@pytest.mark.parametrize("act", [False, True])
def test_fp8_residual_product_leaves_its_scales_to_add_ln_mix(dev, monkeypatch, M, act):
    """The output / FFN value projections (residual_linear) past SCALED_MIN_ROWS: torch._scaled_mm
    with tensor-wide scales, the row and column scales left to add_ln_mix. Its value is the fp8
    product; below those rows, the per-row path's tensor."""
    K = 10240 if act else 2560
    x, w = _data((M, K), dev, 20), _qweight((2560, K), "fp8", dev, 21)
    y = cuda_ops.residual_linear(x.clone(), w, act=act)
    assert isinstance(y, qlinear.ScaledProduct) and y.raw.dtype == torch.float16
    _close(y.value(), _fp8_ref(x, w, act))
    monkeypatch.setattr(cuda_quant, "SCALED_MIN_ROWS", M + 1)
    y2 = cuda_ops.residual_linear(x.clone(), w, act=act)
    assert isinstance(y2, torch.Tensor)
    _close(y2, _fp8_ref(x, w, act))


@pytest.mark.gpu
def test_fp8_model_decode_with_scaled_products_matches_the_per_row_path(dev, monkeypatch):
    """The trained byte-level model with fp8 weights, fused decode at 272 rows: its output and FFN
    value products as ScaledProducts (counted) against the same decode with per-row products, the
    same function up to one fp16 rounding of those products; graph replay equals eager. (A random
    model's fp8 decode is chaotic: a 1e-3 nudge of those products moves its logits by 3%.)"""
    from pathlib import Path

    path = Path(__file__).parent / "data" / "rwkv7-bytes-L4-C256.pth"
    model = load_model(str(path), device=dev, dtype=torch.float16, state_dtype=torch.float16, quant="fp8")
    B = 272
    tok = torch.arange(B, device=dev) % 200 + 32
    seen = []
    real = cuda_quant.scaled_product
    monkeypatch.setattr(cuda_quant, "scaled_product", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])

    def decode():
        return model.decode(tok, model.zero_state(B))

    scaled = decode()
    assert len(seen) == 2 * 4 and all(isinstance(y, qlinear.ScaledProduct) for y in seen)  # two per layer
    graph, out = _captured(decode, dev)
    graph.replay()
    assert torch.equal(out, scaled)
    monkeypatch.setattr(cuda_quant, "SCALED_MIN_ROWS", B + 1)
    per_row = decode()
    assert _rel(scaled, per_row) < 1e-2 and not torch.equal(scaled, per_row)
    assert (scaled.argmax(-1) == per_row.argmax(-1)).float().mean().item() >= 0.98


@pytest.mark.gpu
def test_fp8_fast_accumulation_stays_near_the_exact_product(dev, monkeypatch):
    """cuda_quant.FP8_FAST_ACCUM (off by default; docs/performance.md measures it): the products
    past the gemv stay within 1% of the output scale of the kernel codes' exact product, over
    K = 2,560 and 10,240 (the accumulators keep fewer bits without the periodic promotion)."""
    assert cuda_quant.fp8_gemm_ok(dev), "the H200 runs fp8 GEMMs"
    monkeypatch.setattr(cuda_quant, "FP8_FAST_ACCUM", True)
    x, w = _data((256, 2560), dev, 40), _qweight((10240, 2560), "fp8", dev, 41)
    h, wv = _data((256, 10240), dev, 42), _qweight((2560, 10240), "fp8", dev, 43)
    pairs = ((cuda_ops.linear(x, w), _fp8_ref(x, w)), (cuda_ops.relu2_linear(h.clone(), wv), _fp8_ref(h, wv, True)))
    for got, ref in pairs:
        err = (got.double() - ref.double()).abs().max().item() / ref.double().abs().amax().item()
        print(f"fast accumulation: max error {err:.2e} of the output scale")
        assert err < 1e-2


@pytest.mark.gpu
def test_int8_past_the_gemv_is_the_dequantized_product(dev):
    x, w = _data((64, 2560), dev, 14), _qweight((2560, 2560), "int8", dev, 15)
    _close(cuda_ops.linear(x, w), _weight_only_ref(x, w), rel=2.0**-9)


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["stack", "wide", "deep"])
def test_int8_past_the_table_dequantizes_then_runs_cublas(dev, product):
    """Past w8_gemm's int8 rows the product is its twin's own formula, F.linear(act(x),
    w.dequantize()): w8_gemm.dequantize's one launch is bitwise QWeight.dequantize(), so the
    product is bitwise the twin's (the same cuBLAS call on the same operands)."""
    from server.model import ops, w8_gemm

    P, N, K = W8_PRODUCTS[product]
    act = product == "deep"
    M = 512
    assert w8_gemm.pick("int8", M, N, K, P) is None
    x = _data((P, M, K) if P > 1 else (M, K), dev, 90)
    w = _qweight((P, N, K) if P > 1 else (N, K), "int8", dev, 91)
    assert torch.equal(w8_gemm.dequantize(w), w.dequantize())
    twin = ops.linear(ops.relu_square(x) if act else x, w.dequantize())
    assert torch.equal(cuda_quant.large(x, w, act), twin)
    _close(twin, _weight_only_ref(x, w, act), rel=2.0**-9)


W8_PRODUCTS = {"stack": (3, 2560, 2560), "square": (1, 2560, 2560), "wide": (1, 10240, 2560),
               "deep": (1, 2560, 10240)}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("product", list(W8_PRODUCTS))
@pytest.mark.parametrize("M", [9, 16, 24, 32, 64, 100, 128, 256, 300])
def test_weight_only_triton_gemm_past_the_gemv(dev, monkeypatch, mode, product, M):
    """cuda_quant.large takes server.model.w8_gemm wherever its TABLE names a configuration
    (counted: no silent fallback), the product is x @ (q * scale)^T (relu^2 on x for the FFN's
    value shape) within fp16 rounding, and a second run is bitwise the same (the split-K sum's
    order is fixed)."""
    from server.model import w8_gemm

    P, N, K = W8_PRODUCTS[product]
    act = product == "deep"
    x = _data((P, M, K) if P > 1 else (M, K), dev, 30 + M)
    w = _qweight((P, N, K) if P > 1 else (N, K), mode, dev, 31)
    cfg = w8_gemm.pick(mode, M, N, K, P)
    if cfg is None:
        other = "torch._scaled_mm" if mode == "fp8" else "the weight dequantized, then cuBLAS"
        pytest.skip(f"{mode} {product} at {M} rows takes {other} (w8_gemm.TABLE)")
    calls = []
    real = w8_gemm.mm
    monkeypatch.setattr(w8_gemm, "mm", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    got = cuda_quant.large(x, w, act)
    assert calls and calls[-1] == cfg
    _close(got, _weight_only_ref(x, w, act), rel=2.0**-9)
    assert torch.equal(cuda_quant.large(x, w, act), got)


@pytest.mark.gpu
def test_dequantize_first_called_under_capture_takes_torch_ops(dev, monkeypatch):
    """A first dequantize() under CUDA-graph capture (its kernel not compiled and loaded yet)
    records QWeight.dequantize()'s torch ops instead, with the same bits; eager calls launch the
    kernel and mark it ready."""
    from server.model import w8_gemm

    monkeypatch.setattr(w8_gemm, "_dequant_ready", set())
    w = _qweight((256, 512), "int8", dev, 95)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = w8_gemm.dequantize(w)
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, w.dequantize()) and not w8_gemm._dequant_ready
    assert torch.equal(w8_gemm.dequantize(w), w.dequantize()) and w8_gemm._dequant_ready


A8_CONFIGS = [  # (bm, bn, bk, split, swap, warps, stages): both orientations, split-K, 8 warps, K tails
    (128, 128, 128, 1, False, 8, 3), (64, 256, 128, 1, True, 8, 4), (128, 64, 64, 2, False, 4, 4),
    (64, 128, 128, 2, True, 4, 3),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("product", list(W8_PRODUCTS))
@pytest.mark.parametrize("M", [16, 200, 1024])
@pytest.mark.parametrize("cfg", A8_CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_fp8a8_triton_gemm_is_the_fp8_product(dev, product, M, cfg):
    """w8_gemm on e4m3 rows (the fp8a8 kernel: fp8 tensor cores, promoted to fp32 every
    w8_gemm.PROMOTE k, as cuBLASLt's default): within fp16 rounding of the exact product of the
    same codes, as close as torch._scaled_mm gets, and bitwise the same on a second run."""
    from server.model import w8_gemm
    from server.model.w8_gemm import W8Config

    P, N, K = W8_PRODUCTS[product]
    act = product == "deep"
    x = _data((P, M, K) if P > 1 else (M, K), dev, 60 + M)
    w = _qweight((P, N, K) if P > 1 else (N, K), "fp8", dev, 61)
    xq, sx = cuda_quant.quant_like(x, act)
    got = w8_gemm.mm(xq, w, W8Config(*cfg), xs=sx)
    assert got.dtype == torch.float16 and got.shape == (*x.shape[:-1], N)
    ref = torch.matmul(xq.double(), w.q.double().transpose(-1, -2)) * sx.double() * w.scale.double().unsqueeze(-2)
    scaled = cuda_quant.fp8_scaled(x, w, act)
    _close(got, ref, rel=2.0**-9)
    err = (got.double() - ref).abs().max().item()
    print(f"fp8a8 max error {err:.3e}, _scaled_mm {(scaled.double() - ref).abs().max().item():.3e}")
    assert torch.equal(w8_gemm.mm(xq, w, W8Config(*cfg), xs=sx), got)


@pytest.mark.gpu
@pytest.mark.parametrize("product", list(W8_PRODUCTS))
@pytest.mark.parametrize("M", [65, 128, 256, 512, 1024])
def test_fp8_past_the_weight_only_rows_takes_the_table(dev, monkeypatch, product, M):
    """cuda_quant.large's fp8 x fp8 products take w8_gemm's fp8a8 tiles where its TABLE names
    them (counted), else torch._scaled_mm; both are the product of the same activation codes."""
    from server.model import w8_gemm

    P, N, K = W8_PRODUCTS[product]
    act = product == "deep"
    x = _data((P, M, K) if P > 1 else (M, K), dev, 70 + M)
    w = _qweight((P, N, K) if P > 1 else (N, K), "fp8", dev, 71)
    if w8_gemm.pick("fp8", M, N, K, P) is not None:
        pytest.skip(f"fp8 {product} at {M} rows is weight-only (w8_gemm.TABLE)")
    calls = []
    real = w8_gemm.mm
    monkeypatch.setattr(w8_gemm, "mm", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    cuda_quant.large(x, w, act)  # the first call compiles the product's TABLE shapes
    calls.clear()
    got = cuda_quant.large(x, w, act)
    cfg = w8_gemm.pick("fp8a8", M, N, K, P)
    assert calls == ([] if cfg is None else [cfg])
    for p in range(P):
        _close(got[p] if P > 1 else got, _fp8_ref(x[p] if P > 1 else x, w.plane(p) if P > 1 else w, act), rel=2.0**-9)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [256, 1024])
def test_fp8_planes_side_by_side_are_the_planes_in_a_row(dev, monkeypatch, M):
    """Past the fp8a8 tiles' rows the r/k/v stack is one _scaled_mm product per plane, planes
    1.. on side streams (cuda_quant.PLANE_STREAMS): eagerly, and replayed from a CUDA graph over
    new inputs, the bits of the planes run one after another on one stream."""
    from server.model import w8_gemm

    P, N, K = W8_PRODUCTS["stack"]
    x = _data((P, M, K), dev, 80 + M)
    w = _qweight((P, N, K), "fp8", dev, 81)
    assert w8_gemm.pick("fp8", M, N, K, P) is None and w8_gemm.pick("fp8a8", M, N, K, P) is None
    used = []
    real = cuda_quant.side_streams
    monkeypatch.setattr(cuda_quant, "side_streams", lambda *a: used.append(len(real(*a))) or real(*a))

    def in_a_row(x):
        monkeypatch.setattr(cuda_quant, "PLANE_STREAMS", False)
        try:
            return cuda_quant.large(x, w)
        finally:
            monkeypatch.setattr(cuda_quant, "PLANE_STREAMS", True)

    serial = in_a_row(x)
    assert not used
    assert torch.equal(cuda_quant.large(x, w), serial) and used == [P - 1]
    graph, out = _captured(lambda: cuda_quant.large(x, w), dev)
    x.copy_(_data((P, M, K), dev, 90 + M))
    graph.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, in_a_row(x)) and not torch.equal(out, serial)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [16, 100])
def test_weight_only_triton_gemm_with_bf16_activations(dev, mode, M):
    """A bf16 model's 8-bit products on the Triton path: the codes converted to bf16 (no fp16
    bit trick), the output in bf16 (its own rounding: 2^-8)."""
    from server.model import w8_gemm

    x = _data((M, 2560), dev, 50, dtype=torch.bfloat16)
    q = _qweight((2560, 2560), mode, dev, 51)
    w = QWeight(q.q, q.scale, torch.bfloat16)
    cfg = w8_gemm.pick(mode, M, 2560, 2560, 1)
    if cfg is None:
        pytest.skip(f"{mode} square at {M} rows takes another path (w8_gemm.TABLE)")
    got = w8_gemm.run(x, w)
    assert got is not None and got.dtype == torch.bfloat16
    _close(got, _weight_only_ref(x, w), rel=2.0**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [2, 16])
def test_cuda_graph_replay_matches_eager(dev, mode, M):
    x, w = _data((M, 2560), dev, 16), _qweight((10240, 2560), mode, dev, 17)
    eager = cuda_ops.linear(x, w)
    graph, out = _captured(lambda: cuda_ops.linear(x, w), dev)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_quantized_model_matches_the_same_weights_on_pure_torch(dev, mode):
    """Kernels + 8-bit paths vs pure-torch ops over the same 8-bit weights (dequantized products),
    prefill of 40-token prompts then decode at B = 4 (the 8-bit gemv) and B = 12 (past it). int8
    computes the same function both ways (fp16 rounding apart); fp8's prefill and B = 12 products
    also quantize activations per token, which the pure-torch ops do not: looser bounds."""
    spec = "synthetic:L4-C512:3"
    fast = load_model(spec, device=dev, dtype=torch.float16, state_dtype=torch.float16, quant=mode)
    slow = load_model(spec, device=dev, dtype=torch.float16, state_dtype=torch.float16, kernels="torch", quant=mode)
    assert isinstance(fast.w.layers[1].wr, QWeight) and fast._fused() and not slow._fused()
    bound, agree = (2e-2, 0.9) if mode == "int8" else (0.3, 0.5)
    for B in (4, 12):
        sf, ss = fast.zero_state(B), slow.zero_state(B)
        prompts = [[(7 * b + t) % 1000 + 1 for t in range(40)] for b in range(B)]
        lf, ls = fast.forward(prompts, sf), slow.forward(prompts, ss)
        assert _rel(lf, ls) < bound, f"prefill B={B}: {_rel(lf, ls):.3e}"
        tok = ls.argmax(-1)
        df, ds = fast.decode(tok, sf), slow.decode(tok, ss)
        assert _rel(df, ds) < bound, f"decode B={B}: {_rel(df, ds):.3e}"
        assert (df.argmax(-1) == ds.argmax(-1)).float().mean().item() >= agree


def _captured(fn, dev) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn() captured in a CUDA graph after a warm-up call off the capture: (graph, its output)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("as_kernels", [False, True])
def test_hoisted_cublaslt_memset_leaves_the_fp8_product_as_eager(dev, monkeypatch, as_kernels):
    """graphs.capture_graph with HOIST_MEMSETS on a captured FFN key product at 1,024 rows
    (quant_rows, then torch._scaled_mm with per-row scales; cuBLASLt puts a memset between the
    two): graph_driver moves the memset (as_kernels: replaces it by a store kernel, and no memset
    node is left), and replays on new inputs give the eager product's bits."""
    from server.model import graph_driver, graphs

    assert cuda_quant.fp8_gemm_ok(dev), "the H100 / H200 run fp8 GEMMs"
    x, w = _data((1024, 2560), dev, 30), _qweight((10240, 2560), "fp8", dev, 31)
    edits, kinds = [], []
    real = graph_driver.hoist_memsets

    def hoist(raw, kernels):
        edits.append(real(raw, kernels))
        g = graph_driver.DriverGraph(raw)
        kinds.extend(g.kind(n) for n in g.nodes())
        return edits[-1]

    monkeypatch.setattr(graph_driver, "hoist_memsets", hoist)
    monkeypatch.setattr(graphs, "HOIST_MEMSETS", True)
    monkeypatch.setattr(graphs, "MEMSET_KERNELS", as_kernels)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # cuBLASLt's handle and workspace outside the capture
        cuda_quant.fp8_scaled(x, w)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    with graphs.capture_graph(torch.cuda.graph_pool_handle()) as g:
        out = cuda_quant.fp8_scaled(x, w)  # (1024, 10240)
    assert edits == [(1, 1 if as_kernels else 0)], "the one memset before the product moved"
    assert ("memset" in kinds) is not as_kernels
    for seed in (32, 33):
        x.copy_(_data((1024, 2560), dev, seed))
        g.replay()
        torch.cuda.synchronize(dev)
        assert torch.equal(out, cuda_quant.fp8_scaled(x, w))
