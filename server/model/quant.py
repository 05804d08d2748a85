"""Weight-only 8-bit quantization in pure torch: int8 and fp8 (e4m3), per-output-channel scales.

These are the rounding rules of every 8-bit path: `--quant int8|fp8` turns the layers' linears
into server.model.qlinear.QWeight with these quantizers (QUANTIZERS, the per-row modes) at load,
`rwkv-server quantize` (server.model.qfile) writes their codes and scales to a file, and the
CUDA products (the gemv kernel's 8-bit path, server.model.w8_gemm, server.model.cuda_quant) are
tested against the pure-torch products of server.model.qlinear on those codes. An 8-bit GEMM
computes x @ (q * scale[:, None])^T up to accumulation order; `fake_quantize` leaves exactly
dequantize(quantize(w)) in the model's weights instead, so the pure-torch forward computes the
same function and the quality harness (test/bench/quality.py) measures what each mode's
rounding costs, the modes --quant does not take (g128, head16) included.

Layout: weights in the nn.Linear layout (out, in); one fp32 scale per output row, symmetric
(no zero point): int8 scale = absmax / 127, fp8 scale = absmax / 448 (e4m3fn's largest finite
value). An all-zero row gets scale 1 (its codes are 0, no division by zero, no NaN). The modes
`int8g128` / `fp8g128` give each row one scale per group of 128 input columns instead
(scale (out, in / 128)): finer scales for the formats' few bits, at 1/32 more bytes in fp32.
`int8_head16` / `fp8_head16` quantize the layers' linears and leave the head (the logits' own
projection, 5% of a 2.9B model's weights) as it is.

Quantized: the large linears, per layer r/k/v/o of the time mix and the FFN key/value, and the
head. Kept: the embedding (a lookup, not a GEMM), the low-rank LoRA matrices and every vector.
Quantizing a model loaded in fp32 from an official .pth quantizes the checkpoint's own values
(the bf16/fp16 -> fp32 cast is exact); a model loaded in fp16/bf16 is quantized from its
rounded weights and dequantized back into that dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # checkpoint imports qlinear, which imports this module
    from server.model.checkpoint import Weights

MODES = ("int8", "fp8", "int8g128", "fp8g128", "int8_head16", "fp8_head16")
HEAD16 = "_head16"
"""A mode's suffix: the head stays in 16 bit (only the layers' linears are quantized)."""
GROUP = 128
"""Input columns per scale in the g128 modes."""
INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
LAYER_LINEARS = ("wr", "wk", "wv", "wo", "ffn_key", "ffn_value")


def _scales(w: torch.Tensor, qmax: float, group: int) -> torch.Tensor:
    """(out, in) -> fp32 absmax / qmax per row (out,), or per row and group of `group` input
    columns (out, in / group); 1 where everything is zero."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    if group and w.shape[1] % group:
        raise ValueError(f"{w.shape[1]} input columns do not split into groups of {group}")
    a = w.detach().float().abs()
    amax = a.amax(dim=1) if not group else a.view(w.shape[0], -1, group).amax(dim=2)  # (out,) | (out, G)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def _per_column(scale: torch.Tensor, cols: int) -> torch.Tensor:
    """A scale (out,) or (out, G) spread to multiply an (out, cols) tensor."""
    if scale.dim() == 1:
        return scale[:, None]  # (out, 1)
    return scale.repeat_interleave(cols // scale.shape[1], dim=1)  # (out, cols)


def quantize_int8(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) -> (q (out, in) int8 in [-127, 127], scale fp32 (out,) or (out, in / group));
    round to nearest."""
    scale = _scales(w, INT8_MAX, group)
    q = torch.round(w.detach().float() / _per_column(scale, w.shape[1])).clamp_(-INT8_MAX, INT8_MAX)  # (out, in)
    return q.to(torch.int8), scale


def quantize_fp8(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) -> (q (out, in) float8_e4m3fn, scale fp32 (out,) or (out, in / group)). The
    clamp keeps an absmax, which w / scale may overshoot by an ulp of fp32, off e4m3fn's NaN
    encoding."""
    scale = _scales(w, FP8_MAX, group)
    q = (w.detach().float() / _per_column(scale, w.shape[1])).clamp_(-FP8_MAX, FP8_MAX)  # (out, in)
    return q.to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (out, in) int8 or fp8, scale (out,) or (out, G) -> q * scale (computed in fp32) in dtype."""
    return (q.float() * _per_column(scale.float(), q.shape[1])).to(dtype)  # (out, in)


QUANTIZERS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "int8": quantize_int8,
    "fp8": quantize_fp8,
    "int8g128": lambda w: quantize_int8(w, GROUP),
    "fp8g128": lambda w: quantize_fp8(w, GROUP),
}


def round_trip(w: torch.Tensor, mode: str) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: what an 8-bit GEMM multiplies by."""
    if mode not in QUANTIZERS:
        raise ValueError(f"unknown quantization mode {mode!r}: use one of {', '.join(MODES)}")
    q, scale = QUANTIZERS[mode](w)
    return dequantize(q, scale, w.dtype)


def large_linears(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every linear an 8-bit GEMM path would take, in model order."""
    out = [(f"layers.{i}.{n}", getattr(lw, n)) for i, lw in enumerate(weights.layers) for n in LAYER_LINEARS]
    return out + [("head", weights.head)]


@dataclass
class QuantReport:
    mode: str
    tensors: list[str] = field(default_factory=list)
    bytes_16bit: int = 0  # the quantized tensors at 2 bytes per weight
    bytes_8bit: int = 0  # 1 byte per weight plus the fp32 scales
    max_rel_err: float = 0.0  # max over rows of max |w - deq| / the row's absmax

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "tensors": len(self.tensors), "bytes_16bit": self.bytes_16bit,
                "bytes_8bit": self.bytes_8bit, "max_rel_err": self.max_rel_err}  # fmt: skip


class HasWeights(Protocol):
    """The one attribute fake_quantize needs (RWKV7 has it)."""

    w: Weights


@torch.no_grad()
def fake_quantize(model: HasWeights, mode: str) -> QuantReport:
    """Replace every large linear of model.w by its quantize -> dequantize round trip, in place
    (copy_ into the existing storage, so views such as the decode packs' stacked weights see
    it); everything else stays bit-identical. Returns what was touched and the error."""
    report = QuantReport(mode)
    base = mode.removesuffix(HEAD16)
    for name, w in large_linears(model.w):
        if name == "head" and mode.endswith(HEAD16):
            continue
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name} is already 8-bit (a model loaded with quant=): fake_quantize needs 16-bit ones")
        deq = round_trip(w, base)  # (out, in) in w.dtype
        amax = w.float().abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
        err = ((w.float() - deq.float()).abs().amax(dim=1) / amax).max().item()
        w.copy_(deq)
        report.tensors.append(name)
        report.bytes_16bit += 2 * w.numel()
        report.bytes_8bit += w.numel() + 4 * w.numel() // (GROUP if base.endswith("g128") else w.shape[1])
        report.max_rel_err = max(report.max_rel_err, err)
    return report
