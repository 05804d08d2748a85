"""Weight quantization (server/model/quant.py) and the quality harness (test/bench/quality.py).

Bounds asserted, and why:
- int8: round to nearest on a grid of step `scale` = absmax / 127 that covers the row, so
  every element is within half a step: |w - deq| <= scale / 2 (plus fp32 rounding of w / scale
  and q * scale, a few ulps of the row's absmax).
- fp8 e4m3: 3 mantissa bits, round to nearest, so a value in the normal range (|w / scale| >=
  2^-6) is within half an ulp, 2^-4 of its magnitude; below 2^-6 the subnormals' fixed step is
  2^-9, so the error is at most 2^-10 * scale. The row's absmax maps to 448, exact in e4m3.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from server.model import load_model
from server.model.quant import (
    FP8_DTYPE,
    dequantize,
    fake_quantize,
    large_linears,
    quantize_fp8,
    quantize_int8,
    round_trip,
)

ROOT = Path(__file__).resolve().parent.parent
ULP = 4 * torch.finfo(torch.float32).eps  # slack for the fp32 divide and multiply, relative to absmax


def _weights(rows: int = 48, cols: int = 80, seed: int = 0) -> torch.Tensor:
    """(rows, cols) normal weights with row scales over 6 decades, a zero row and a row with
    one outlier (its other entries fall deep into fp8's subnormal range)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2, rows)[:, None]
    w[3] = 0.0
    w[5, 7] = 1e4
    return w


def _amax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1, keepdim=True)  # (out, 1)


def test_int8_round_trip_is_within_half_a_step() -> None:
    w = _weights()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    deq = dequantize(q, scale, torch.float32)
    err = (w - deq).abs()
    assert (err <= scale[:, None] / 2 + ULP * _amax(w)).all(), float((err - scale[:, None] / 2).max())
    nonzero = _amax(w)[:, 0] > 0
    assert (q.abs().amax(dim=1)[nonzero] == 127).all()  # each row uses the full range
    assert q.min() >= -127  # symmetric: -128 is never used


def test_fp8_round_trip_is_within_e4m3_rounding() -> None:
    w = _weights(seed=1)
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (w.shape[0],)
    deq = dequantize(q, scale, torch.float32)
    assert torch.isfinite(deq).all()
    s = scale[:, None]
    normal = (w / s).abs() >= 2.0**-6
    err = (w - deq).abs()
    bound = torch.where(normal, 2.0**-4 * w.abs(), 2.0**-10 * s) + ULP * _amax(w)
    assert (err <= bound).all(), float((err - bound).max())
    assert (~normal).any() and normal.any()  # both branches of the bound are exercised
    nonzero = _amax(w)[:, 0] > 0
    assert torch.allclose(deq.abs().amax(dim=1)[nonzero], _amax(w)[nonzero, 0], rtol=1e-6, atol=0)


def test_fp8_is_coarser_than_int8_on_gaussian_rows() -> None:
    """Not a bound, a sanity check of the two grids: 3 mantissa bits lose more than 127 steps."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    e8 = (w - round_trip(w, "int8")).abs().mean()
    ef = (w - round_trip(w, "fp8")).abs().mean()
    assert 0 < e8 < ef


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8])
def test_zero_rows_get_scale_one_and_no_nan(quantize) -> None:
    w = torch.zeros(4, 16)
    w[2] = torch.linspace(-1, 1, 16)
    q, scale = quantize(w)
    assert scale[0] == 1 and scale[1] == 1 and scale[3] == 1
    deq = dequantize(q, scale)
    assert not torch.isnan(deq).any()
    assert (deq[[0, 1, 3]] == 0).all()


def test_round_trip_keeps_dtype_and_rejects_bad_input() -> None:
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    assert round_trip(w, "int8").dtype == torch.bfloat16
    with pytest.raises(ValueError):
        round_trip(w, "int4")
    with pytest.raises(ValueError):
        quantize_int8(torch.randn(8))


def _all_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model's weights by name (the names quant.large_linears uses)."""
    out = {n: getattr(model.w, n) for n in ("emb", "ln_out_w", "ln_out_b", "head")}
    for i, lw in enumerate(model.w.layers):
        for f in dataclasses.fields(lw):
            t = getattr(lw, f.name)
            if t is not None:
                out[f"layers.{i}.{f.name}"] = t
    return out


@pytest.mark.parametrize("mode", ["int8", "fp8", "int8g128", "fp8g128", "fp8_head16"])
def test_fake_quantize_touches_exactly_the_large_linears(mode: str) -> None:
    model = load_model("synthetic:tiny")
    before = {n: t.clone() for n, t in _all_tensors(model).items()}
    report = fake_quantize(model, mode)
    L = model.shape.n_layer
    want = {f"layers.{i}.{n}" for i in range(L) for n in ("wr", "wk", "wv", "wo", "ffn_key", "ffn_value")}
    if not mode.endswith("_head16"):
        want.add("head")
    assert set(report.tensors) == want and len(report.tensors) == len(want)
    after = _all_tensors(model)
    for name, t in after.items():
        if name in want:
            assert not torch.equal(t, before[name]), name
            assert torch.equal(t, round_trip(before[name], mode.removesuffix("_head16"))), name
        else:
            assert torch.equal(t, before[name]), name
    numel = sum(before[n].numel() for n in want)
    assert report.bytes_16bit == 2 * numel
    per = (lambda n: before[n].numel() // 128) if mode.endswith("g128") else (lambda n: before[n].shape[0])
    assert report.bytes_8bit == numel + 4 * sum(per(n) for n in want)
    assert 0 < report.max_rel_err <= (1 / 254 if mode == "int8" else 2.0**-4) * (1 + 1e-5)


def test_fake_quantize_reaches_the_stacked_decode_weights() -> None:
    """The fused decode path reads stacked copies (decode_pack): they must see the new values."""
    model = load_model("synthetic:tiny")
    model.fused_decode = True
    packs = model._decode_packs()
    fake_quantize(model, "int8")
    for lw, pk in zip(model.w.layers, packs):
        assert torch.equal(pk.vkr[0], lw.wv) and torch.equal(pk.vkr[2], lw.wr)
    assert [n for n, _ in large_linears(model.w)][-1] == "head"


# --- the harness ---------------------------------------------------------------------------------
def _harness():
    """test/bench/quality.py as a module (registered first: its dataclasses look it up)."""
    if "quality_bench" in sys.modules:
        return sys.modules["quality_bench"]
    spec = importlib.util.spec_from_file_location("quality_bench", ROOT / "test" / "bench" / "quality.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quality_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_harness_smoke_on_tiny() -> None:
    q = _harness()
    rows = q.measure("synthetic:tiny", ["ref", "state_fp16"], tokens=24, prompts=2, gen=6, prompt_len=4)
    ref, fp16 = rows
    assert ref["kl_mean"] == 0 and ref["kl_p99"] == 0 and ref["top1_agree_pct"] == 100
    assert ref["drift_mean_tokens"] == 6 and ref["drift_identical_pct"] == 100
    assert ref["positions"] == 24
    assert 0 < fp16["kl_mean"] < 1e-4 and fp16["state_dtype"] == "fp16"
    assert 0 <= ref["near_tie_pct"] <= 100 and 0 < ref["ref_top1_prob_mean"] < 1
    assert "| state_fp16 |" in q.table("synthetic:tiny", rows)


def test_harness_modes_and_divergence() -> None:
    q = _harness()
    v = q.parse_variant("int8+act_fp16")
    assert (v.quant, v.dtype, v.state_dtype) == ("int8", torch.float16, torch.float32)
    for bad in ("int9", "int8+fp8", "act_fp16+act_bf16", "ref+ref"):
        with pytest.raises(ValueError):
            q.parse_variant(bad)
    a = torch.tensor([[1, 2, 3], [1, 2, 3]])
    b = torch.tensor([[1, 2, 3], [1, 5, 3]])
    assert q.first_divergence(a, b) == [3, 1]
    kl, same = q.kl_and_top1(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert kl[0] > 0 and not bool(same[0])


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8])
def test_group_scales_follow_each_group_of_columns(quantize) -> None:
    """One scale per 128 input columns: a group of tiny weights next to a group of large ones
    keeps its own precision. One scale per row loses it in int8 (fixed steps); fp8's exponent
    keeps small values' relative precision either way."""
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    w[:, 128:] *= 1e-3
    q, scale = quantize(w, 128)
    assert scale.shape == (4, 2) and q.shape == w.shape
    deq = dequantize(q, scale)
    row = dequantize(*quantize(w))
    small = w[:, 128:].abs().max()
    assert (deq[:, 128:] - w[:, 128:]).abs().max() < 0.07 * small
    if quantize is quantize_int8:
        assert (row[:, 128:] - w[:, 128:]).abs().max() > 0.2 * small
    with pytest.raises(ValueError, match="groups of 128"):
        quantize(torch.randn(4, 200), 128)
