"""The fused sampler step's wrapper (kernels/sampler.cu): server.engine.sampler.sample in one
launch. Its pure-torch twin is that function with CANDIDATES = () (a stable full sort).
It runs the kernel library the model loaded at start-up (`kernels.loader.loaded_any`: never a
build here, and none when the model runs the pure-torch ops)."""

from __future__ import annotations

import torch

from server.model.cuda_ops import _DT, _check

SAMPLER_UNSUPPORTED = -2  # sampler_step's return code for a vocabulary it does not cover
KERNEL_FPARAMS = ("temperature", "top_p", "presence_penalty", "repetition_penalty", "penalty_decay")
"""The fparams columns kernels/sampler.cu reads (a.fparams[row * 5 + k]: 0 T, 1 top_p, 2 presence,
3 repetition, 4 decay): a hand-kept mirror of the kernel, changed only with it. The sampler's
layout (server.engine.sampler.FPARAMS) must equal it: a CUDA SamplerSlots raises otherwise
(sampler.check_kernel_layout), and test_sampler checks both against the kernel's source."""
KERNEL_IPARAMS = ("top_k", "seed")
"""The iparams columns kernels/sampler.cu reads (a.iparams[row * 2 + k]: 0 top_k, 1 seed), likewise."""


def fused_sample(logits, penalty, seen, fparams, iparams, positions, commit, greedy_only: bool = False,
                 dbg: torch.Tensor | None = None, cl: int = 0) -> torch.Tensor | None:  # fmt: skip
    """server.engine.sampler.sample (with CANDIDATES = (): exact, never -1) in one launch:
    tokens (B,) int64; penalty (B, V) fp32 and seen (B, V) bool updated in place (views with
    unit column stride, e.g. SamplerSlots' [:B] rows). dbg: optional (B, 8) fp32 out (m, S, c*,
    n kept by top-p, top-k threshold, its group limit or -1, total weight, target) for the tests.
    cl: the kernel's cluster size for V <= 65536, 3 or 4 (0: by batch, kernels/sampler.cu
    auto_cluster; the results do not depend on it), for the tests and benchmarks.
    Returns None when the kernel cannot run here (no kernels loaded, a layout or
    vocabulary it does not cover): the caller then runs the torch sampler. ValueError when the
    parameter tensors' widths are not the kernel's (_check_widths: a programming error). No
    host sync."""
    if cl not in (0, 3, 4):
        raise ValueError(f"fused_sample: cl must be 0, 3 or 4, not {cl!r}")
    _check_widths(fparams, iparams)
    if not logits.is_cuda or logits.dim() != 2:
        return None
    B, V = logits.shape
    ok = logits.dtype in _DT and penalty.dtype == torch.float32 and seen.dtype == torch.bool
    ok = ok and all(t.dim() == 2 and t.shape == (B, V) and t.stride(1) == 1 and t.device == logits.device
                    for t in (logits, penalty, seen))  # fmt: skip
    ok = ok and fparams.shape[0] == B and iparams.shape[0] == B and positions.shape == (B,)
    ok = ok and commit.shape == (B,) and (dbg is None or (dbg.shape == (B, 8) and dbg.dtype == torch.float32
                                                           and dbg.is_contiguous()))  # fmt: skip
    if not ok:
        return None
    from kernels import loader  # deferred: importing this module must not build anything

    lib = loader.loaded_any(logits.device)
    if lib is None:
        return None
    fp = fparams.to(torch.float32).contiguous()  # (B, 5) KERNEL_FPARAMS; copies only if needed
    ip = iparams.to(torch.long).contiguous()  # (B, 2) KERNEL_IPARAMS
    pos = positions.to(torch.long).contiguous()  # (B,)
    cm = commit.to(torch.bool).contiguous()  # (B,)
    out = torch.empty(B, dtype=torch.long, device=logits.device)  # (B,)
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    rc = lib.sampler_step(
        logits.data_ptr(), logits.stride(0), penalty.data_ptr(), penalty.stride(0), seen.data_ptr(), seen.stride(0),
        fp.data_ptr(), ip.data_ptr(), pos.data_ptr(), cm.data_ptr(), int(greedy_only), B, V, out.data_ptr(),
        dbg.data_ptr() if dbg is not None else 0, _DT[logits.dtype], cl, stream,
    )  # fmt: skip
    if rc == SAMPLER_UNSUPPORTED:
        return None
    _check(rc, "sampler_step")
    return out


def _check_widths(fparams: torch.Tensor, iparams: torch.Tensor) -> None:
    """ValueError when a parameter tensor is not (B, columns the kernel reads): the kernel would
    read the wrong parameter, so this is a programming error to fix, never a silent fallback to
    the torch sampler. (Which parameter each column holds: sampler.check_kernel_layout.)"""
    for what, kernel, t in (("fparams", KERNEL_FPARAMS, fparams), ("iparams", KERNEL_IPARAMS, iparams)):
        if t.dim() != 2 or t.shape[1] != len(kernel):
            raise ValueError(
                f"fused_sample: {what} of shape {tuple(t.shape)} is not (B, {len(kernel)}): kernels/sampler.cu reads"
                f" {kernel} (cuda_sampler.KERNEL_{what[0].upper()}PARAMS)"
            )
