"""load_model: a checkpoint path or a synthetic spec -> RWKV7 on the target device/dtype."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from server.model import checkpoint, synthetic
from server.model.rwkv7 import KERNELS, RWKV7

log = logging.getLogger(__name__)


def load_model(spec: str, device="cpu", dtype: torch.dtype = torch.float32,
               state_dtype: torch.dtype = torch.float32, *, chunk_len: int | None = None,
               kernels: str = "auto", max_chunk_tokens: int | None = None,
               kernel_cache: str | Path | None = None) -> RWKV7:  # fmt: skip
    """spec: a path to an official RWKV-7 .pth, or 'synthetic:<preset>[:seed]'.

    Tensors are converted one at a time onto `device` in `dtype` (no full fp32 copy).
    kernels: auto (CUDA kernels when on cuda and built), torch (pure torch), cuda (required).
    kernel_cache: the kernels' build folder (default kernels.loader.DEFAULT_CACHE_ROOT).
    chunk_len / max_chunk_tokens: prefill chunking (defaults: see RWKV7).
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    if dtype not in checkpoint.SUPPORTED_DTYPES:
        raise ValueError(f"unsupported compute dtype {dtype}")
    if kernels not in KERNELS:  # before the weights are read
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    is_synthetic = spec.startswith("synthetic:")
    if is_synthetic:
        sd = synthetic.synthetic_state_dict(spec, device=device, dtype=dtype)
        name = spec
    else:
        sd = checkpoint.read_checkpoint(spec)
        name = os.path.basename(spec)
        is_synthetic = sd.pop(checkpoint.SYNTHETIC_MARK, None) is not None
    shape = checkpoint.validate(sd)
    weights = checkpoint.convert(sd, shape, device, dtype, progress=_Progress(name))
    model = RWKV7(
        weights,
        shape,
        name,
        device,
        dtype,
        state_dtype,
        chunk_len=chunk_len,
        kernels=kernels,
        max_chunk_tokens=max_chunk_tokens,
        kernel_cache=kernel_cache,
    )
    model.synthetic = is_synthetic
    log.info("loaded %s (%s) on %s %s in %.1fs", name, shape.signature(), device, dtype, time.perf_counter() - t0)
    return model


class _Progress:
    """Logs the conversion of a checkpoint's layers every few seconds (a 7B file takes a while)."""

    def __init__(self, name: str, every: float = 5.0) -> None:
        self.name, self.every = name, every
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every and done < total:
            self.last = now
            log.info("loading %s: layer %d of %d (%.0fs)", self.name, done, total, now - self.t0)
