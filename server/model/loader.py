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
    if spec.startswith("synthetic:"):
        sd = synthetic.synthetic_state_dict(spec, device=device, dtype=dtype)
        name = spec
    else:
        sd = checkpoint.read_checkpoint(spec)
        name = os.path.basename(spec)
    shape = checkpoint.validate(sd)
    weights = checkpoint.convert(sd, shape, device, dtype)
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
    log.info("loaded %s (%s) on %s %s in %.1fs", name, shape.signature(), device, dtype, time.perf_counter() - t0)
    return model
