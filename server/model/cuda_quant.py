"""The CUDA products of 8-bit weights (server.model.qlinear.QWeight) past the gemv kernel's
batch sizes. server.model.cuda_ops.linear sends a QWeight here when the gemv (M <= 8, fp16
activations: weight-only, codes converted in registers) does not take it:

  * int8 and fp8 at the rows and products where w8_gemm's TABLE names it (int8 up to 256 rows,
    fp8 up to 64: where it measured faster than the next path): the weight-only Triton GEMM of
    server.model.w8_gemm (codes converted to fp16 in its tiles). Twin: qlinear.dense_native.
  * fp8 past those rows, on sm_89+: each row of x quantized to e4m3 (kernels/quant.cu, one launch
    for all planes; relu^2 folded in for the FFN's value projection), then the e4m3 x e4m3
    product on the fp8 tensor cores: w8_gemm's fp8a8 tiles where its TABLE has them (the r/k/v
    planes in one launch), else torch._scaled_mm (cuBLASLt), with the per-row scales of both
    sides, out in the model dtype (planes: one product each, on their own streams). Twin:
    qlinear.dense_fp8_native.
  * fp8 products whose only use is the residual add (the output and FFN value projections, through
    cuda_ops.residual_linear) past SCALED_MIN_ROWS: the same e4m3 rows times the codes through
    torch._scaled_mm with tensor-wide scales (cuBLASLt has fast kernels for those, one slow
    kernel for per-row scales), the per-row and per-column scales left to add_ln_mix: a
    qlinear.ScaledProduct. Twin: its value().
  * the FFN value projection of ONE row (B = 1 decode) with relu^2, when the layer has its
    transposed copy (LayerWeights.ffn_value_t, made at load per --sparse-ffn; 8-bit codes, or
    fp16 weights with --sparse-ffn on): kernels/gemv_sparse.cu, which reads only the weight rows
    of the nonzero inputs (relu^2 zeroes about half of a random model's and most of a trained
    one's). Twin: qlinear.dense_native of ops.relu_square(x).
  * anything else (int8 where the TABLE has no shape, fp8 where _scaled_mm cannot run, odd
    shapes): the weight dequantized into the model dtype (a temporary of one weight's size, one
    launch), then cuBLAS. From a few hundred rows the product is bound by the tensor cores, where
    cuBLAS's fp16 GEMM beats the Triton kernel's by more than the dequantization costs.
"""

from __future__ import annotations

import functools

import torch

from server.model import ops, qlinear, w8_gemm
from server.model.decode_pack import side_streams
from server.model.qlinear import RAW_UNIT, QWeight, ScaledProduct, SparseCodes, Weight
from server.model.quant import FP8_DTYPE

UNSUPPORTED = -2
_DT = {torch.float16: 1, torch.bfloat16: 2}


def _lib(device: torch.device):
    """The kernel module the model's start-up loaded (never builds; None: pure torch)."""
    from kernels import loader  # deferred: importing this module must not build anything

    return loader.loaded_any(device)


@functools.lru_cache(maxsize=8)
def fp8_gemm_ok(device: torch.device) -> bool:
    """True when torch._scaled_mm runs fp8 on this GPU (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quant_rows(x: torch.Tensor, act: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (R, K) -> e4m3 codes (R, K), fp32 scales (R, 1) (act: of round(relu(x)^2));
    one kernel launch, else the pure-torch twin."""
    R, K = x.shape
    lib = _lib(x.device) if x.is_cuda else None
    if lib is not None and x.dtype in _DT and x.stride(-1) == 1:
        q = torch.empty(R, K, device=x.device, dtype=FP8_DTYPE)  # (R, K)
        s = torch.empty(R, 1, device=x.device, dtype=torch.float32)  # (R, 1)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        rc = lib.quant_rows_fp8(_DT[x.dtype], R, K, x.data_ptr(), x.stride(0), int(act), q.data_ptr(), K,
                                s.data_ptr(), stream)  # fmt: skip
        if rc == 0:
            return q, s
        if rc != UNSUPPORTED:
            raise RuntimeError(f"quant_rows_fp8: CUDA kernel failed (code {rc})")
    return qlinear.quant_rows_native(ops.relu_square(x) if act else x)


def large(x: torch.Tensor, w: QWeight, act: bool = False) -> torch.Tensor:
    """act(x) @ w^T for x (M, K) and w (N, K), or planes x (P, M, K) and w (P, N, K) -> (M, N) /
    (P, M, N) in x's dtype. act: relu^2 on x first (x is left as it is)."""
    fp8_mm = _fp8_mm(w, x.device)
    if x.is_cuda and x.dtype in _DT and (w.mode == "int8" or fp8_mm):
        y = w8_gemm.run(x, w, act)  # weight-only, where its TABLE says it is the fastest
        if y is not None:
            return y
    if fp8_mm and x.dtype in _DT:
        return large_q(*quant_like(x, act), w)
    return ops.linear(ops.relu_square(x) if act else x, w8_gemm.dequantize(w))


def large_q(xq: torch.Tensor, sx: torch.Tensor, w: QWeight) -> torch.Tensor:
    """large()'s fp8 x fp8 product of rows already quantized: codes xq (M, K) / (P, M, K) with
    scales sx (M, 1) / (P, M, 1): w8_gemm's e4m3 tiles where its TABLE has them, else _scaled."""
    y = w8_gemm.run(xq, w, xs=sx)
    return y if y is not None else _scaled(xq, sx, w)


def takes_rows(w: Weight, M: int, dtype: torch.dtype) -> bool:
    """Whether large() quantizes M rows of x (dtype) to e4m3 for w itself: an fp8 w on fp8 tensor
    cores at rows past the weight-only tiles' (w8_gemm's TABLE). There a caller may hand it the
    rows quantized already (large_q)."""
    if not isinstance(w, QWeight) or dtype not in _DT or not w.q.is_cuda or not _fp8_mm(w, w.q.device):
        return False
    return w8_gemm.pick("fp8", M, w.shape[-2], w.shape[-1], w.q.shape[0] if w.q.dim() == 3 else 1) is None


def _fp8_mm(w: QWeight, device: torch.device) -> bool:
    """Whether w's products run e4m3 x e4m3 on the fp8 tensor cores: fp8 codes, both dimensions
    multiples of 16, a GPU with fp8 GEMMs (large() and takes_rows() decide by this one rule)."""
    return w.mode == "fp8" and w.shape[-1] % 16 == 0 and w.shape[-2] % 16 == 0 and fp8_gemm_ok(device)


SCALED_MIN_ROWS = 32
"""Rows from which residual products come back as ScaledProducts, ahead of w8_gemm's tiles (it
measured faster from 32 rows, slower at 16; below, the weight-only tiles or the gemv run them).
A module constant so that benchmarks compare both paths (docs/performance.md)."""


def scaled_product(x: torch.Tensor, w: QWeight, act: bool = False) -> ScaledProduct | None:
    """act(x) (M, K) @ w^T for an fp8 w (N, K) as a ScaledProduct (see the module doc); None where
    that path does not apply (another mode or shape, too few rows, no fp8 tensor cores)."""
    if w.mode != "fp8" or w.dim() != 2 or x.dim() != 2 or not x.is_cuda or x.dtype not in _DT:
        return None
    (M, K), N = x.shape, w.shape[0]
    if M < SCALED_MIN_ROWS or K % 16 or N % 16 or not fp8_gemm_ok(x.device):
        return None
    units = _units(x.device)
    if units is None:
        return None
    xq, sx = quant_rows(x, act)  # (M, K), (M, 1)
    raw = torch._scaled_mm(xq, w.q.t(), scale_a=units[0], scale_b=units[1], out_dtype=w.dtype,
                           use_fast_accum=FP8_FAST_ACCUM)  # fmt: skip
    return ScaledProduct(raw, sx, w.scale)


_UNITS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _units(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tensor-wide scales of a ScaledProduct's GEMM (RAW_UNIT, 1) on device; made on the first
    eager call (the engine warms up before it captures graphs), None if first asked under capture."""
    if device not in _UNITS:
        if torch.cuda.is_current_stream_capturing():
            return None
        _UNITS[device] = (torch.tensor([RAW_UNIT], device=device), torch.ones(1, device=device))
    return _UNITS[device]


def quant_like(x: torch.Tensor, act: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_rows over x's last dimension, shaped as x: codes (..., K) e4m3, scales (..., 1)."""
    xq, sx = quant_rows(x.reshape(-1, x.shape[-1]), act)  # (R, K), (R, 1)
    return xq.view(x.shape), sx.view(*x.shape[:-1], 1)


def fp8_scaled(x: torch.Tensor, w: QWeight, act: bool = False) -> torch.Tensor:
    """large()'s fp8 x fp8 product through torch._scaled_mm alone (benchmarks compare it)."""
    return _scaled(*quant_like(x, act), w)


MM_ROWS = 16
"""cuBLASLt's fp8 GEMM with per-row scales wants the rows in multiples of 16 (9 rows:
CUBLAS_STATUS_NOT_SUPPORTED on the H200): other counts are padded with zero rows."""


def _scaled(xq: torch.Tensor, sx: torch.Tensor, w: QWeight) -> torch.Tensor:
    """Quantized rows xq (M, K) / (P, M, K) with scales sx (M, 1) / (P, M, 1) @ w^T through
    torch._scaled_mm, one call per plane (planes 1.. on side streams: PLANE_STREAMS)."""
    M, K = xq.shape[-2], xq.shape[-1]
    N = w.shape[-2]
    flat = xq.dim() == 2
    xq3, sx3 = xq.view(-1, M, K), sx.view(-1, M, 1)  # (P, M, K), (P, M, 1)
    planes = xq3.shape[0]
    if M % MM_ROWS:  # zero rows (scale 1) to the next multiple of 16, per plane
        R = -(-M // MM_ROWS) * MM_ROWS
        xq3 = torch.cat([xq3, xq3.new_zeros(planes, R - M, K)], 1)  # (P, R, K)
        sx3 = torch.cat([sx3, sx3.new_ones(planes, R - M, 1)], 1)  # (P, R, 1)
        ys = [_mm(xq3[p], sx3[p], w if flat else w.plane(p), None)[:M] for p in range(planes)]
        return ys[0] if flat else torch.stack(ys)
    if flat:
        return _mm(xq, sx, w, None)
    out = torch.empty(planes, M, N, device=xq.device, dtype=w.dtype)  # (P, M, N)
    sides = side_streams(xq.device, planes - 1, _STREAMS) if PLANE_STREAMS and xq.is_cuda else []
    for p, side in enumerate(sides, 1):  # beside plane 0 (in a CUDA graph: parallel branches)
        with side:
            _mm(xq3[p], sx3[p], w.plane(p), out[p])
    for p in range(planes - len(sides)):  # plane 0, or every plane without side streams
        _mm(xq3[p], sx3[p], w.plane(p), out[p])
    for side in sides:
        side.join()
    return out


PLANE_STREAMS = True
"""Run the planes of a stacked _scaled_mm product (r/k/v past the fp8a8 tiles' rows) beside each
other, plane 0 on the current stream and the others on side streams: cuBLASLt's fp8 kernel has
one tile shape (128 x 128), so one 2,560-wide plane at 1,024 rows is 160 tiles on 132 SMs (1.2
waves) and three in a row leave three part-empty waves; side by side they fill them (the bits
are the same either way). A module switch so that tests and benchmarks compare both."""

_STREAMS: dict[int, list[torch.cuda.Stream]] = {}  # the planes' side streams per current stream


FP8_FAST_ACCUM = False
"""torch._scaled_mm's use_fast_accum: cuBLASLt keeps the fp8 products in the tensor cores'
accumulators for the whole K instead of promoting them to fp32 every few k-steps. A module
constant so that benchmarks and quality.py can compare both in one process (docs/performance.md)."""

_BF16_ONLY: set[torch.device] = set()
"""Devices whose _scaled_mm refused per-row scales with a non-bf16 output (older cuBLAS): there
the product comes out in bf16 and is cast (found on the first, eager call: never under capture)."""


def _mm(xq: torch.Tensor, sx: torch.Tensor, w: QWeight, out: torch.Tensor | None) -> torch.Tensor:
    """(M, K) e4m3 rows with scales (M, 1) @ w (N, K) e4m3 with scales (N,) -> (M, N) in w.dtype."""
    wt, sw = w.q.t(), w.scale.view(1, -1)  # (K, N) column-major, (1, N)

    def scaled_mm(dtype: torch.dtype, dst: torch.Tensor | None = None) -> torch.Tensor:
        if dst is None:
            return torch._scaled_mm(xq, wt, scale_a=sx, scale_b=sw, out_dtype=dtype, use_fast_accum=FP8_FAST_ACCUM)
        return torch._scaled_mm(xq, wt, scale_a=sx, scale_b=sw, out_dtype=dtype, use_fast_accum=FP8_FAST_ACCUM,
                                out=dst)  # fmt: skip

    if w.dtype == torch.bfloat16 or xq.device not in _BF16_ONLY:
        try:
            return scaled_mm(w.dtype, out)
        except RuntimeError as e:
            if w.dtype == torch.bfloat16 or "bf16" not in str(e).lower().replace("bfloat16", "bf16"):
                raise
            _BF16_ONLY.add(xq.device)
    y = scaled_mm(torch.bfloat16).to(w.dtype)
    return y if out is None else out.copy_(y)


SPARSE_VALUE = True
"""Route one-row FFN value products to the sparse kernel where the weight has its transposed codes
(a module switch so that benchmarks compare both paths in one process)."""
SPARSE_MAX_KS = 1024  # inputs per slice at most (kernels/gemv_sparse.cu MAX_KS)
_SPARSE_DT = {torch.float16: 0, torch.int8: 1, FP8_DTYPE: 2}  # gemv_sparse.cu WType of the stored values


def sparse_group(dtype: torch.dtype) -> int:
    """Outputs per block group of gemv_sparse: a lane's 16-byte load holds 16 codes or 8 halves."""
    return 256 if dtype.itemsize == 2 else 512


def sparse_plan(N: int, K: int, sms: int, blocks: int = 0, group: int = 512) -> tuple[int, int]:
    """(slices, inputs per slice) for gemv_sparse: about `blocks` blocks in all (default one per
    SM) over ceil(N / group) groups, slices of a multiple of 32 inputs."""
    groups = -(-N // group)
    want = max(1, round((blocks or sms) / groups))
    per = -(-K // want)  # inputs per slice for `want` slices
    ks = min(SPARSE_MAX_KS, -(-per // 32) * 32)
    return -(-K // ks), ks


def sparse_codes(w: Weight, blocks: int = 0, warps: int = 16) -> SparseCodes:
    """w (N, K) transposed (K, N), its codes or its fp16 values, and gemv_sparse's workspace, on
    w's device."""
    src = w.q if isinstance(w, QWeight) else w  # (N, K)
    N, K = src.shape
    dev = src.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    group = sparse_group(src.dtype)
    slices, ks = sparse_plan(N, K, sms, blocks, group)
    qt = src.t().contiguous()  # (K, N)
    part = torch.empty(slices, N, device=dev, dtype=torch.float32)  # (S, N)
    count = torch.zeros(-(-N // group), device=dev, dtype=torch.int32)  # (G,)
    return SparseCodes(qt, part, count, ks, warps)


def sparse_relu2(x: torch.Tensor, w: Weight, sp: SparseCodes) -> torch.Tensor | None:
    """relu(x)^2 @ w^T for one row x (1, K) fp16 through kernels/gemv_sparse.cu, reading only the
    rows of sp.qt (w transposed) of x's nonzero inputs; None where it does not run (switched off,
    another dtype or shape, no kernel library)."""
    if not SPARSE_VALUE or not x.is_cuda or x.dtype != torch.float16 or x.shape[0] != 1 or x.stride(-1) != 1:
        return None
    lib = _lib(x.device)
    w_dt = _SPARSE_DT.get(sp.qt.dtype)
    if lib is None or w_dt is None or sp.qt.device != x.device:
        return None
    K, N = sp.qt.shape
    scale = w.scale.data_ptr() if isinstance(w, QWeight) else 0
    out = torch.empty(1, N, device=x.device, dtype=x.dtype)  # (1, N)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.gemv_sparse(w_dt, N, K, x.data_ptr(), sp.qt.data_ptr(), scale, out.data_ptr(), sp.part.data_ptr(),
                         sp.count.data_ptr(), sp.part.shape[0], sp.ks, sp.warps, stream)  # fmt: skip
    if rc == UNSUPPORTED:
        return None
    if rc != 0:
        raise RuntimeError(f"gemv_sparse: CUDA kernel failed (code {rc})")
    return out
