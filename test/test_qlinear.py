"""8-bit weights as --quant loads them (server/model/qlinear.py) on the pure-torch path: the
QWeight container, the twins the CUDA paths are tested against (test_quant_gpu.py), a model
quantized at load computing exactly what the fake-quantized model of the quality harness
computes, and the setting's checks. The CUDA products themselves need a GPU (test_quant_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.checks import settings_problem
from server.cli import build_parser
from server.config import Settings
from server.model import load_model, ops, qlinear
from server.model.quant import FP8_DTYPE, fake_quantize, round_trip
from server.model.qlinear import QWeight

MODES = ["int8", "fp8"]


@pytest.mark.parametrize("mode", MODES)
def test_a_qweight_holds_the_round_trip_of_its_weight(mode):
    w = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1)) * 0.1  # (P, N, K)
    qw = qlinear.quantize(w, mode)
    assert qw.q.dtype == (torch.int8 if mode == "int8" else FP8_DTYPE) and qw.scale.shape == (3, 40)
    assert qw.mode == mode and qw.shape == w.shape and qw.nbytes() == 3 * 40 * 32 + 4 * 3 * 40
    for p in range(3):  # planes quantized row by row, as each plane alone would be
        assert torch.equal(qw.plane(p).dequantize(), round_trip(w[p], mode))
    again = qlinear.stack([qw.plane(p) for p in range(3)])
    assert torch.equal(again.q.view(torch.uint8), qw.q.view(torch.uint8)) and torch.equal(again.scale, qw.scale)
    x = torch.randn(5, 32)
    assert torch.equal(qlinear.dense_native(x, qw.plane(1)), F.linear(x, round_trip(w[1], mode)))
    with pytest.raises(ValueError, match="int8, fp8"):
        qlinear.quantize(w, "int4")


def test_per_token_fp8_codes_and_their_product():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None]  # rows over 6 decades
    x[2] = 0
    q, s = qlinear.quant_rows_native(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1) and s[2].item() == 1.0 and not q[2].float().any()
    amax_codes = q.float().abs().amax(dim=1)
    assert torch.equal(amax_codes[[0, 1, 3, 4, 5]], torch.full((5,), 448.0))  # each row's absmax -> 448
    back = q.float() * s
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + s * 2.0**-9).all()  # e4m3: half an ulp, or subnormal step
    w = qlinear.quantize(torch.randn(16, 64, generator=g) * 0.05, "fp8")
    got = qlinear.dense_fp8_native(x, w)
    assert torch.allclose(got, back @ w.dequantize().t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_quantized_at_load_computes_the_fake_quantized_function(mode):
    """load_model(quant=) keeps 8-bit codes; on the pure-torch path it computes exactly what the
    quality harness's fake quantization (same round trip, 16-bit head) computes, but for the head
    of products of at most HEAD8_MAX_ROWS rows, which is the int8 round trip of the 16-bit head:
    prefill, the unfused and the fused (stacked-weight) decode, on both sides of that limit."""
    q = load_model("synthetic:tiny:3", quant=mode)
    ref = load_model("synthetic:tiny:3")
    fake_quantize(ref, f"{mode}_head16")
    head16, head8 = ref.w.head, round_trip(ref.w.head, "int8")
    lw = q.w.layers[1]
    assert all(isinstance(getattr(lw, n), QWeight) for n in ("wr", "wk", "wv", "wo", "ffn_key", "ffn_value"))
    assert isinstance(q.w.head, torch.Tensor) and q.quant == mode
    assert q.w.head8 is not None and q.w.head8.mode == "int8" and torch.equal(q.w.head8.dequantize(), head8)
    assert not torch.equal(head8, head16)  # else the small-batch cases below would prove nothing
    small, big = [[1, 2, 3, 4, 5, 6, 7], [9, 8]], [[(5 * b + t) % 60 + 1 for t in range(3 + b % 4)] for b in range(9)]
    assert len(big) == qlinear.HEAD8_MAX_ROWS + 1
    for toks, head in ((small, head8), (big, head16)):
        ref.w.head = head
        for fused in (False, True):
            q.fused_decode = ref.fused_decode = fused
            sq, sr = q.zero_state(len(toks)), ref.zero_state(len(toks))
            assert torch.equal(q.forward(toks, sq), ref.forward(toks, sr))
            nxt = torch.arange(3, 3 + len(toks))
            assert torch.equal(q.decode(nxt, sq), ref.decode(nxt, sr))
    pk = q._decode_packs()[1]  # the stacked r/k/v share the layer's codes
    assert isinstance(pk.vkr, QWeight) and pk.vkr.q.data_ptr() == lw.wv.q.data_ptr()
    with pytest.raises(ValueError, match="already 8-bit"):
        fake_quantize(q, mode)
    assert load_model("synthetic:tiny:3").w.head8 is None  # no --quant: one 16-bit head


def test_the_int8_head_covers_exactly_the_gemv_kernels_rows():
    """Past the gemv's rows an int8 head would take the Triton / dequantizing paths, slower than
    the 16-bit head on cuBLAS; below them the gemv would read 16-bit bytes it need not."""
    from server.model import cuda_ops

    assert qlinear.HEAD8_MAX_ROWS == cuda_ops.GEMV_MAX_M


def test_quant_setting_is_checked_before_loading():
    with pytest.raises(ValueError, match="quant must be none or one of int8, fp8"):
        load_model("synthetic:tiny", quant="int4")
    assert Settings.from_env({"RWKV_QUANT": "fp8"}).quant == "fp8"
    assert "--quant 'int4'" in (settings_problem(Settings(quant="int4")) or "")
    assert settings_problem(Settings(quant="int8")) is None
    parser = build_parser(Settings())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quant", "int4"])


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_fast_accumulation_switch_reaches_the_gemm(monkeypatch, fast):
    """cuda_quant.FP8_FAST_ACCUM is what torch._scaled_mm is asked for (the switch benchmarks and
    quality.py flip; its effect is measured on the GPU). No GPU needed: the GEMM is recorded."""
    from server.model import cuda_quant

    seen = []

    def fake_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False, out=None):
        seen.append(use_fast_accum)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_mm)
    monkeypatch.setattr(cuda_quant, "FP8_FAST_ACCUM", fast)
    w = qlinear.quantize(torch.randn(32, 64), "fp8")
    xq, sx = qlinear.quant_rows_native(torch.randn(16, 64))
    assert cuda_quant._mm(xq, sx, w, None).shape == (16, 32)
    cuda_quant._mm(xq, sx, w, torch.empty(16, 32))
    assert seen == [fast, fast]


def test_fp8_gemm_falls_back_to_a_bf16_output_where_cublas_refuses_fp16(monkeypatch):
    """An older cuBLAS refuses per-row scales with an fp16 output: the product is then asked for in
    bf16 (with the same fast-accumulation setting) and cast, and the device is remembered."""
    from server.model import cuda_quant

    calls = []

    def fake_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False, out=None):
        calls.append((out_dtype, use_fast_accum))
        if out_dtype != torch.bfloat16:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        return torch.ones(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_mm)
    monkeypatch.setattr(cuda_quant, "FP8_FAST_ACCUM", True)
    monkeypatch.setattr(cuda_quant, "_BF16_ONLY", set())
    w = qlinear.quantize(torch.randn(32, 64).half(), "fp8")
    xq, sx = qlinear.quant_rows_native(torch.randn(16, 64))
    y = cuda_quant._mm(xq, sx, w, None)
    assert y.dtype == torch.float16 and bool((y == 1).all())
    assert calls == [(torch.float16, True), (torch.bfloat16, True)]
    dst = torch.zeros(16, 32, dtype=torch.float16)
    assert cuda_quant._mm(xq, sx, w, dst) is dst and bool((dst == 1).all())
    assert calls[2:] == [(torch.bfloat16, True)]  # the device is remembered: no fp16 attempt


def test_the_decode_reads_its_fp8_rows_from_add_ln_mix_q_where_the_ops_ask(monkeypatch):
    """Where ops.quantizes_rows says an fp8 product reads e4m3 rows (the CUDA ops: past the
    weight-only tiles), the fused decode takes the r/k/v and FFN key rows from add_ln_mix_q
    (the last 3 of its 6 planes, the one FFN plane) and keeps the planes the LoRAs read in 16
    bits: the same logits as a decode whose products quantize those rows themselves."""
    model = load_model("synthetic:tiny:3", quant="fp8")
    model.fused_decode = True
    n_layers = len(model.w.layers)
    tok = torch.arange(5, 10)

    def decode():
        return model.decode(tok, model.zero_state(len(tok)))

    plain = decode()
    linear = model.ops.linear

    def quantizing_linear(x, w, rows=None, cols=None):  # linear() that quantizes fp8 products' rows first
        if not (isinstance(w, QWeight) and w.mode == "fp8"):  # (not the int8 head of small batches)
            return linear(x, w, rows, cols)
        xq, sx = qlinear.quant_rows_native(x.reshape(-1, x.shape[-1]))
        return ops.linear_q(qlinear.QRows(xq.view(x.shape), sx.view(*x.shape[:-1], 1)), w)

    monkeypatch.setattr(model.ops, "linear", quantizing_linear)
    ref = decode()
    assert not torch.equal(ref, plain)  # else quantized rows would prove nothing
    monkeypatch.setattr(model.ops, "linear", linear)
    calls = []
    real = model.ops.add_ln_mix_q
    monkeypatch.setattr(model.ops, "add_ln_mix_q", lambda *a: calls.append(a[6:]) or real(*a))
    monkeypatch.setattr(model.ops, "quantizes_rows", lambda w, rows: isinstance(w, QWeight) and w.mode == "fp8")
    assert torch.equal(decode(), ref)
    keeps = [pk.lora1.shape[0] for pk in model._decode_packs()]
    assert keeps[0] == 3 and 4 in keeps  # layer 0 has no value-mix LoRA
    assert calls == [c for k in keeps for c in ((3, k), (1, 0))] and len(calls) == 2 * n_layers
