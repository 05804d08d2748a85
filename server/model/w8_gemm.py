"""The GEMM of 8-bit weight codes past the gemv kernel's rows: out = x @ (q * scale)^T with x
(M, K) fp16/bf16 as it is and q (N, K) int8 or fp8 e4m3 codes converted to x's dtype in the
tiles (exact for both), fp32 accumulation, the per-row scales applied to the sums. P stacked
planes (x (P, M, K), q (P, N, K)) run in one launch. Pure-torch twin: qlinear.dense_native.
With fp8 codes, x may also be e4m3 rows with their scales ("fp8a8": the fp8 tensor cores, the
sums promoted to fp32 every PROMOTE k; twin: qlinear.dense_fp8_native). dequantize() is int8's
path past the TABLE's rows: the weight in the model dtype in one launch, for cuBLAS.

A Triton kernel (written once for both code types), because at decode batches the product is
bound by the weights' bytes, which neither cuBLAS (16-bit weights only) nor torch._scaled_mm (it
wants the activations in fp8 too, one more launch per projection and their rounding) reads as
8-bit: see docs/performance.md for the measurements that chose it and its tile shapes.

Shapes of a launch (W8Config): BM x BN output tiles; SWAP computes each tile transposed (the
weights as the MMA's row operand: a skinny batch then needs no 64-row padding); SPLIT > 1 cuts K
into SPLIT slices, one program each, whose fp32 partial tiles the last program of the tile to
finish sums in slice order (a per-tile arrival counter; the sum's order is fixed, so the result
does not depend on which program finishes last).

Over 300 lines because of TABLE, the measured tile shapes: data that belongs next to the kernel
whose parameters it holds.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from server.model.qlinear import QWeight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class W8Config:
    bm: int  # batch rows per tile
    bn: int  # output columns per tile
    bk: int  # k per step
    split: int = 1  # K slices (programs) per tile
    swap: bool = False  # tiles computed transposed (weights as the MMA's M side)
    warps: int = 4
    stages: int = 3


@functools.cache
def kernel():
    """The Triton kernel, compiled per configuration on first use; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["M"])
    def w8_mm(x, q, s, xs, out, part, cnt, M, N, K, sxm, sxp, sqp, ssp, sxsp, som, sop, n_tiles,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
              SWAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ACT: tl.constexpr,
              I8_MAGIC: tl.constexpr, XQ: tl.constexpr, PROMOTE: tl.constexpr):  # fmt: skip
        # program (tile n * SPLIT + slice, tile m, plane)
        pid, tm, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tn, sl = pid // SPLIT, pid % SPLIT
        x += p * sxp
        q += p * sqp
        s += p * ssp
        xs += p * sxsp
        out += p * sop
        rm = tm * BM + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        kc = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK  # k per slice, whole steps
        k_lo = sl * kc
        k_hi = tl.minimum(K, k_lo + kc)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + rk
            xm = rm[:, None] < M
            wm = rn[:, None] < N
            if not EVEN_K:
                xm = xm & (kk[None, :] < k_hi)
                wm = wm & (kk[None, :] < k_hi)
            a = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=xm, other=0.0)  # (BM, BK)
            if ACT:  # relu(x)^2, squared in fp32 and rounded once (as ops.relu_square)
                af = tl.maximum(a.to(tl.float32), 0.0)
                a = (af * af).to(a.dtype)
            if EVEN_N and EVEN_K:
                b = tl.load(q + rn[:, None] * K + kk[None, :])  # (BN, BK) codes
            else:
                b = tl.load(q + rn[:, None] * K + kk[None, :], mask=wm, other=0.0)
            if XQ:  # e4m3 x e4m3 on the fp8 tensor cores; PROMOTE: k per fp32 promotion
                if SWAP:
                    acc = tl.dot(b, tl.trans(a), acc, max_num_imprecise_acc=PROMOTE)  # (BN, BM)
                else:
                    acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)  # (BM, BN)
            else:
                if I8_MAGIC:  # int8 -> fp16 by bits: 0x6480 + q is the fp16 1152 + q (exact)
                    b = (b.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
                else:
                    b = b.to(a.dtype)  # int8 and e4m3 codes are exact in fp16 / bf16
                if SWAP:
                    acc += tl.dot(b, tl.trans(a))  # (BN, BM)
                else:
                    acc += tl.dot(a, tl.trans(b))  # (BM, BN)
        if SWAP:
            acc = tl.trans(acc)  # (BM, BN)
        om = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT > 1:
            # this slice's partial tile, then the tile's arrival count; the last program sums
            # the SPLIT partials in slice order and resets the count for the next launch
            tile = (p * tl.num_programs(1) + tm) * n_tiles + tn
            ti = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            base = part + tile * (SPLIT * BM * BN) + ti
            tl.store(base + sl * (BM * BN), acc)
            tl.debug_barrier()
            seen = tl.atomic_add(cnt + tile, 1, sem="acq_rel")
            if seen == SPLIT - 1:
                acc = tl.load(base, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT):
                    acc += tl.load(base + j * (BM * BN), cache_modifier=".cg")
                tl.store(cnt + tile, 0)
                if XQ:  # the rows' scales first, as qlinear.dense_fp8_native
                    acc = acc * tl.load(xs + rm, mask=rm < M, other=0.0)[:, None]
                sc = tl.load(s + rn, mask=rn < N, other=0.0)
                tl.store(out + rm[:, None] * som + rn[None, :], (acc * sc[None, :]).to(out.dtype.element_ty), mask=om)
        else:
            if XQ:
                acc = acc * tl.load(xs + rm, mask=rm < M, other=0.0)[:, None]
            sc = tl.load(s + rn, mask=rn < N, other=0.0)
            tl.store(out + rm[:, None] * som + rn[None, :], (acc * sc[None, :]).to(out.dtype.element_ty), mask=om)

    return w8_mm


@functools.cache
def _dequant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(q, s, out, n, K, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        c = tl.load(q + i, mask=m).to(tl.float32)
        tl.store(out + i, (c * tl.load(s + i // K, mask=m, other=0.0)).to(out.dtype.element_ty), mask=m)

    return dequant


def dequantize(w: QWeight) -> torch.Tensor:
    """w.dequantize() (q * scale computed in fp32, rounded once to the model dtype) in one launch
    that reads the codes once and writes the result once, for contiguous codes on a GPU; else
    w.dequantize() itself (also for a first call under CUDA-graph capture, where the kernel
    could not be compiled and loaded)."""
    if not w.q.is_cuda or not w.q.is_contiguous() or not w.scale.is_contiguous() or kernel() is None:
        return w.dequantize()
    n, K = w.q.numel(), w.q.shape[-1]
    key = (w.q.device, w.q.dtype, w.dtype, n % 16 == 0, K % 16 == 0)  # what Triton compiles for
    if key not in _dequant_ready and torch.cuda.is_current_stream_capturing():
        log.warning("w8_gemm: first dequantize for %s under CUDA-graph capture: torch ops run there", key)
        return w.dequantize()
    out = torch.empty(w.q.shape, device=w.q.device, dtype=w.dtype)  # (N, K) or (P, N, K)
    block = 4096
    _dequant_kernel()[(-(-n // block),)](w.q, w.scale, out, n, K, BLOCK=block)
    _dequant_ready.add(key)
    return out


_dequant_ready: set[tuple] = set()
"""The dequantize kernel's compiled variants (device, dtypes, the sizes' divisibility by 16, on
which Triton specializes: vector loads under the mask), loaded by an eager launch."""


INT8_MAGIC = True
"""int8 codes become fp16 by integer adds on their bits instead of conversion instructions (a
module switch for the benchmark's A/B)."""


def _c(bm: int, bn: int, bk: int, split: int = 1, swap: bool = False, warps: int = 4, stages: int = 4) -> W8Config:
    return W8Config(bm, bn, bk, split, swap, warps, stages)


# The fastest configuration per (mode, rows up to, product), from test/bench/bench_w8_gemm.py on
# the H200 (2.9B shapes; docs/performance.md); "fp8a8": x holds e4m3 codes, run(..., xs=scales).
# Products: "stack" = the r/k/v planes in one launch, "square" = N == K (output), "wide" = N > K
# (FFN key), "deep" = N < K (FFN value). None: this path is not the fastest there (fp8 takes
# torch._scaled_mm instead, int8 the weight dequantized, then cuBLAS). Rows past a mode's last
# bucket take the other path too.
TABLE: dict[str, tuple[tuple[int, dict[str, W8Config | None]], ...]] = {
    "fp8": (
        (16, {"stack": _c(16, 32, 256, 1, True), "square": _c(16, 32, 128, 4, True),
              "wide": _c(16, 128, 256), "deep": _c(16, 128, 256, 4)}),
        (32, {"stack": _c(32, 64, 128, 1, True, stages=6), "square": _c(32, 64, 256, 2, True),
              "wide": _c(32, 64, 128, 2), "deep": _c(32, 128, 128, 4)}),
        (64, {"stack": _c(64, 64, 256, 1, True), "square": _c(64, 64, 128, 2, True), "wide": None,
              "deep": _c(64, 32, 128, 4, True)}),
    ),
    # e4m3 activations (quantized per row first) on the fp8 tensor cores: fp8 past 64 rows, where
    # they beat torch._scaled_mm (the same codes); None: _scaled_mm measured faster. Past 128 rows
    # the r/k/v stack too: its planes as three _scaled_mm products on three streams
    # (cuda_quant.PLANE_STREAMS) beat these tiles there. Decode's square (output) and deep (FFN
    # value) products from 32 rows take cuda_quant.scaled_product instead; these tiles serve them
    # elsewhere (prefill chunks, the unfused decode)
    "fp8a8": (
        (128, {"stack": _c(64, 64, 128), "square": _c(64, 64, 128), "wide": None, "deep": _c(64, 64, 128, 2)}),
        (256, {"stack": None, "square": _c(64, 64, 128, 1, True, warps=8), "wide": None,
               "deep": _c(64, 64, 128, 2)}),
    ),
    "int8": (
        (16, {"stack": _c(16, 32, 256), "square": _c(16, 32, 128, 4), "wide": _c(16, 32, 128, 2),
              "deep": _c(16, 128, 256, 4, stages=6)}),
        (32, {"stack": _c(32, 64, 128, 2), "square": _c(32, 64, 128, 2), "wide": _c(32, 64, 128, 2),
              "deep": _c(32, 128, 128, 4)}),
        (64, {"stack": _c(64, 64, 128, 2, True), "square": _c(64, 64, 128, 2, True),
              "wide": _c(64, 128, 128, stages=6), "deep": _c(64, 64, 128, 4)}),
        (128, {"stack": _c(128, 64, 128, 1, True), "square": None,
               "wide": _c(128, 128, 128, 1, True, warps=8, stages=3), "deep": _c(128, 128, 128, 4, warps=8, stages=3)}),
        (256, {"stack": _c(128, 128, 128, 1, True, warps=8, stages=3), "square": None,
               "wide": _c(128, 64, 64, stages=3), "deep": None}),
    ),
}  # fmt: skip


def product(N: int, K: int, planes: int) -> str:
    """The TABLE's name for a product's shape."""
    return "stack" if planes > 1 else "square" if N == K else "wide" if N > K else "deep"


def pick(mode: str, M: int, N: int, K: int, planes: int) -> W8Config | None:
    """The configuration for M rows of this product, or None (not this path: rows past the
    table, or a mode / product whose other path is faster there)."""
    for most, row in TABLE.get(mode, ()):
        if most >= M:
            return row[product(N, K, planes)]
    return None


COUNTERS = 1 << 16
"""Arrival counters per device (int32, zero between launches): a launch of SPLIT > 1 needs one
per output tile. Launches on one device must not overlap in time (the server runs its 8-bit
products on one stream)."""
_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, made (zeroed) on the first call, which must be eager."""
    c = _counters.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w8_gemm: the first split-K launch on a device must be eager, not captured")
        c = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


def run(x: torch.Tensor, w: QWeight, act: bool = False, xs: torch.Tensor | None = None) -> torch.Tensor | None:
    """act(x) @ w^T through this path when the TABLE has it for x's rows, else None. xs: x holds
    e4m3 codes of rows with these scales ((M, 1) / (P, M, 1) fp32), the "fp8a8" rows of the TABLE.
    The first call for a product (shape, mode, act, dtype) compiles every configuration the TABLE
    holds for it, eagerly: later calls, CUDA-graph captures included, find them compiled."""
    P = x.shape[0] if x.dim() == 3 else 1
    M, K, N = x.shape[-2], x.shape[-1], w.shape[-2]
    mode = w.mode if xs is None else w.mode + "a8"
    if mode not in TABLE or kernel() is None or w.q.stride(-1) != 1 or w.q.stride(-2) != K:
        return None
    key = (x.device, mode, N, K, P, act, x.dtype)
    if key not in _warm:  # on the first call, whether or not its own rows take this path
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            log.warning("w8_gemm: first call for %s under CUDA-graph capture: the slower path runs there", key)
            return None
        for _, row in TABLE[mode]:
            c = row[product(N, K, P)]
            if c is not None:
                _usable[(key, c)] = _first_that_runs(x, w, (c, stand_in(c)), act, xs)
        _warm.add(key)
    cfg = pick(mode, M, N, K, P)
    cfg = None if cfg is None else _usable[(key, cfg)]
    if cfg is None or (cfg.split > 1 and P * -(-M // cfg.bm) * -(-N // cfg.bn) > COUNTERS):
        return None  # more tiles than arrival counters: only past ~100k rows
    return mm(x, w, cfg, act, xs)


_warm: set[tuple] = set()
"""Products whose configurations are compiled (run())."""
_usable: dict[tuple, W8Config | None] = {}
"""(product, TABLE configuration) -> what runs in its place on this GPU (itself, its stand-in,
or None: the other path)."""


def stand_in(cfg: W8Config) -> W8Config:
    """Small tiles (~30 KB of shared memory at 3 stages) for a TABLE shape that does not fit a
    GPU with less shared memory than the H200 the TABLE was measured on."""
    return W8Config(min(cfg.bm, 64), 32, 64)


def _first_that_runs(
    x: torch.Tensor, w: QWeight, cfgs: tuple[W8Config, ...], act: bool, xs: torch.Tensor | None
) -> W8Config | None:
    """The first of cfgs that compiles and runs on a tile of x's rows (its strides and alignment
    specialize the kernel as the later calls' will); the failures are logged."""
    for cfg in cfgs:
        try:
            mm(x[..., : cfg.bm, :], w, cfg, act, None if xs is None else xs[..., : cfg.bm, :])
            return cfg
        except Exception as e:  # Triton's OutOfResources and compile errors alike
            log.warning("w8_gemm: %s does not run on this GPU (%s: %s)", cfg, type(e).__name__, str(e)[:200])
    return None


PROMOTE = 128
"""fp8a8: k of e4m3 products that the tensor cores sum in their own (narrower than fp32)
accumulator before the kernel adds them to its fp32 sum, as cuBLASLt's default (not "fast
accumulation") fp8 GEMM does (docs/performance.md: fast accumulation failed the quality bound)."""


def mm(x: torch.Tensor, w: QWeight, cfg: W8Config, act: bool = False, xs: torch.Tensor | None = None) -> torch.Tensor:
    """act(x) (M, K) / (P, M, K) fp16 or bf16 @ w (N, K) / (P, N, K) -> (M, N) / (P, M, N) in x's
    dtype, one launch of configuration cfg. x rows may be strided (unit column stride). act:
    relu(x)^2 as x is read (x itself is left as it is). xs: x holds e4m3 codes (fp8 weights only)
    of rows with scales xs (M, 1) / (P, M, 1) fp32, and the product comes out in w.dtype."""
    kern = kernel()
    if kern is None:
        raise RuntimeError("w8_gemm needs Triton")
    P = x.shape[0] if x.dim() == 3 else 1
    M, K = x.shape[-2], x.shape[-1]
    N = w.shape[-2]
    if xs is not None and (w.mode != "fp8" or act or xs.shape != (*x.shape[:-1], 1)):
        raise ValueError("w8_gemm: e4m3 rows need fp8 weights, no act and one scale per row")
    if x.stride(-1) != 1:
        x = x.contiguous()
    xs = None if xs is None else xs.contiguous()
    out = torch.empty(
        *x.shape[:-1], N, device=x.device, dtype=x.dtype if xs is None else w.dtype
    )  # (M, N) or (P, M, N)
    n_tiles, m_tiles = -(-N // cfg.bn), -(-M // cfg.bm)
    part, cnt = out, out  # unused unless split
    if cfg.split > 1:
        cnt = counters(x.device)
        if P * m_tiles * n_tiles > cnt.numel():
            raise ValueError(f"w8_gemm: {P * m_tiles * n_tiles} tiles for {cnt.numel()} counters")
        part = torch.empty(P * m_tiles * n_tiles * cfg.split * cfg.bm * cfg.bn, device=x.device,
                           dtype=torch.float32)  # fmt: skip
    sxp = x.stride(0) if x.dim() == 3 else 0
    sqp = w.q.stride(0) if w.q.dim() == 3 else 0
    ssp = w.scale.stride(0) if w.scale.dim() == 2 else 0
    sxsp = xs.stride(0) if xs is not None and xs.dim() == 3 else 0
    sop = out.stride(0) if out.dim() == 3 else 0
    even_k = K % (cfg.bk * cfg.split) == 0
    magic = INT8_MAGIC and w.mode == "int8" and x.dtype == torch.float16
    grid = (n_tiles * cfg.split, m_tiles, P)
    kern[grid](x, w.q, w.scale, w.scale if xs is None else xs, out, part, cnt, M, N, K, x.stride(-2), sxp, sqp, ssp,
               sxsp, out.stride(-2), sop, n_tiles, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, SWAP=cfg.swap,
               EVEN_K=even_k, EVEN_N=N % cfg.bn == 0, ACT=act, I8_MAGIC=magic, XQ=xs is not None,
               PROMOTE=min(PROMOTE, cfg.bk), num_warps=cfg.warps, num_stages=cfg.stages)  # fmt: skip
    return out
