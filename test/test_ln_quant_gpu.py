"""add_ln_mix with its fp8 planes quantized in the same pass (cuda_ops.add_ln_mix_q, the kernel
fused_add_ln_mix_q) against the two launches it replaces (add_ln_mix, then quant_rows): the same
bits for every output; its pure-torch twin; and an fp8 model's decode, which takes it for the
r/k/v and FFN key rows, against the same decode without it (the same logits, bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.model import cuda_ops, cuda_quant, load_model, ops, qlinear
from server.model.qlinear import RAW_UNIT, ScaledProduct


def _inputs(dev, dtype, B, C, K, dx_kind, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    x = (rnd(B, C) * 3 + 0.5).to(dtype)
    if dx_kind == "scaled":  # an fp8 product's raw sums with its row and column scales
        raw = (rnd(B, C) * 100 * RAW_UNIT * 448).to(dtype)
        dx = ScaledProduct(raw, rnd(B, 1).abs() / 448, rnd(C).abs() / 448 * 0.05)
    else:
        dx = rnd(B, C).to(dtype) if dx_kind == "plain" else None
    ln_w, ln_b = (1 + 0.2 * rnd(C)).to(dtype), (0.2 * rnd(C)).to(dtype)
    mix = torch.rand(K, C, generator=g).to(dev, dtype)
    pool = rnd(3, B, C).to(dtype)  # the shift is a row of a pool (a view, like state.att_shift[i])
    return x, dx, ln_w, ln_b, mix, pool


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,nq,keep", [(6, 3, 3), (6, 3, 4), (1, 1, 0)])
@pytest.mark.parametrize("B,C", [(1, 2560), (37, 2560), (1030, 2560), (300, 768)])
@pytest.mark.parametrize("dx_kind", ["none", "plain", "scaled"])
def test_fused_quantized_planes_are_the_unfused_bits(dev, monkeypatch, dtype, K, nq, keep, B, C, dx_kind):
    x, dx, ln_w, ln_b, mix, pool = _inputs(dev, dtype, B, C, K, dx_kind, B + C + K + keep)
    sh_ref, sh_fused = pool.clone(), pool.clone()
    xr, outr = cuda_ops.add_ln_mix(x, dx, ln_w, ln_b, mix, sh_ref[1])
    qr, sr = cuda_quant.quant_rows(outr[K - nq :].reshape(-1, C))  # (nq * B, C), (nq * B, 1)

    def no_fallback(*a, **k):
        raise AssertionError("add_ln_mix_q fell back to add_ln_mix + quant_rows for a layout its kernel covers")

    monkeypatch.setattr(cuda_quant, "quant_rows", no_fallback)
    xf, outf, rows = cuda_ops.add_ln_mix_q(x, dx, ln_w, ln_b, mix, sh_fused[1], nq, keep)
    assert outf.shape == (keep, B, C) and rows.q.shape == (nq, B, C) and rows.scale.shape == (nq, B, 1)
    assert torch.equal(xf, xr) and torch.equal(sh_fused, sh_ref)
    assert torch.equal(outf, outr[:keep])
    assert torch.equal(rows.scale.view(-1, 1), sr)
    assert torch.equal(rows.q.view(torch.uint8).view(-1, C), qr.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_quantized_planes_match_the_twin(dev, dtype):
    """Against ops.add_ln_mix_q (torch's layer norm, quant_rows_native): the kept planes within the
    twins' layer-norm difference, and codes at most one e4m3 step apart, on few of them."""
    B, C, K, nq, keep = 64, 2560, 6, 3, 4
    x, dx, ln_w, ln_b, mix, pool = _inputs(dev, dtype, B, C, K, "plain", 5)
    sh_t, sh_c = pool.clone(), pool.clone()
    xt, outt, rt = ops.add_ln_mix_q(x, dx, ln_w, ln_b, mix, sh_t[1], nq, keep)
    xc, outc, rc = cuda_ops.add_ln_mix_q(x, dx, ln_w, ln_b, mix, sh_c[1], nq, keep)
    assert torch.equal(xc, xt)
    torch.testing.assert_close(outc, outt, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rc.scale, rt.scale, rtol=2e-2, atol=0)
    steps = (rc.q.view(torch.uint8).int() - rt.q.view(torch.uint8).int()).abs()
    assert steps.max().item() <= 1 and (steps > 0).float().mean().item() < 0.05


@pytest.mark.gpu
def test_linear_of_quantized_rows_is_the_product_that_quantizes_them(dev):
    """linear_q of the codes add_ln_mix_q makes = linear() of the 16-bit planes (which quantizes
    them itself), bit for bit, for the stacked r/k/v planes and for one plane; and the twin."""
    B, C = 1024, 2560
    x, dx, ln_w, ln_b, mix, pool = _inputs(dev, torch.float16, B, C, 6, "plain", 9)
    _, out, rows = cuda_ops.add_ln_mix_q(x, dx, ln_w, ln_b, mix, pool[1].clone(), 3, 6)
    w3 = qlinear.quantize(torch.randn(3, C, C, device=dev, dtype=torch.float16) * 0.05, "fp8")
    assert cuda_ops.quantizes_rows(w3, B) and not cuda_ops.quantizes_rows(w3, 8)
    assert not ops.quantizes_rows(w3, B)
    assert torch.equal(cuda_ops.linear_q(rows, w3), cuda_ops.linear(out[3:6], w3))
    wk = qlinear.quantize(torch.randn(4 * C, C, device=dev, dtype=torch.float16) * 0.05, "fp8")
    assert torch.equal(cuda_ops.linear_q(rows.plane(1), wk), cuda_ops.linear(out[4], wk))
    ref = ops.linear_q(rows.plane(1), wk).float()
    got = cuda_ops.linear_q(rows.plane(1), wk).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
def test_fp8_decode_with_quantized_planes_is_the_same_decode(dev, monkeypatch):
    """The trained byte-level model with fp8 weights, fused decode at 272 rows: add_ln_mix_q serves
    every layer's r/k/v and FFN key rows (counted), and the logits are the bits of the decode
    that quantizes those rows in separate launches; graph replay equals eager."""
    path = Path(__file__).parent / "data" / "rwkv7-bytes-L4-C256.pth"
    model = load_model(str(path), device=dev, dtype=torch.float16, state_dtype=torch.float16, quant="fp8")
    B = 272
    tok = torch.arange(B, device=dev) % 200 + 32
    calls = []
    real = model.ops.add_ln_mix_q
    monkeypatch.setattr(model.ops, "add_ln_mix_q", lambda *a, **k: calls.append(a[6]) or real(*a, **k))

    def decode():
        return model.decode(tok, model.zero_state(B))

    fused = decode()
    assert calls == [3, 1] * 4  # nq per call: r/k/v, then the FFN key, in each of the 4 layers
    graph = torch.cuda.CUDAGraph()
    decode()  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = decode()
    graph.replay()
    assert torch.equal(out, fused)
    monkeypatch.setattr(model.ops, "quantizes_rows", lambda *a: False)
    assert torch.equal(decode(), fused)
