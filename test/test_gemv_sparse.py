"""The one-row FFN value product that skips relu^2's zeros (kernels/gemv_sparse.cu through
server.model.cuda_quant.sparse_relu2): its slice plan on any machine, and on the GPU against the
dequantized product, the gemv it replaces, itself (the same bits on every launch, under a CUDA
graph too) and in a --quant fp8 model's B=1 decode.
"""

from __future__ import annotations

import logging

import pytest
import torch

from server.config import Settings
from server.model import cuda_ops, cuda_quant, load_model, qlinear
from server.model.qlinear import QWeight

SHAPES = [(2560, 10240), (4096, 16384), (1024, 4096), (768, 3072), (256, 1024), (16, 96)]


@pytest.mark.parametrize("N,K", SHAPES + [(2560, 40)])
@pytest.mark.parametrize("sms", [132, 78, 1])
@pytest.mark.parametrize("group", [512, 256])
def test_sparse_plan_covers_k_in_whole_slices(N, K, sms, group):
    slices, ks = cuda_quant.sparse_plan(N, K, sms, group=group)
    assert ks % 32 == 0 and 32 <= ks <= cuda_quant.SPARSE_MAX_KS
    assert slices * ks >= K > (slices - 1) * ks  # every input in a slice, no empty slice
    groups = -(-N // group)
    if cuda_quant.SPARSE_MAX_KS > ks > 32 and sms >= 2 * groups:  # not clamped: about one block per SM
        assert sms / 2 <= groups * slices <= 2 * sms, (groups, slices)


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp16"])
def test_sparse_codes_are_the_transposed_weight(mode):
    w = _weight(48, 96, mode, "cpu", 0)
    sp = cuda_quant.sparse_codes(w, blocks=4)
    src = w.q if isinstance(w, QWeight) else w
    assert torch.equal(
        sp.qt.view(torch.uint8) if mode == "fp8" else sp.qt, (src.view(torch.uint8) if mode == "fp8" else src).t()
    )
    assert sp.qt.is_contiguous() and sp.part.shape[1] == 48 and sp.ks % 32 == 0
    assert sp.count.shape == (1,) and not sp.count.any()  # one group of 256 (fp16) / 512 outputs
    assert cuda_quant.sparse_relu2(torch.randn(1, 96).half(), w, sp) is None  # CPU: not this kernel's


def test_transposed_copies_are_made_on_cuda_only():
    """On the CPU no model carries the transposed copy (the products run in torch there), whatever
    sparse_ffn says; a value sparse_ffn does not know is refused before any load."""
    for quant, sparse_ffn in (("fp8", "auto"), ("fp8", "on"), ("none", "on")):
        model = load_model("synthetic:L2-C128", quant=quant, sparse_ffn=sparse_ffn)
        assert all(lw.ffn_value_t is None for lw in model.w.layers)
    with pytest.raises(ValueError, match="sparse_ffn must be one of auto, on, off"):
        load_model("synthetic:L2-C128", quant="fp8", sparse_ffn="yes")
    assert Settings.from_env({"RWKV_SPARSE_FFN": "off"}).sparse_ffn == "off" and Settings().sparse_ffn == "auto"


def test_the_transposed_copy_is_only_for_fp16_models(caplog):
    """The one-row product takes fp16 activations: a bf16 or fp32 model gets no copy whatever
    sparse_ffn says (said in the log: a warning when asked for with on), an fp16 one per sparse_ffn."""
    from server.model.loader import sparse_wanted

    fp16, bf16 = torch.float16, torch.bfloat16
    assert sparse_wanted("fp8", "auto", fp16, "m") and sparse_wanted("none", "on", fp16, "m")
    assert not sparse_wanted("int8", "auto", fp16, "m") and not sparse_wanted("fp8", "off", fp16, "m")
    with caplog.at_level(logging.INFO, logger="server.model.loader"):
        assert not sparse_wanted("fp8", "auto", bf16, "m") and not sparse_wanted("int8", "on", torch.float32, "m")
    levels = [(r.levelno, "needs fp16 activations" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.INFO, True), (logging.WARNING, True)]


def _data(shape, dev, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=torch.float16)


def _weight(N, K, mode, dev, seed):
    """An (N, K) value weight: fp16, or its int8 / fp8 QWeight."""
    w = _data((N, K), dev, seed, 0.05)
    return w if mode == "fp16" else qlinear.quantize(w, mode)


def _ref(h: torch.Tensor, w) -> torch.Tensor:
    """round(relu(h)^2) @ w^T in fp64 (an 8-bit w: q * scale), the square rounded to fp16 as the
    kernel reads it."""
    x = torch.relu(h).square().to(torch.float16).double()
    wd = w.q.double() * w.scale.double().unsqueeze(-1) if isinstance(w, QWeight) else w.double()
    return x @ wd.t()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got.double() - ref.double()).abs()
    bound = 2.0**-10 * ref.double().abs() + 1e-4 * ref.double().abs().amax().clamp_min(1e-30)
    assert torch.isfinite(got).all() and not (err > bound).any(), f"max err {err.max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "int8", "fp16"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("neg", [0.5, 0.9, 0.0])
def test_sparse_value_matches_the_exact_product(dev, mode, N, K, neg):
    """neg: the share of x shifted below zero (relu^2's zeros); 0.0 leaves about half."""
    w = _weight(N, K, mode, dev, 1)
    sp = cuda_quant.sparse_codes(w)
    h = _data((1, K), dev, 2).abs() if neg else _data((1, K), dev, 2)
    if neg:
        h[:, torch.randperm(K, generator=torch.Generator().manual_seed(3))[: int(neg * K)].to(dev)] *= -1
    before = h.clone()
    got = cuda_quant.sparse_relu2(h, w, sp)
    assert got is not None and got.shape == (1, N) and got.dtype == torch.float16
    _close(got, _ref(h, w))
    assert torch.equal(h, before) and not sp.count.any()  # counters back at zero
    gemv = cuda_ops._linear(h, w, 0, 0, 1, (0, 0))  # the gemv this replaces, within fp16 rounding
    torch.testing.assert_close(got, gemv, rtol=2e-3, atol=1e-3 * gemv.abs().max().item())


@pytest.mark.gpu
def test_sparse_value_all_zero_inputs_and_the_routing(dev, monkeypatch):
    w = _weight(2560, 10240, "fp8", dev, 4)
    sp = cuda_quant.sparse_codes(w)
    h = -_data((1, 10240), dev, 5).abs()  # every relu^2 zero: no weight row read
    assert not cuda_quant.sparse_relu2(h, w, sp).any()
    calls = []
    real = cuda_quant.sparse_relu2
    monkeypatch.setattr(cuda_quant, "sparse_relu2", lambda *a: calls.append(1) or real(*a))
    x = _data((1, 10240), dev, 6)
    y1 = cuda_ops.relu2_linear(x, w, sp)  # one row: the sparse kernel
    cuda_ops.relu2_linear(_data((2, 10240), dev, 6), w, sp)  # two rows: the gemv
    cuda_ops.relu2_linear(x, w)  # no transposed copy: the gemv
    assert calls == [1]
    monkeypatch.setattr(cuda_quant, "SPARSE_VALUE", False)
    y0 = cuda_ops.relu2_linear(x, w, sp)  # switched off: the gemv
    torch.testing.assert_close(y1, y0, rtol=2e-3, atol=1e-3 * y0.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "fp16"])
def test_sparse_value_is_deterministic_and_graph_safe(dev, mode):
    """The slices are summed in order whichever block arrives last: every launch, eager or replayed
    from a CUDA graph, gives the same bits; the counters wrap back to zero after each."""
    w = _weight(2560, 10240, mode, dev, 7)
    sp = cuda_quant.sparse_codes(w)
    x = _data((1, 10240), dev, 8)
    first = cuda_quant.sparse_relu2(x, w, sp)
    for _ in range(20):
        assert torch.equal(cuda_quant.sparse_relu2(x, w, sp), first)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = cuda_quant.sparse_relu2(x, w, sp)
    torch.cuda.current_stream(dev).wait_stream(s)
    for _ in range(5):
        out.zero_()
        g.replay()
        torch.cuda.synchronize(dev)
        assert torch.equal(out, first) and not sp.count.any()


@pytest.mark.gpu
@pytest.mark.parametrize("quant,sparse_ffn,made", [("fp8", "auto", True), ("int8", "on", True), ("none", "on", True),
                                                   ("int8", "auto", False), ("none", "auto", False),
                                                   ("fp8", "off", False)])  # fmt: skip
def test_model_decodes_b1_through_the_sparse_value(dev, monkeypatch, quant, sparse_ffn, made):
    """--sparse-ffn on CUDA: auto gives fp8 models the transposed FFN value weights (int8 and fp16
    ones only with on; off: none). With them, B=1 decode reads them (counted) and matches the same
    model with the sparse path switched off (the gemv) within fp16 rounding."""
    model = load_model("synthetic:L4-C512:3", device=dev, dtype=torch.float16, state_dtype=torch.float16,
                       quant=quant, sparse_ffn=sparse_ffn)  # fmt: skip
    assert all((lw.ffn_value_t is not None) == made for lw in model.w.layers)
    calls = []
    real = cuda_quant.sparse_relu2
    monkeypatch.setattr(cuda_quant, "sparse_relu2", lambda *a: (calls.append(1), real(*a))[1])
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(cuda_quant, "SPARSE_VALUE", on)
        st, tok = model.zero_state(1), torch.tensor([17], device=dev)
        out = [model.decode(tok, st) for _ in range(4)]
        logits[on] = torch.stack(out)
    assert (len(calls) >= 4 * 4) == made  # every layer of the 4 steps with the path on
    a, b = logits[True].float(), logits[False].float()
    assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert torch.equal(a.argmax(-1), b.argmax(-1))
