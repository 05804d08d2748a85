"""CUDA twins of the prefill time-mix's elementwise ops (server.model.ops.token_mix, tmix_prep,
tmix_post; kernels/prefill_elementwise.cu): one launch each where torch runs 4 to 14 kernels,
each writing a full (tokens, C) tensor. Layouts or dtypes the kernels do not take fall back to
the pure-torch twin, as in server.model.cuda_ops."""

from __future__ import annotations

import torch

from server.model import ops
from server.model.cuda_ops import _DT, _check, _lib

SELECTED = False
"""Whether server.model.rwkv7.select_ops picks these twins on CUDA. Off: the kernels were written
in a session that got no GPU, and their parity tests (test/test_kernels_prefill_gpu.py) have not
run yet; the first session that passes them there switches this on (docs/performance.md, "The
prefill's elementwise ops")."""


def _flat(t: torch.Tensor) -> bool:
    """Contiguous, 16-byte aligned, in an activation dtype the kernels take."""
    return t.is_cuda and t.dtype in _DT and t.is_contiguous() and t.data_ptr() % 16 == 0


def _consts(dtype, *ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.is_cuda and t.dtype == dtype and t.is_contiguous()) for t in ts)


def token_mix(x: torch.Tensor, shift: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """ops.token_mix in one launch: x (B, T, C), shift (B, C), mix (K, C) -> (K, B, T, C)."""
    B, T, C = x.shape
    lib = _lib(x.device) if x.is_cuda else None
    shift = shift.to(x.dtype)
    al = 4 * x.element_size()
    ok = lib is not None and _flat(x) and C % 4 == 0 and _consts(x.dtype, mix) and mix.dim() == 2
    ok = ok and shift.is_cuda and shift.stride(-1) == 1 and shift.data_ptr() % al == 0 and shift.stride(0) % 4 == 0
    if lib is None or not ok:
        return ops.token_mix(x, shift, mix)
    K = mix.shape[0]
    out = torch.empty(K, B, T, C, device=x.device, dtype=x.dtype)  # (K, B, T, C)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _check(lib.prefill_token_mix(_DT[x.dtype], B, T, C, x.data_ptr(), shift.data_ptr(), shift.stride(0),
                                 mix.data_ptr(), K, out.data_ptr(), stream), "prefill_token_mix")  # fmt: skip
    return out


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def tmix_prep(k, v, wz, az, vz, v_first, lw, H: int, bias: bool = True):
    """ops.tmix_prep in one launch (the biases added inside: bias); writes w, k', v', a over wz,
    k, v, az (returned as those)."""
    C = k.shape[-1]
    lib = _lib(k.device, C // H) if k.is_cuda and C % H == 0 else None
    acts = [t for t in (k, v, wz, az, vz, v_first) if t is not None]
    consts = (lw.w0, lw.a0, lw.k_k, lw.k_a, lw.k_a1, lw.v0 if vz is not None else None)
    ok = lib is not None and all(_flat(t) and t.dtype == k.dtype and t.shape == k.shape for t in acts)
    ok = ok and (vz is None) == (v_first is None) and _consts(k.dtype, *consts)
    if lib is None or not ok or not bias:
        return ops.tmix_prep(k, v, wz, az, vz, v_first, lw, H, bias)
    b = torch.empty_like(k)
    stream = torch.cuda.current_stream(k.device).cuda_stream
    _check(lib.prefill_tmix_prep(
        _DT[k.dtype], k.numel() // C, H, k.data_ptr(), v.data_ptr(), wz.data_ptr(), az.data_ptr(), _ptr(vz),
        _ptr(v_first), lw.w0.data_ptr(), lw.a0.data_ptr(), _ptr(lw.v0 if vz is not None else None),
        lw.k_k.data_ptr(), lw.k_a.data_ptr(), lw.k_a1.data_ptr(), b.data_ptr(), stream,
    ), "prefill_tmix_prep")  # fmt: skip
    return wz, k, v, az, b


def tmix_post(y, r, k, v, g, lw, H: int, eps: float = 64e-5) -> torch.Tensor:
    """ops.tmix_post in one launch."""
    C = r.shape[-1]
    lib = _lib(r.device, C // H) if r.is_cuda and C % H == 0 else None
    y = y.reshape(r.shape)
    ok = lib is not None and all(_flat(t) and t.dtype == r.dtype and t.shape == r.shape for t in (y, r, k, v, g))
    ok = ok and _consts(r.dtype, lw.r_k, lw.lnx_w, lw.lnx_b)
    if lib is None or not ok:
        return ops.tmix_post(y, r, k, v, g, lw, H, eps)
    out = torch.empty_like(r)
    stream = torch.cuda.current_stream(r.device).cuda_stream
    _check(lib.prefill_tmix_post(
        _DT[r.dtype], r.numel() // C, H, y.data_ptr(), r.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
        lw.r_k.data_ptr(), lw.lnx_w.data_ptr(), lw.lnx_b.data_ptr(), float(eps), out.data_ptr(), stream,
    ), "prefill_tmix_post")  # fmt: skip
    return out
