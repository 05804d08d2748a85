"""add_ln_mix's e4m3 rows (cuda_ops.add_ln_mix_fp8, kernels/fused_elementwise.cu): the fp8
products' input written by the kernel that makes it. Bitwise what add_ln_mix then quant_rows make
(the two launches it replaces), and an fp8 model's decode, eager and graph-captured, the same
logits and states with and without it."""

from __future__ import annotations

import pytest
import torch

from server.model import cuda_ops, cuda_quant, load_model
from server.model.graphs import DecodeGraphs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == cuda_quant.FP8_DTYPE else t


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 70, 1024])
@pytest.mark.parametrize("Cn", [784, 1000, 2560, 4096, 4100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,keep,q0", [(6, 4, 3), (6, 0, 0), (6, 6, 5), (1, 0, 0), (1, 1, 0)])
@pytest.mark.parametrize("with_dx", [False, True])
def test_e4m3_rows_are_add_ln_mix_then_quant_rows(monkeypatch, B, Cn, dtype, K, keep, q0, with_dx):
    """C = 784: idle threads in the block (they still meet the absmax barrier); C = 1000 and 4100:
    not the kernel's layout (codes rows not 16-byte multiples, C % 8), so the two launches run."""
    dev = torch.device("cuda")
    assert cuda_ops.available(dev)
    g = torch.Generator().manual_seed(B + Cn + 10 * K + keep + q0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    x, dx = rnd(B, Cn) * 3 + 0.5, (rnd(B, Cn) if with_dx else None)
    ln_w, ln_b = 1 + 0.2 * rnd(Cn), 0.2 * rnd(Cn)
    mix = torch.rand(K, Cn, generator=g).to(dev, dtype)
    pool = rnd(3, B, Cn)  # the shift is a row of a pool, like state.att_shift[i]
    pool[1, 0] = 0  # one row whose planes are all zero: scale 1, codes 0
    x[0], ln_b[:] = 0, 0
    sh_ref, sh_cu = pool.clone(), pool.clone()
    xr, planes = cuda_ops.add_ln_mix(x, dx, ln_w, ln_b, mix, sh_ref[1])
    qr, sr = cuda_quant.quant_like(planes[q0:])
    if Cn % 16 == 0:  # the kernel's layout: the two-launch path must not run
        monkeypatch.setattr(cuda_quant, "quant_like", lambda *a: pytest.fail("fell back to quant_rows"))
    xc, out, rows = cuda_ops.add_ln_mix_fp8(x, dx, ln_w, ln_b, mix, sh_cu[1], keep, q0)
    assert torch.equal(xc, xr) and torch.equal(sh_cu, sh_ref)
    assert out.shape == (keep, B, Cn) and torch.equal(out, planes[:keep])
    assert rows.q.shape == (K - q0, B, Cn) and rows.scale.shape == (K - q0, B, 1)
    assert torch.equal(_bits(rows.q), _bits(qr)) and torch.equal(rows.scale, sr)
    if not with_dx:  # row 0 is all zeros
        assert (rows.scale[:, 0] == 1).all() and not rows.q[:, 0].float().any()


@pytest.mark.gpu
def test_fp8_decode_is_the_same_with_e4m3_rows_from_add_ln_mix(monkeypatch):
    """Past the weight-only rows (B = 100) the r/k/v and FFN key rows leave add_ln_mix in e4m3:
    the same logits and states as add_ln_mix + quant_rows, eager and in a captured graph."""
    dev = torch.device("cuda")
    m = load_model("synthetic:L4-C512:3", device=dev, dtype=torch.float16, state_dtype=torch.float16, quant="fp8")
    B = 100
    assert m._fused() and m.ops.fp8_rows(m._decode_packs()[0].vkr, B, torch.float16)
    assert m.ops.fp8_rows(m.w.layers[0].ffn_key, B, torch.float16)
    assert not m.ops.fp8_rows(m._decode_packs()[0].vkr, 64, torch.float16)  # weight-only there
    calls = []
    fused = cuda_ops.add_ln_mix_fp8
    monkeypatch.setattr(m.ops, "add_ln_mix_fp8", lambda *a: calls.append(1) or fused(*a))
    s1, s2, s3 = m.zero_state(B), m.zero_state(B), m.zero_state(B)
    prompts = [[(7 * b + t) % 1000 + 1 for t in range(5 + b % 7)] for b in range(B)]
    for s in (s1, s2, s3):
        m.forward(prompts, s)
    graphs = DecodeGraphs(m, s3, buckets=[B])
    graphs.capture([B])  # the warm-up step writes the state: resync it
    for a, b in zip(s1.tensors(), s3.tensors()):
        b.copy_(a)
    tok = torch.arange(1, B + 1, device=dev)
    for _ in range(3):
        calls.clear()
        rows = m.decode(tok, s1)
        assert len(calls) == 2 * m.shape.n_layer
        graphs.step(B, tok)
        with monkeypatch.context() as mp:
            mp.setattr(m.ops, "fp8_rows", lambda *a: False)
            plain = m.decode(tok, s2)
        assert not calls[2 * m.shape.n_layer :]
        assert torch.equal(rows, plain) and torch.equal(graphs.logits(B).float(), plain)
        for a, b, c in zip(s1.tensors(), s2.tensors(), s3.tensors()):
            assert torch.equal(a, b) and torch.equal(a, c)
        tok = plain.argmax(-1)
