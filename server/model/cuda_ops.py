"""CUDA twins of server.model.ops (same names, signatures and semantics; see that module's doc).

    wkv_decode(state, r, w, k, v, a, b) -> y      state (B, H, N, N) in place; r..b (B, H, N)
    wkv_chunk(state, r, w, k, v, a, b) -> y       r..b (B, T, H, N); y (B, T, H, N)

Extras (keyword-only, not in the pure-torch signature):
    slots:   int tensor (B,) — sequence i uses state[slots[i]] (state is then the whole pool)
    lengths: int tensor (B,) — wkv_chunk only: tokens t >= lengths[i] are skipped (state
             untouched by them; y there is unspecified: 0 from the kernel)
Under CUDA-graph capture pass slots/lengths as device tensors (a list would need a host copy).

The kernels come from `kernels.loader` (built at first use, never at import). `available()`
says whether they can be used for a device; when they cannot (or for a layout or dtype they do
not cover: state dtype other than fp32/fp16, head size other than the build's) the functions
fall back to the pure-torch ops, so callers never need two code paths.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from server.model import cuda_quant, ops, wkv_chunked
from server.model.qlinear import RAW_UNIT, QRows, QWeight, ScaledProduct, SparseCodes, Weight
from server.model.quant import FP8_DTYPE

IDENTITY_W = ops.IDENTITY_W
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATE_DT = (torch.float32, torch.float16)


def _lib(device: torch.device | None, head_size: int = 64, cache_root: str | Path | None = None):
    from kernels import loader  # deferred: importing this module must not build anything

    return loader.load(device, head_size, cache_root)


def available(device: torch.device | str | None = None, head_size: int = 64,
              cache_root: str | Path | None = None) -> bool:  # fmt: skip
    """True when the CUDA kernels can run on this device for this head size (builds them under
    cache_root, default kernels.loader.DEFAULT_CACHE_ROOT, on the first call)."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return dev.type == "cuda" and _lib(dev, head_size, cache_root) is not None


def _aligned(x: torch.Tensor, outer: int) -> torch.Tensor:
    """x with its last two dims (H, N) contiguous and 16-byte aligned rows (a copy if needed)."""
    N = x.shape[-1]
    es = x.element_size()
    ok = x.stride(-1) == 1 and x.stride(-2) == N and x.data_ptr() % 16 == 0
    ok = ok and all((x.stride(d) * es) % 16 == 0 for d in range(outer))
    if ok:
        return x
    y = x.contiguous()
    return y.clone() if y.data_ptr() % 16 else y


def _usable(state: torch.Tensor, r: torch.Tensor) -> bool:
    if not (state.is_cuda and state.dtype in _STATE_DT and r.dtype in _DT):
        return False
    N = state.shape[-1]
    inner = state.stride(-1) == 1 and state.stride(-2) == N and state.stride(1) == N * N
    return inner and state.data_ptr() % 16 == 0 and (state.stride(0) * state.element_size()) % 16 == 0


def _slots_arg(slots, device) -> tuple[int, torch.Tensor | None]:
    if slots is None:
        return 0, None
    s = torch.as_tensor(slots, device=device, dtype=torch.int32)
    return s.data_ptr(), s


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name}: CUDA kernel failed (code {rc})")


def wkv_decode(state, r, w, k, v, a, b, *, slots=None) -> torch.Tensor:
    """One token for B sequences; state (B, H, N, N) (or the pool, with slots) updated in place."""
    B, H, N = r.shape
    lib = _lib(r.device, N) if r.is_cuda else None
    if lib is None or not _usable(state, r):
        return _fallback(ops.wkv_decode, state, (r, w, k, v, a, b), slots)
    acts = [_aligned(t, 1) for t in (r, w, k, v, a, b)]  # each (B, H, N)
    rr, ww = acts[0], acts[1]
    if len({t.stride(0) for t in acts if t is not ww}) != 1:
        acts = [t.contiguous() for t in acts]
        rr, ww = acts[0], acts[1]
    y = torch.empty(B, H, N, device=r.device, dtype=r.dtype)  # (B, H, N)
    sp, _keep = _slots_arg(slots, r.device)  # _keep: the int32 copy stays alive until the launch
    stream = torch.cuda.current_stream(r.device).cuda_stream
    rc = lib.wkv7_decode(
        _DT[r.dtype], _DT[state.dtype], 1, state.data_ptr(), state.stride(0), sp, B, H,
        *[t.data_ptr() for t in acts], rr.stride(0), ww.stride(0), y.data_ptr(), y.stride(0), stream,
    )  # fmt: skip
    _check(rc, "wkv7_decode")
    return y


BLOCKS_MIN_T: int | None = None
"""Chunk length from which wkv_chunk runs the blocked kernels (kernels/wkv7_blocks.cu: every
block of 32 tokens prepared at once, then one state step per block) instead of the token-by-token
kernel (docs/performance.md, "The prefill's WKV by blocks"). None: never. They stay off until
their GPU tests (test/test_kernels_blocks_gpu.py) have passed on a device, and the measured
threshold goes here; benchmarks and tests set it."""


def wkv_chunk(state, r, w, k, v, a, b, *, slots=None, lengths=None) -> torch.Tensor:
    """T tokens for B sequences; state updated in place; returns y (B, T, H, N) in r.dtype."""
    B, T, H, N = r.shape
    lib = _lib(r.device, N) if r.is_cuda else None
    if lib is None or not _usable(state, r):
        return _fallback(ops.wkv_chunk, state, (r, w, k, v, a, b), slots, lengths)
    acts = [_aligned(t, 2) for t in (r, w, k, v, a, b)]  # each (B, T, H, N)
    rr, ww = acts[0], acts[1]
    if len({(t.stride(0), t.stride(1)) for t in acts if t is not ww}) != 1:
        acts = [t.contiguous() for t in acts]
        rr, ww = acts[0], acts[1]
    alloc = torch.empty if lengths is None else torch.zeros  # skipped tokens: y = 0, not garbage
    y = alloc(B, T, H, N, device=r.device, dtype=r.dtype)  # (B, T, H, N)
    sp, _keep = _slots_arg(slots, r.device)  # _keep: the int32 copy stays alive until the launch
    lp, _keep_l = _slots_arg(lengths, r.device)
    stream = torch.cuda.current_stream(r.device).cuda_stream
    args = (
        _DT[r.dtype], _DT[state.dtype], 1, state.data_ptr(), state.stride(0), sp, lp, B, T, H,
        *[t.data_ptr() for t in acts], rr.stride(0), rr.stride(1), ww.stride(0), ww.stride(1),
        y.data_ptr(), y.stride(0), y.stride(1),
    )  # fmt: skip
    rec = _block_record(lib, N) if BLOCKS_MIN_T is not None and T >= BLOCKS_MIN_T else -1
    if rec > 0:
        nb = -(-T // wkv_chunked.BLOCK)  # the kernels' block length (L in wkv7_blocks.cu)
        work = torch.empty(B * H * nb * rec, device=r.device, dtype=torch.float32)  # one record per block
        _check(lib.wkv7_blocks(*args, work.data_ptr(), stream), "wkv7_blocks")
    else:
        _check(lib.wkv7_chunk(*args, stream), "wkv7_chunk")
    return y


@functools.cache
def _block_record(lib, head_size: int) -> int:
    """Floats of one block's record in the blocked kernels' work buffer; -1: not this head size."""
    return int(lib.wkv7_blocks_record(head_size))


def _fallback(fn, state, acts, slots, lengths=None) -> torch.Tensor:
    """The pure-torch op, with slots (gather/scatter) and lengths (identity padding) applied."""
    if lengths is not None:
        acts = _mask_lengths(acts, lengths)
    if slots is None:
        return fn(state, *acts)
    idx = torch.as_tensor(slots, device=state.device, dtype=torch.long)
    sub = state.index_select(0, idx)  # (B, H, N, N) copy
    y = fn(sub, *acts)
    state.index_copy_(0, idx, sub)
    return y


def _mask_lengths(acts, lengths):
    """Turn tokens t >= lengths[b] into identity steps (w = IDENTITY_W, k = b = 0)."""
    r, w, k, v, a, b = acts
    T = r.shape[1]
    lens = torch.as_tensor(lengths, device=r.device).view(-1, 1, 1, 1)
    pad = torch.arange(T, device=r.device).view(1, T, 1, 1) >= lens  # (B, T, 1, 1)
    w = w.masked_fill(pad, IDENTITY_W)
    k, b = k.masked_fill(pad, 0), b.masked_fill(pad, 0)
    return r, w, k, v, a, b


# ---- time-mix core for decode (kernels/wkv7_tmix_fused.cu) -----------------------------------
TMIX_PIPE_MIN_B = 64
"""Batch from which a 16-bit-state time-mix runs the pipelined kernel (kernels/wkv7_tmix_pipe.cu:
persistent blocks that bulk-copy the next heads' state while computing); smaller batches and an
fp32 state run a head per block. A launch argument, so the tests can route either kernel."""
TMIX_PIPE_PER_SM: int | None = None
"""Resident blocks per SM of the pipelined kernel (its grid is one wave of them): 0 = as many as fit
(6 for the fp16 state), None = this GPU's entry in TMIX_PIPE_PER_SM_BY_GPU (else 0). A launch
argument, so a benchmark can compare caps in one process."""
TMIX_PIPE_PER_SM_BY_GPU = {"H100 80GB HBM3": 4}
"""Caps measured faster than a full wave, by a substring of the device name (docs/performance.md,
"The time-mix's blocks per SM"): fewer resident blocks read the state faster on the H100 SXM. On
the H200 no cap measured faster than the full wave."""


@functools.cache
def _gpu_per_sm(index: int) -> int:
    name = torch.cuda.get_device_name(index)
    return next((cap for key, cap in TMIX_PIPE_PER_SM_BY_GPU.items() if key in name), 0)


def tmix_pipe_per_sm(device: torch.device) -> int:
    """The pipelined time-mix's blocks-per-SM cap on `device` (TMIX_PIPE_PER_SM, or its GPU's)."""
    if TMIX_PIPE_PER_SM is not None:
        return TMIX_PIPE_PER_SM
    return _gpu_per_sm(device.index if device.index is not None else torch.cuda.current_device())


def tmix_decode(state, r, k, v, wz, az, vz, v_first, g, lw, layer0: bool, gn_eps: float = 64e-5,
                bias: bool = False):  # fmt: skip
    """One launch for the whole decode time-mix core (ops.tmix_decode is the pure-torch twin).
    In layer 0 vz and v_first are not read (pass None). bias=True: wz, az, vz lack w0, a0, v0
    (the kernel adds them: no separate bias add or addmm bias copy). Shapes the kernel does not
    cover (head sizes over 64, more than 65535 rows) run the twin."""
    B, C = r.shape
    H, N = state.shape[1], state.shape[-1]
    lib = _lib(r.device, N) if r.is_cuda else None
    acts = [r, k, v, wz, az, vz if vz is not None else r, v_first if v_first is not None else r, g]
    if lib is None or not _usable(state, r) or any(t.stride() != (C, 1) or t.dtype != r.dtype for t in acts):
        return ops.tmix_decode(state, r, k, v, wz, az, vz, v_first, g, lw, layer0, gn_eps, bias)
    params = [lw.k_k, lw.k_a, lw.r_k, lw.lnx_w, lw.lnx_b]
    if bias:
        params += [lw.w0, lw.a0, lw.v0 if not layer0 else lw.w0]
    params = [t if t.dtype == r.dtype and t.is_contiguous() else t.to(r.dtype).contiguous() for t in params]
    params, keep = params[:5], params[5:]  # keep: the bias tensors stay alive until the launch
    biases = [t.data_ptr() for t in keep] if bias else [0, 0, 0]
    if layer0:
        biases[2] = 0  # no v0 in layer 0
    out = torch.empty(B, C, device=r.device, dtype=r.dtype)  # (B, C)
    stream = torch.cuda.current_stream(r.device).cuda_stream
    rc = lib.wkv7_tmix_fused(
        _DT[r.dtype], _DT[state.dtype], TMIX_PIPE_MIN_B, tmix_pipe_per_sm(r.device), state.data_ptr(),
        state.stride(0), B, H,
        *[t.data_ptr() for t in acts], C, *[t.data_ptr() for t in params],
        int(layer0), float(gn_eps), out.data_ptr(), C, *biases, stream,
    )  # fmt: skip
    if rc == -2:  # a shape the kernel does not cover (nothing was launched)
        return ops.tmix_decode(state, r, k, v, wz, az, vz, v_first, g, lw, layer0, gn_eps, bias)
    _check(rc, "wkv7_tmix_fused")
    return out


# ---- fused elementwise ops of the decode step (kernels/fused_elementwise.cu) -----------------
LN_MAX_C = 16384


def _rows_ok(t: torch.Tensor, dtype, C: int) -> bool:
    """(B, C) rows in dtype, unit column stride, rows aligned for 4-element vector accesses."""
    al = 4 * t.element_size()
    return (t.is_cuda and t.dtype == dtype and t.dim() == 2 and t.shape[-1] == C and t.stride(-1) == 1
            and t.data_ptr() % al == 0 and (t.stride(0) % 4 == 0 or t.shape[0] == 1))  # fmt: skip


def add_ln_mix(x, dx: torch.Tensor | ScaledProduct | None, ln_w, ln_b, mix, shift, eps: float = 1e-5):
    """One launch for residual add + LayerNorm + token-shift mixes + shift write (see
    ops.add_ln_mix, the pure-torch twin); a ScaledProduct dx is scaled in the kernel."""
    B, C = x.shape
    lib = _lib(x.device) if x.is_cuda else None
    scales = _ln_scales(lib, x, dx, ln_w, ln_b, mix, shift)
    if lib is None or scales is None:
        return ops.add_ln_mix(x, dx, ln_w, ln_b, mix, shift, eps)
    raw = dx.raw if isinstance(dx, ScaledProduct) else dx
    K = 0 if mix is None else mix.shape[0]
    out = torch.empty(*((K,) if K else ()), B, C, device=x.device, dtype=x.dtype)  # (K, B, C) or (B, C)
    x_out = torch.empty(B, C, device=x.device, dtype=x.dtype) if raw is not None else x  # (B, C)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _check(lib.fused_add_ln_mix(
        _DT[x.dtype], B, C, x.data_ptr(), x.stride(0), raw.data_ptr() if raw is not None else 0,
        raw.stride(0) if raw is not None else 0, ln_w.data_ptr(), ln_b.data_ptr(), float(eps),
        shift.data_ptr() if shift is not None else 0, shift.stride(0) if shift is not None else 0,
        mix.data_ptr() if mix is not None else 0, K, x_out.data_ptr(), C, out.data_ptr(), C, B * C, *scales, stream,
    ), "fused_add_ln_mix")  # fmt: skip
    return x_out, out


def add_ln_mix_q(x, dx: torch.Tensor | ScaledProduct | None, ln_w, ln_b, mix, shift, nq: int, keep: int,
                 eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, QRows]:  # fmt: skip
    """ops.add_ln_mix_q in one launch (kernels/fused_elementwise.cu, fused_add_ln_mix_q: the codes
    and scales quant_rows makes from those planes, bit for bit) where the kernel covers it: 16-bit
    x, (K, nq) = (6, 3) or (1, 1); else add_ln_mix, then quant_rows."""
    B, C = x.shape
    lib = _lib(x.device) if x.is_cuda else None
    scales = _ln_scales(lib, x, dx, ln_w, ln_b, mix, shift)
    if lib is not None and scales is not None and mix is not None and shift is not None and x.dtype in _DT:
        K = mix.shape[0]
        raw = dx.raw if isinstance(dx, ScaledProduct) else dx
        out = torch.empty(keep, B, C, device=x.device, dtype=x.dtype)  # (keep, B, C)
        x_out = torch.empty(B, C, device=x.device, dtype=x.dtype) if raw is not None else x  # (B, C)
        q = torch.empty(nq, B, C, device=x.device, dtype=FP8_DTYPE)  # (nq, B, C)
        sq = torch.empty(nq, B, 1, device=x.device, dtype=torch.float32)  # (nq, B, 1)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        rc = lib.fused_add_ln_mix_q(
            _DT[x.dtype], B, C, x.data_ptr(), x.stride(0), raw.data_ptr() if raw is not None else 0,
            raw.stride(0) if raw is not None else 0, ln_w.data_ptr(), ln_b.data_ptr(), float(eps),
            shift.data_ptr(), shift.stride(0), mix.data_ptr(), K, nq, keep, x_out.data_ptr(), C,
            out.data_ptr(), C, B * C, q.data_ptr(), C, B * C, sq.data_ptr(), *scales, stream,
        )  # fmt: skip
        if rc != GEMV_UNSUPPORTED:
            _check(rc, "fused_add_ln_mix_q")
            return x_out, out, QRows(q, sq)
    x, out = add_ln_mix(x, dx, ln_w, ln_b, mix, shift, eps)  # (K, B, C)
    q, sq = cuda_quant.quant_rows(out[out.shape[0] - nq :].reshape(-1, C))  # (nq * B, C), (nq * B, 1)
    return x, out[:keep], QRows(q.view(nq, B, C), sq.view(nq, B, 1))


def _ln_scales(lib, x, dx, ln_w, ln_b, mix, shift) -> tuple[int, int, float] | None:
    """The kernel's (dx_rs, dx_cs, dx_mul) when add_ln_mix's kernel takes these tensors (dtype,
    layouts, sizes), else None: the pure-torch twin runs."""
    B, C = x.shape
    dt = x.dtype
    raw = dx.raw if isinstance(dx, ScaledProduct) else dx
    ok = lib is not None and dt in _DT and C % 4 == 0 and C <= LN_MAX_C and _rows_ok(x, dt, C)
    ok = ok and (raw is None or _rows_ok(raw, dt, C)) and (shift is None or _rows_ok(shift, dt, C))
    ok = ok and all(t.dtype == dt and t.is_contiguous() and t.numel() == C for t in (ln_w, ln_b))
    ok = ok and (mix is None or (mix.dtype == dt and mix.is_contiguous() and mix.dim() == 2 and mix.shape[1] == C))
    if not ok or (mix is not None and shift is None):
        return None
    return _dx_scales(dx, B, C) if isinstance(dx, ScaledProduct) else (0, 0, 0.0)


def quantizes_rows(w: Weight, rows: int) -> bool:
    """ops.quantizes_rows: true where linear() of `rows` 16-bit rows with w would quantize them
    to e4m3 itself (an fp8 w past the gemv's and the weight-only tiles' rows)."""
    return rows > GEMV_MAX_M and cuda_quant.takes_rows(w, rows, w.dtype)


def linear_q(x: QRows, w: QWeight) -> torch.Tensor:
    """ops.linear_q on the fp8 tensor cores (cuda_quant.large_q); x's rows as linear() would
    have quantized them."""
    return cuda_quant.large_q(x.q, x.scale, w)


def _dx_scales(dx: ScaledProduct, B: int, C: int) -> tuple[int, int, float] | None:
    """The kernel's (dx_rs, dx_cs, dx_mul) for a ScaledProduct; None when its scales are not the
    contiguous fp32 (B, 1) rows and (C,) columns on the kernel's device."""
    for t, n in ((dx.row, B), (dx.col, C)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device != dx.raw.device:
            return None
    return dx.row.data_ptr(), dx.col.data_ptr(), 1.0 / RAW_UNIT


def relu_square(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2 in place on h (contiguous, CUDA); returns h."""
    lib = _lib(h.device) if h.is_cuda else None
    if lib is None or h.dtype not in _DT or not h.is_contiguous() or h.data_ptr() % (4 * h.element_size()):
        return ops.relu_square(h)
    stream = torch.cuda.current_stream(h.device).cuda_stream
    _check(lib.fused_relu_square(_DT[h.dtype], h.data_ptr(), h.numel(), stream), "fused_relu_square")
    return h


def lora_act(hw: torch.Tensor, hg: torch.Tensor):
    """(tanh(hw), sigmoid(hg)) in place, one launch; returns (hw, hg)."""
    lib = _lib(hw.device) if hw.is_cuda else None
    if lib is None or hw.dtype not in _DT or hg.dtype != hw.dtype or not (hw.is_contiguous() and hg.is_contiguous()):
        return ops.lora_act(hw, hg)
    stream = torch.cuda.current_stream(hw.device).cuda_stream
    _check(lib.fused_lora_act(_DT[hw.dtype], hw.data_ptr(), hw.numel(), hg.data_ptr(), hg.numel(), stream),
           "fused_lora_act")  # fmt: skip
    return hw, hg


# ---- projections (x @ w^T, plain or stacked) -------------------------------------------------
GEMV_MAX_M = 8
"""Up to this many rows (batch) the projections run kernels/gemv.cu (tensor-core matrix-vector,
weights streamed once); larger M goes to cuBLAS (ops.linear)."""
GEMV_UNSUPPORTED = -2  # gemv's return code for a layout it does not cover (nothing launched)
_GEMV_DT = {torch.float16: 1, torch.bfloat16: 2}
_GEMV_WDT = {"int8": 1, "fp8": 2}  # gemv.cu WType of a QWeight's codes
_LIM_ROWS, _LIM_COLS = 1, 2  # gemv.cu LimKind


def linear(x: torch.Tensor, w: Weight, *, rows=None, cols=None, warps: int = 0, cfg: int = 0) -> torch.Tensor:
    """ops.linear (see there): x (M, K), w (N, K) -> (M, N); stacked x (P, M, K), w (P, N, K) ->
    (P, M, N). CUDA fp16/bf16 with M <= GEMV_MAX_M: one gemv launch (x may be a strided view:
    rows stride(-2) apart, unit column stride; weight rows contiguous); anything else, or a
    layout the kernel refuses (K % 8, 16-byte alignment), falls back to ops.linear (cuBLAS).
    rows / cols (ops.linear's zero-padding hints): the gemv does not read plane p's weight rows
    from rows[p] on (their outputs are 0) or its columns from cols[p] on (planes 0..7).
    warps / cfg: kernel tuning overrides (0 = automatic), for the benchmark. A QWeight w (8-bit
    codes, fp16 x) runs the gemv's 8-bit path, or server.model.cuda_quant past GEMV_MAX_M."""
    hint = rows is not None or cols is not None
    lim = _gemv_lim(rows and tuple(rows), cols and tuple(cols)) if hint else (0, 0)
    return _linear(x, w, warps, cfg, 0, lim)


@functools.lru_cache(maxsize=256)
def _gemv_lim(rows, cols) -> tuple[int, int]:
    """(lim, lim_kind) for gemv.cu: per-plane widths rounded up to 8 (reading a few zeros more
    is harmless), 8 bits of width / 8 per plane for planes 0..7; 0 = read the plane whole."""
    if rows is not None and cols is not None:
        raise ValueError("linear: give rows or cols, not both")
    widths, kind = (rows, _LIM_ROWS) if rows is not None else (cols, _LIM_COLS)
    if widths is None:
        return 0, 0
    lim = 0
    for p, width in enumerate(widths[:8]):
        units = -(-int(width) // 8)
        lim |= (units if 0 < units <= 255 else 0) << (8 * p)
    return (lim - (1 << 64) if lim >= 1 << 63 else lim), kind  # as a signed long long


def relu2_linear(h: torch.Tensor, w: Weight, wt: SparseCodes | None = None) -> torch.Tensor:
    """ops.relu2_linear: linear(relu_square(h), w). One row with w's transposed copy wt:
    cuda_quant.sparse_relu2 (reads only the nonzero inputs' weights). At M <= GEMV_MAX_M one gemv
    launch that squares as it loads (h is left as it is); otherwise relu_square in place on h,
    then linear."""
    if wt is not None and h.dim() == 2 and h.shape[0] == 1:
        y = cuda_quant.sparse_relu2(h, w, wt)
        if y is not None:
            return y
    return _linear(h, w, 0, 0, 1, (0, 0))


def residual_linear(x: torch.Tensor, w: Weight, wt: SparseCodes | None = None,
                    act: bool = False) -> torch.Tensor | ScaledProduct:  # fmt: skip
    """ops.residual_linear: an fp8 weight's product past the gemv's rows as a ScaledProduct
    (cuda_quant.scaled_product), where that applies; else relu2_linear / linear."""
    if isinstance(w, QWeight) and x.dim() == 2 and x.shape[0] > GEMV_MAX_M:
        y = cuda_quant.scaled_product(x, w, act)
        if y is not None:
            return y
    return relu2_linear(x, w, wt) if act else linear(x, w)


def dense(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """ops.dense: x (..., K) @ w^T for a 2-D weight. A QWeight takes the 8-bit paths (the gemv
    at <= GEMV_MAX_M rows, server.model.cuda_quant past it); a 16-bit weight F.linear."""
    if not isinstance(w, QWeight) or not x.is_cuda:
        return ops.dense(x, w)
    y = _linear(x.reshape(-1, x.shape[-1]), w, 0, 0, 0, (0, 0))  # (rows, N)
    return y.view(*x.shape[:-1], y.shape[-1])


def _linear(x: torch.Tensor, w: Weight, warps: int, cfg: int, act: int, lim: tuple[int, int]):
    M = x.shape[-2] if x.dim() >= 2 else 0
    q = isinstance(w, QWeight)
    wt = w.q if isinstance(w, QWeight) else w  # what the kernel reads: codes or 16-bit weights
    if isinstance(w, QWeight):
        fallback = lambda: cuda_quant.large(x, w, bool(act))
    else:
        fallback = (lambda: ops.linear(relu_square(x), w)) if act else (lambda: ops.linear(x, w))
    lib = _lib(x.device) if x.is_cuda and 1 <= M <= GEMV_MAX_M else None
    ok = lib is not None and x.dtype in _GEMV_DT and wt.device == x.device
    ok = ok and (x.dtype == torch.float16 if q else wt.dtype == x.dtype)
    ok = ok and x.dim() == wt.dim() and x.dim() in (2, 3) and x.shape[-1] == wt.shape[-1]
    ok = ok and (x.dim() == 2 or x.shape[0] == wt.shape[0])
    ok = ok and x.stride(-1) == 1 and wt.stride(-1) == 1 and wt.stride(-2) == wt.shape[-1]
    if lib is None or not ok:
        return fallback()
    K, N = x.shape[-1], wt.shape[-2]
    P = x.shape[0] if x.dim() == 3 else 1
    x_ps = x.stride(0) if x.dim() == 3 else 0
    w_ps = wt.stride(0) if wt.dim() == 3 else 0
    w_dt, sp, s_ps = 0, 0, 0
    if isinstance(w, QWeight):
        w_dt, sp = _GEMV_WDT[w.mode], w.scale.data_ptr()
        s_ps = w.scale.stride(0) if w.scale.dim() == 2 else 0
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)  # (M, N) or (P, M, N)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.gemv(_GEMV_DT[x.dtype], w_dt, M, N, K, P, x.data_ptr(), x.stride(-2), x_ps, wt.data_ptr(), w_ps,
                  sp, s_ps, out.data_ptr(), N, M * N, warps, cfg, act, *lim, stream)  # fmt: skip
    if rc == GEMV_UNSUPPORTED:
        return fallback()
    _check(rc, "gemv")
    return out
