"""The pure-torch WKV primitives (the contract the CUDA twins in cuda_ops follow)."""

from __future__ import annotations

import pytest
import torch

from server.model import ops


def _inputs(B, T, H=2, N=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    w = -0.5 - torch.rand(B, T, H, N, generator=g) * 6  # log-log decay, decay in (0.55, 1)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    a = torch.rand(B, T, H, N, generator=g)
    return r, w, k, v, -kk, kk * a


def _naive_step(S, r, w, k, v, a, b):
    """S (H, N, N): S = S diag(exp(-exp(w))) + (S a) b^T + v k^T; y = S r."""
    sa = S @ a.unsqueeze(-1)  # (H, N, 1)
    S = S * torch.exp(-torch.exp(w)).unsqueeze(-2) + sa * b.unsqueeze(-2) + v.unsqueeze(-1) * k.unsqueeze(-2)
    return S, (S @ r.unsqueeze(-1)).squeeze(-1)


def test_chunk_equals_decode_steps_and_naive():
    B, T = 3, 6
    acts = _inputs(B, T)
    s0 = torch.randn(B, 2, 64, 64) * 0.1
    s_chunk, s_dec = s0.clone(), s0.clone()
    y = ops.wkv_chunk(s_chunk, *acts)  # (B, T, H, N)
    for t in range(T):
        yt = ops.wkv_decode(s_dec, *(x[:, t] for x in acts))
        assert torch.allclose(yt, y[:, t], atol=1e-5)
    assert torch.allclose(s_chunk, s_dec, atol=1e-5)
    for bi in range(B):
        S = s0[bi].clone()
        for t in range(T):
            S, yt = _naive_step(S, *(x[bi, t] for x in acts))
            assert torch.allclose(yt, y[bi, t], atol=1e-4)
        assert torch.allclose(S, s_chunk[bi], atol=1e-4)


def test_identity_steps_leave_state_unchanged():
    r, w, k, v, a, b = _inputs(2, 4)
    w[:, 2:] = ops.IDENTITY_W
    k[:, 2:] = 0
    b[:, 2:] = 0
    s0 = torch.randn(2, 2, 64, 64)
    s_full, s_short = s0.clone(), s0.clone()
    ops.wkv_chunk(s_full, r, w, k, v, a, b)
    ops.wkv_chunk(s_short, *(x[:, :2] for x in (r, w, k, v, a, b)))
    assert torch.equal(s_full, s_short)


@pytest.mark.parametrize("state_dtype,act_dtype", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_dtypes_and_non_contiguous_state(state_dtype, act_dtype):
    acts = [x.to(act_dtype) for x in _inputs(2, 1)]
    pool = torch.randn(2, 4, 2, 64, 64).to(state_dtype)  # (L, B, H, N, N); a strided view
    ref = pool[1, ::2].float().clone()
    y = ops.wkv_decode(pool[1, ::2], *(x[:, 0] for x in acts))
    y_ref = ops.wkv_decode(ref, *(x[:, 0].float() for x in acts))
    assert y.dtype == act_dtype and pool.dtype == state_dtype
    tol = 2e-2
    assert (y.float() - y_ref).abs().max() <= tol * y_ref.abs().max()
    assert (pool[1, ::2].float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_linear_is_the_channel_mix_tail(dtype):
    """ops.relu2_linear(h, w) is the channel mix's relu(h)^2 @ w^T (what the fused decode path
    calls in place of relu_square then linear)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 64, generator=g).to(dtype)  # (M, K) half negative
    w = torch.randn(16, 64, generator=g).to(dtype)  # (N, K)
    want = torch.nn.functional.linear(torch.relu(h).square(), w)  # (M, N)
    assert torch.equal(ops.relu2_linear(h.clone(), w), want)


def _fp8_residual(M=6, K=64, N=32, seed=7):
    """An fp8 product (per-row activation codes, per-channel weight codes) as a ScaledProduct
    built by hand, and the same product computed whole by the twin."""
    from server.model import qlinear

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
    qw = qlinear.quantize(w, "fp8")
    xq, sx = qlinear.quant_rows_native(x)  # (M, K), (M, 1)
    raw = ((xq.float() @ qw.q.float().t()) * qlinear.RAW_UNIT).half()  # what the GEMM writes
    return qlinear.ScaledProduct(raw, sx, qw.scale), qlinear.dense_fp8_native(x, qw).float()


def test_scaled_product_value_is_the_fp8_product():
    """raw carries the sums times RAW_UNIT; value() undoes it and applies both scales."""
    sp, whole = _fp8_residual()
    assert sp.raw.abs().max() < 65504 and sp.raw.abs().max() > 2.0**-14  # in fp16's normal range
    assert torch.allclose(sp.value(), whole, rtol=2.0**-10, atol=1e-6 * whole.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_add_ln_mix_adds_a_scaled_product_once_rounded(dtype):
    """A ScaledProduct dx is added in fp32 and rounded once: x' = round(x + value())."""
    sp, _ = _fp8_residual()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 32, generator=g).to(dtype)
    ln_w, ln_b = torch.ones(32, dtype=dtype), torch.zeros(32, dtype=dtype)
    xs, out = ops.add_ln_mix(x, sp, ln_w, ln_b, None, None)
    want = (x.float() + sp.raw.float() * (sp.row * 2.0**20) * sp.col).to(dtype)
    assert torch.equal(xs, want)
    assert torch.equal(out, torch.nn.functional.layer_norm(want, (32,), ln_w, ln_b, 1e-5))


def test_residual_linear_is_linear_or_relu2_linear_on_torch():
    g = torch.Generator().manual_seed(9)
    h, w = torch.randn(3, 64, generator=g), torch.randn(16, 64, generator=g)
    assert torch.equal(ops.residual_linear(h, w), ops.linear(h, w))
    assert torch.equal(ops.residual_linear(h.clone(), w, act=True), ops.relu2_linear(h.clone(), w))


def test_tmix_blocks_per_sm_cap_by_gpu_name(monkeypatch):
    """The pipelined time-mix's cap: TMIX_PIPE_PER_SM when set (0 = a full wave), else the table's
    entry for a substring of the GPU's name (the H100 SXM: 4), else 0 (any other GPU, the H200)."""
    from server.model import cuda_ops

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA H100 PCIe"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    cuda_ops._gpu_per_sm.cache_clear()
    try:
        monkeypatch.setattr(cuda_ops, "TMIX_PIPE_PER_SM", None)
        got = [cuda_ops.tmix_pipe_per_sm(torch.device("cuda", i)) for i in names]
        assert got == [4, 0, 0]
        monkeypatch.setattr(cuda_ops, "TMIX_PIPE_PER_SM", 0)
        assert cuda_ops.tmix_pipe_per_sm(torch.device("cuda", 0)) == 0
    finally:
        cuda_ops._gpu_per_sm.cache_clear()


@pytest.mark.parametrize("layer0", [True, False])
def test_prefill_time_mix_ops_are_the_decode_time_mix(layer0):
    """tmix_prep, one WKV step and tmix_post (the prefill's ops, one token, biases added inside)
    give tmix_decode's output and state when the decode's LoRA outputs carry their biases already
    (bias=False, as the decode graphs' stacked LoRAs may): the two ways of adding them agree."""
    import types

    H, N, B = 2, 64, 3
    C = H * N
    g = torch.Generator().manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    k_a = 1 + 0.1 * rnd(C)
    lw = types.SimpleNamespace(w0=0.3 * rnd(C) - 1, a0=0.3 * rnd(C), v0=0.3 * rnd(C), k_k=1 + 0.1 * rnd(C),
                               k_a=k_a, k_a1=1 - k_a, r_k=0.1 * rnd(H, N), lnx_w=1 + 0.1 * rnd(C),
                               lnx_b=0.1 * rnd(C))  # fmt: skip
    r, k, v, wz, az, vz, v_first, gate = (rnd(B, C) for _ in range(8))
    vz, v_first = (None, None) if layer0 else (vz, v_first)
    s0 = rnd(B, H, N, N) * 0.2
    s_dec, s_pre = s0.clone(), s0.clone()
    vzb = None if layer0 else vz + lw.v0
    want = ops.tmix_decode(s_dec, r, k, v, wz + lw.w0, az + lw.a0, vzb, v_first, gate, lw, layer0, bias=False)
    w, k2, v2, a, b = ops.tmix_prep(k, v, wz, az, vz, v_first, lw, H)
    hd = lambda t: t.view(B, H, N)  # noqa: E731
    y = ops.wkv_decode(s_pre, hd(r), hd(w), hd(k2), hd(v2), hd(a), hd(b))
    got = ops.tmix_post(y.view(B, C), r, k2, v2, gate, lw, H)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert torch.allclose(s_pre, s_dec, rtol=1e-4, atol=1e-6)
    if not layer0:  # the value mix is applied: v moved toward v_first
        assert not torch.allclose(v2, v)


def test_token_mix_shifts_by_one_token():
    """Each position mixes with the one before it, the first with the shift row: position t is
    token_mix of the one-token chunk x[:, t] with x[:, t - 1] (or the shift) as its shift."""
    g = torch.Generator().manual_seed(12)
    x, shift, mix = torch.randn(2, 5, 8, generator=g), torch.randn(2, 8, generator=g), torch.rand(3, 8, generator=g)
    out = ops.token_mix(x, shift, mix)  # (3, 2, 5, 8)
    for t in range(5):
        prev = shift if t == 0 else x[:, t - 1]
        assert torch.equal(out[:, :, t], ops.token_mix(x[:, t : t + 1], prev, mix)[:, :, 0])
        assert torch.allclose(out[:, :, t], x[:, t] + (prev - x[:, t]) * mix[:, None])
