"""Parity of the small-batch projection kernel (kernels/gemv.cu via cuda_ops.linear) with
F.linear / torch.bmm and an fp64 reference: plain and stacked, fp16 and bf16, M = 1..8 (kernel)
and 9 (cuBLAS fallback), odd shapes, strided views, layouts the kernel refuses (fallback), and
CUDA-graph replay == eager.

Supported layouts are run with ops.linear patched to raise, so a silent fallback fails the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.model import cuda_ops, ops

DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(2560, 2560), (10240, 2560), (2560, 10240), (96, 2560), (100, 2560), (320, 4096), (24, 40), (8, 8)]


@pytest.fixture
def no_fallback(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("cuda_ops.linear fell back to ops.linear for a layout the kernel covers")

    monkeypatch.setattr(ops, "linear", boom)


def _data(shape, dtype, dev, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got vs x @ w^T in fp64: each output within its own rounding (relative) plus a small share
    of the output scale (fp32 accumulation order)."""
    ref = torch.matmul(x.double(), w.double().transpose(-1, -2))
    assert got.shape == ref.shape and got.dtype == x.dtype and got.is_contiguous()
    assert torch.isfinite(got).all()
    eps = 2.0**-11 if x.dtype == torch.float16 else 2.0**-8  # unit roundoff of the output dtype
    scale = ref.abs().amax().clamp_min(1e-30)
    err = (got.double() - ref).abs()
    bound = 1.01 * eps * ref.abs() + 1e-4 * scale
    bad = err > bound
    assert not bad.any(), f"{bad.sum().item()} outputs off, max err {err.max().item():.3e} (scale {scale.item():.3e})"


def _cublas(x, w):
    return F.linear(x, w) if x.dim() == 2 else torch.bmm(x, w.transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
def test_plain_matches(dev, no_fallback, dtype, N, K, M):
    x = _data((M, K), dtype, dev, seed=M * 7 + N)
    w = _data((N, K), dtype, dev, seed=N + K, scale=0.05)
    got = cuda_ops.linear(x, w)
    _check(got, x, w)
    ref = _cublas(x, w)
    eps = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    assert (got.float() - ref.float()).abs().max() <= 2 * eps * ref.float().abs().max() + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 6, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_m(dev, no_fallback, dtype, M):
    x = _data((M, 2560), dtype, dev, seed=M)
    w = _data((2560, 2560), dtype, dev, seed=1, scale=0.05)
    _check(cuda_ops.linear(x, w), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_m9_falls_back(dev, dtype):
    x = _data((9, 2560), dtype, dev, seed=9)
    w = _data((320, 2560), dtype, dev, seed=2, scale=0.05)
    got = cuda_ops.linear(x, w)
    assert torch.equal(got, F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,M,N,K", [(3, 1, 2560, 2560), (3, 8, 2560, 2560), (2, 3, 100, 4096), (3, 5, 96, 2560)])
def test_stacked_matches(dev, no_fallback, dtype, P, M, N, K):
    x = _data((P, M, K), dtype, dev, seed=P * 100 + M)
    w = _data((P, N, K), dtype, dev, seed=N, scale=0.05)
    got = cuda_ops.linear(x, w)
    assert got.shape == (P, M, N)
    _check(got, x, w)
    for p in range(P):  # each plane uses its own weight
        _check(got[p].contiguous(), x[p], w[p])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(dev, no_fallback, dtype):
    """x planes/rows taken out of bigger buffers (stride(-2) != K, plane stride != M*K), weights
    as planes of a bigger stack (plane stride != N*K) and x broadcast over planes (stride 0)."""
    P, M, N, K = 3, 4, 136, 512
    big = _data((M, 5, K + 64), dtype, dev, seed=3)  # (M, 5, K + 64)
    x = big[:, 1:4, 32 : 32 + K].permute(1, 0, 2)  # (P, M, K): rows 5*(K+64) apart, planes K+64
    assert x.stride(-1) == 1 and x.stride(-2) != K
    wall = _data((5, N, K), dtype, dev, seed=4, scale=0.05)
    w = wall[::2]  # (P, N, K), plane stride 2*N*K
    got = cuda_ops.linear(x, w)
    _check(got, x, w)
    xb = _data((1, M, K), dtype, dev, seed=5).expand(P, M, K)  # plane stride 0
    _check(cuda_ops.linear(xb, w), xb, w)
    x2 = big[:, 2, 8 : 8 + K]  # (M, K) rows 5*(K+64) apart
    _check(cuda_ops.linear(x2, wall[1]), x2, wall[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_refused_layouts_fall_back(dev, dtype):
    """Misaligned x (1-element offset), K % 8 != 0, odd row stride, non-contiguous weight rows,
    fp32: still correct (cuBLAS); the kernel itself returns GEMV_UNSUPPORTED for the first."""
    K, N = 2560, 256
    buf = _data((3, K + 1), dtype, dev, seed=6)
    w = _data((N, K), dtype, dev, seed=7, scale=0.05)
    xm = buf[:, 1:]  # data_ptr 2 bytes past a 16-byte boundary, row stride K + 1
    assert xm.data_ptr() % 16 != 0
    torch.testing.assert_close(cuda_ops.linear(xm, w), F.linear(xm, w), rtol=0, atol=0)
    x1 = buf[:1, 1:]  # M = 1: only the pointer is misaligned
    torch.testing.assert_close(cuda_ops.linear(x1, w), F.linear(x1, w), rtol=0, atol=0)
    lib = cuda_ops._lib(dev)
    out = torch.empty(1, N, device=dev, dtype=dtype)
    stream = torch.cuda.current_stream(dev).cuda_stream
    rc = lib.gemv(cuda_ops._GEMV_DT[dtype], 0, 1, N, K, 1, x1.data_ptr(), x1.stride(0), 0, w.data_ptr(), 0, 0, 0,
                  out.data_ptr(), N, N, 0, 0, 0, 0, 0, stream)  # fmt: skip
    assert rc == cuda_ops.GEMV_UNSUPPORTED
    xk = _data((2, 100), dtype, dev, seed=8)  # K % 8 != 0
    wk = _data((64, 100), dtype, dev, seed=9)
    torch.testing.assert_close(cuda_ops.linear(xk, wk), F.linear(xk, wk), rtol=0, atol=0)
    wt = _data((K, N), dtype, dev, seed=10).t()  # (N, K) with column-major rows
    x = _data((2, K), dtype, dev, seed=11)
    torch.testing.assert_close(cuda_ops.linear(x, wt), F.linear(x, wt), rtol=0, atol=0)
    x32, w32 = x.float(), w.float()
    torch.testing.assert_close(cuda_ops.linear(x32, w32), F.linear(x32, w32), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [1, 2, 3, 16])
@pytest.mark.parametrize("cfg", [1, 2, 3])
def test_tuning_overrides(dev, no_fallback, warps, cfg):
    """Every kernel variant and warp split (incl. warps that get no k-tiles: 16 warps, K = 512)."""
    for M, N, K in [(1, 200, 2560), (8, 72, 512), (3, 40, 264)]:
        x = _data((M, K), torch.float16, dev, seed=M + K)
        w = _data((N, K), torch.float16, dev, seed=N, scale=0.05)
        _check(cuda_ops.linear(x, w, warps=warps, cfg=cfg), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replay_matches_eager(dev, no_fallback, dtype):
    x = _data((2, 2560), dtype, dev, seed=12)
    w = _data((10240, 2560), dtype, dev, seed=13, scale=0.05)
    x3 = _data((3, 1, 2560), dtype, dev, seed=14)
    w3 = _data((3, 2560, 2560), dtype, dev, seed=15, scale=0.05)
    eager = (cuda_ops.linear(x, w), cuda_ops.linear(x3, w3))
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):  # warm-up off the capture
        cuda_ops.linear(x, w), cuda_ops.linear(x3, w3)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (cuda_ops.linear(x, w), cuda_ops.linear(x3, w3))
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])
    x.copy_(_data((2, 2560), dtype, dev, seed=16))  # new inputs, same graph
    graph.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(outs[0], cuda_ops.linear(x, w))


def test_cpu_and_fp32_use_ops_linear():
    """No CUDA needed: CPU tensors go to ops.linear (plain and stacked)."""
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    torch.testing.assert_close(cuda_ops.linear(x, w), F.linear(x, w))
    x3, w3 = torch.randn(2, 3, 64), torch.randn(2, 5, 64)
    torch.testing.assert_close(cuda_ops.linear(x3, w3), torch.bmm(x3, w3.transpose(1, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("NK", [(2560, 10240), (100, 2560), (24, 40)])
def test_relu2_linear_equals_relu_square_then_linear(dev, dtype, M, NK):
    """relu2_linear (relu^2 applied inside the gemv's x loads for M <= 8; relu_square + linear
    for M = 9) gives bitwise what the two separate launches give: the same rounded relu^2 values
    enter the same kernel. h is ffn_key-like (half the entries negative)."""
    N, K = NK
    h = _data((M, K), dtype, dev, seed=M * 7 + N, scale=2.0)
    w = _data((N, K), dtype, dev, seed=M * 7 + N + 1, scale=0.05)
    want = cuda_ops.linear(cuda_ops.relu_square(h.clone()), w)  # (M, N)
    got = cuda_ops.relu2_linear(h.clone(), w)  # (M, N)
    assert torch.equal(got, want)
    if M <= cuda_ops.GEMV_MAX_M:  # M = 9 is cuBLAS on both sides (its own reduction order)
        _check(got, torch.relu(h.float()).square().to(dtype), w)


@pytest.mark.gpu
def test_relu2_linear_leaves_h_and_covers_the_kernel(dev, monkeypatch):
    """At M <= 8 the fused path launches one gemv (no relu_square, no fallback) and leaves h as
    it is; the decode path's relu2_linear is the CUDA op."""
    h = _data((4, 10240), torch.float16, dev, seed=3, scale=2.0)
    w = _data((2560, 10240), torch.float16, dev, seed=4, scale=0.05)
    h0 = h.clone()

    def boom(*a, **k):
        raise AssertionError("fell back")

    monkeypatch.setattr(cuda_ops, "relu_square", boom)
    monkeypatch.setattr(ops, "linear", boom)
    cuda_ops.relu2_linear(h, w)
    assert torch.equal(h, h0)


def _padded_planes(widths, D, K, dtype, dev, seed, pad_value=0.0, along="rows"):
    """Stacked weights (P, D, K) (along rows) or (P, K, D) (along columns) whose plane p is real up
    to widths[p] and pad_value beyond it."""
    P = len(widths)
    w = _data((P, D, K) if along == "rows" else (P, K, D), dtype, dev, seed=seed, scale=0.05)
    for p, d in enumerate(widths):
        if along == "rows":
            w[p, d:].fill_(pad_value)
        else:
            w[p, :, d:].fill_(pad_value)
    return w


LORA_WIDTHS = [(320, 96, 96, 64), (320, 96, 96), (480, 128, 128, 96), (100, 37, 320, 8), tuple(range(8, 88, 8)) + (2104,)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("widths", LORA_WIDTHS)
def test_padding_hints_bitwise(dev, no_fallback, dtype, M, widths):
    """rows= / cols= on zero-padded planes (the decode LoRAs' layout: server.model.decode_pack)
    give bitwise the unhinted product; widths not multiples of 8, more than 8 planes (planes 8+
    read whole) and widths over 2040 (read whole) included. With rows=, the padded outputs are 0."""
    D, C = max(widths), 2560
    x = _data((len(widths), M, C), dtype, dev, seed=M)
    w1 = _padded_planes(widths, D, C, dtype, dev, seed=len(widths))
    got = cuda_ops.linear(x, w1, rows=widths)  # (P, M, D)
    assert torch.equal(got, cuda_ops.linear(x, w1))
    for p, d in enumerate(widths):
        assert not got[p, :, d:].any()
    mid = _data((len(widths), M, D), dtype, dev, seed=M + 1)  # padding columns of mid not zero
    w2 = _padded_planes(widths, D, C, dtype, dev, seed=len(widths) + 1, along="cols")  # (P, C, D)
    assert torch.equal(cuda_ops.linear(mid, w2, cols=widths), cuda_ops.linear(mid, w2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 8])
def test_padding_hints_skip_the_padding(dev, no_fallback, dtype, M):
    """The hints really stop the reads: on planes whose padding is NOT zero, the hinted product is
    the product with the padding zeroed (within the fp64 bound), unlike the unhinted one."""
    widths, D, C = (320, 96, 96, 64), 320, 2560
    x = _data((4, M, C), dtype, dev, seed=21)
    w1 = _padded_planes(widths, D, C, dtype, dev, seed=22, pad_value=1.0)
    w1z = _padded_planes(widths, D, C, dtype, dev, seed=22)
    got = cuda_ops.linear(x, w1, rows=widths)
    _check(got, x, w1z)
    assert not torch.equal(got, cuda_ops.linear(x, w1))
    mid = _data((4, M, D), dtype, dev, seed=23)
    w2 = _padded_planes(widths, D, C, dtype, dev, seed=24, pad_value=1.0, along="cols")
    w2z = _padded_planes(widths, D, C, dtype, dev, seed=24, along="cols")
    got = cuda_ops.linear(mid, w2, cols=widths)
    _check(got, mid, w2z)
    assert not torch.equal(got, cuda_ops.linear(mid, w2))


def test_padding_hints_on_cpu_and_both_refused():
    """No CUDA needed: ops.linear and the CPU route ignore the hints (same product); rows and cols
    together are refused."""
    x, w = torch.randn(2, 3, 64), torch.randn(2, 16, 64)
    w[1, 8:] = 0
    want = torch.bmm(x, w.transpose(1, 2))
    assert torch.equal(ops.linear(x, w, rows=(16, 8)), want)
    assert torch.equal(cuda_ops.linear(x, w, rows=(16, 8)), want)
    with pytest.raises(ValueError):
        cuda_ops.linear(x, w, rows=(16, 8), cols=(64, 64))
    assert cuda_ops._gemv_lim((320, 96, 100, 2100), None) == (40 | 12 << 8 | 13 << 16, 1)
