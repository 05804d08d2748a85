"""8-bit weights as the model holds them (`--quant int8|fp8`), and their pure-torch twins.

A QWeight is what a large linear becomes when the model is quantized at load: the codes q
(N, K) (or P stacked planes (P, N, K)) in int8 or float8_e4m3fn, and one fp32 scale per output
row (N,) / (P, N); its value is q * scale[..., None] (server.model.quant has the rounding rules).
The products come out in the model dtype.

Two products, each with a pure-torch twin here (the CUDA paths in server.model.cuda_quant are
tested against them):
  * weight-only: x @ (q * scale)^T with x as it is (int8 at any batch; fp8 at decode batches up
    to 64, the gemv kernel's and server.model.w8_gemm's paths): `dense_native`.
  * fp8 x fp8 (the fp8 path at larger batches: w8_gemm's e4m3 tiles, torch._scaled_mm): each row
    of x quantized to e4m3 with its own scale (absmax / 448) first: `dense_fp8_native`, with
    `quant_rows_native` the twin of the activation-quantization kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.model import quant

WEIGHT_MODES = ("int8", "fp8")
"""What --quant accepts besides none: the layers' r/k/v/o and FFN linears become 8-bit; the
embedding, the LoRAs and the vectors stay in the model dtype, and so does the head, but for an
int8 copy that small products read (HEAD8_MAX_ROWS; docs/performance.md: an fp8 head doubles
fp8's KL divergence, an int8 one adds a twentieth to it)."""
CODE_DTYPES = {"int8": torch.int8, "fp8": quant.FP8_DTYPE}
HEAD8_MAX_ROWS = 8
"""With --quant, head products of at most this many rows (decode batches and prefills of up to 8
sequences: the gemv kernel's rows, cuda_ops.GEMV_MAX_M) read an int8 copy of the head: half the
bytes of the B=1 step's largest matrix, for int8's small error (docs/performance.md). Larger
products keep the 16-bit head on cuBLAS, which an int8 weight-only GEMM would only slow down."""


@dataclass
class SparseCodes:
    """A 2-D weight (N, K) transposed, for the one-row product that skips zero inputs
    (kernels/gemv_sparse.cu: the FFN value projection after relu^2), with that kernel's
    workspace. Made by server.model.cuda_quant.sparse_codes; only its caller's stream uses it."""

    qt: torch.Tensor  # (K, N) 8-bit codes or fp16 values, rows contiguous
    part: torch.Tensor  # (slices, N) fp32: each slice's partial sums
    count: torch.Tensor  # (groups,) int32 arrival counters (cuda_quant.sparse_group), zero between launches
    ks: int  # inputs per slice
    warps: int  # per block


@dataclass
class QWeight:
    q: torch.Tensor  # (N, K) or (P, N, K) int8 / float8_e4m3fn codes
    scale: torch.Tensor  # (N,) or (P, N) fp32 per-row scales
    dtype: torch.dtype  # the model dtype: what products come out in

    @property
    def mode(self) -> str:
        return "fp8" if self.q.dtype == quant.FP8_DTYPE else "int8"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self) -> torch.Tensor:
        """q * scale in the model dtype (computed in fp32): (N, K) or (P, N, K)."""
        return (self.q.float() * self.scale.float().unsqueeze(-1)).to(self.dtype)

    def to(self, device: torch.device) -> QWeight:
        return QWeight(self.q.to(device), self.scale.to(device), self.dtype)

    def plane(self, p: int) -> QWeight:
        """Plane p of a stacked weight (views, no copy)."""
        return QWeight(self.q[p], self.scale[p], self.dtype)


def quantize(w: torch.Tensor, mode: str) -> QWeight:
    """A 16/32-bit weight (N, K) or stacked (P, N, K) -> its QWeight (per-row scales)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weight quantization {mode!r}: use one of {', '.join(WEIGHT_MODES)}")
    flat = w.reshape(-1, w.shape[-1])  # (P*N, K)
    q, scale = quant.QUANTIZERS[mode](flat)
    return QWeight(q.view(w.shape), scale.view(w.shape[:-1]), w.dtype)


def stack(ws: list[QWeight]) -> QWeight:
    """Planes (N, K) each -> one stacked (P, N, K) QWeight (new storage)."""
    return QWeight(torch.stack([w.q for w in ws]), torch.stack([w.scale for w in ws]), ws[0].dtype)


RAW_UNIT = 2.0**-20
"""The tensor-wide scale of a ScaledProduct's raw sums: fp16 holds them without overflow for K up
to 342k (|sum| <= K * 448^2), and its finest step, 2^-24 / 2^-20, is 1/16 of one product of two
codes. A power of two, so applying it and undoing it are exact."""


@dataclass(frozen=True)
class ScaledProduct:
    """An fp8 x fp8 product whose per-row and per-column scales are left to its consumer
    (server.model.cuda_ops.add_ln_mix applies them as it adds the product to the residual):
    cuBLASLt's fp8 GEMM runs far faster with tensor-wide scales than with per-row ones
    (docs/performance.md). Its value: raw * (row / RAW_UNIT) * col, in fp32."""

    raw: torch.Tensor  # (M, N) model dtype: the code products' fp32 sums times RAW_UNIT
    row: torch.Tensor  # (M, 1) fp32: the activation rows' scales
    col: torch.Tensor  # (N,) fp32: the weight's per-output-channel scales

    def value(self) -> torch.Tensor:
        """The product in fp32 (M, N), computed as the CUDA consumer does."""
        return self.raw.float() * (self.row * (1.0 / RAW_UNIT)) * self.col


@dataclass(frozen=True)
class QRows:
    """Activation rows already quantized to e4m3, each with its own scale, as quant_rows_native
    makes them: the form an fp8 product reads its input in. server.model.cuda_ops.add_ln_mix_q
    hands its planes over this way, so that the product does not quantize them again."""

    q: torch.Tensor  # (M, K) or planes (P, M, K) e4m3 codes
    scale: torch.Tensor  # (M, 1) / (P, M, 1) fp32

    def plane(self, p: int) -> QRows:
        return QRows(self.q[p], self.scale[p])


Weight = torch.Tensor | QWeight
"""A large linear's weight: the model dtype's tensor, or its 8-bit form."""


def dense_native(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x (..., K) @ w^T -> (..., N): F.linear, with an 8-bit weight dequantized first."""
    return F.linear(x, w.dequantize() if isinstance(w, QWeight) else w)


def quant_rows_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (M, K) -> e4m3 codes (M, K) and fp32 scales (M, 1): code = sat(x * (448 /
    absmax)) rounded to nearest even, scale = absmax / 448 (1 for an all-zero row)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (M, 1)
    nz = amax > 0
    inv = torch.where(nz, quant.FP8_MAX / amax, torch.ones_like(amax))
    q = (x.float() * inv).clamp_(-quant.FP8_MAX, quant.FP8_MAX).to(quant.FP8_DTYPE)
    return q, torch.where(nz, amax / quant.FP8_MAX, torch.ones_like(amax))


def dense_fp8_native(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The fp8 x fp8 product's twin: (quantized rows of x) @ (q * scale)^T in fp32, cast to the
    model dtype. x (M, K), w (N, K) fp8 -> (M, N)."""
    return rows_fp8_native(QRows(*quant_rows_native(x)), w)


def rows_fp8_native(x: QRows, w: QWeight) -> torch.Tensor:
    """dense_fp8_native of rows already quantized: x (M, K) with w (N, K), or planes (P, M, K)
    with (P, N, K) -> (M, N) / (P, M, N) in the model dtype."""
    y = x.q.float() @ w.q.float().transpose(-1, -2)  # (..., M, N)
    return (y * x.scale * w.scale.float().unsqueeze(-2)).to(w.dtype)
