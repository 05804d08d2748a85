"""load_model: a checkpoint path or a synthetic spec -> RWKV7 on the target device/dtype."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from server.config import CHOICES
from server.model import checkpoint, qfile, qlinear, synthetic
from server.model.qlinear import Weight
from server.model.rwkv7 import KERNELS, RWKV7

log = logging.getLogger(__name__)
SPARSE_FFN = CHOICES["sparse_ffn"]
"""load_model's sparse_ffn values (Settings.sparse_ffn)."""


def load_model(spec: str, device="cpu", dtype: torch.dtype = torch.float32,
               state_dtype: torch.dtype = torch.float32, *, chunk_len: int | None = None,
               kernels: str = "auto", max_chunk_tokens: int | None = None,
               kernel_cache: str | Path | None = None, quant: str = "none",
               sparse_ffn: str = "auto") -> RWKV7:  # fmt: skip
    """spec: a path to an official RWKV-7 .pth, or 'synthetic:<preset>[:seed]'.

    Tensors are converted one at a time onto `device` in `dtype` (no full fp32 copy).
    kernels: auto (CUDA kernels when on cuda and built), torch (pure torch), cuda (required).
    kernel_cache: the kernels' build folder (default kernels.loader.DEFAULT_CACHE_ROOT).
    chunk_len / max_chunk_tokens: prefill chunking (defaults: see RWKV7).
    quant: none, or a qlinear.WEIGHT_MODES mode: the layers' large linears quantized as they load.
    sparse_ffn: auto | on | off: the FFN value weights transposed for one-row products that skip
    relu^2's zeros (_sparse_values): auto with fp8 weights, on with any (16-bit: fp16 only), off
    never.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    _check_args(dtype, kernels, quant, sparse_ffn)  # before the weights are read
    read = _read_weights(spec, device, dtype, quant)
    name, quant, pre = read.name, read.quant, read.pre
    shape = checkpoint.validate(read.sd)
    if pre and set(pre) != set(qfile.linear_keys(shape)):
        raise checkpoint.CheckpointError(f"{name}: its 8-bit linears are not those `--quant` quantizes")
    quantizer = _Quantizer(quant) if quant != "none" and not pre else None
    weights = checkpoint.convert(
        read.sd, shape, device, dtype, progress=_Progress(name), quantize=quantizer, prequantized=pre
    )
    if quant != "none":
        weights.head8 = _head8(weights.head, name)
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
    model.synthetic = read.synthetic
    model.quant = quant
    _after_load(model, device, dtype, quant, sparse_ffn, quantizer)
    log.info("loaded %s (%s) on %s %s in %.1fs", name, shape.signature(), device, dtype, time.perf_counter() - t0)
    return model


def _check_args(dtype: torch.dtype, kernels: str, quant: str, sparse_ffn: str) -> None:
    """ValueError for a load_model argument outside its choices (checked before any weight is read)."""
    if dtype not in checkpoint.SUPPORTED_DTYPES:
        raise ValueError(f"unsupported compute dtype {dtype}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if quant != "none" and quant not in qlinear.WEIGHT_MODES:
        raise ValueError(f"quant must be none or one of {', '.join(qlinear.WEIGHT_MODES)}, not {quant!r}")
    if sparse_ffn not in SPARSE_FFN:
        raise ValueError(f"sparse_ffn must be one of {', '.join(SPARSE_FFN)}, not {sparse_ffn!r}")


class _Read(NamedTuple):
    """What _read_weights found: the state dict and what the spec or the file says of it."""

    sd: dict[str, torch.Tensor]
    name: str  # the model's name: the synthetic spec, or the file's base name
    synthetic: bool  # a synthetic model (a spec, or a file written from one)
    quant: str  # the quant mode: the argument's, or a pre-quantized file's own
    pre: dict[str, qlinear.QWeight]  # a pre-quantized file's linears (taken out of sd)


def _read_weights(spec: str, device: torch.device, dtype: torch.dtype, quant: str) -> _Read:
    """The weights of `spec`: a synthetic preset made on `device` in `dtype`, or a checkpoint
    file read whole (converted later, one tensor at a time), with its synthetic mark and its
    pre-quantized linears taken out (_file_quant: CheckpointError for a `quant` it refuses)."""
    if spec.startswith("synthetic:"):
        return _Read(synthetic.synthetic_state_dict(spec, device=device, dtype=dtype), spec, True, quant, {})
    sd = checkpoint.read_checkpoint(spec)
    name = os.path.basename(spec)
    is_synthetic = sd.pop(checkpoint.SYNTHETIC_MARK, None) is not None
    quant, pre = _file_quant(sd, name, quant, dtype)
    return _Read(sd, name, is_synthetic, quant, pre)


def _after_load(
    model: RWKV7,
    device: torch.device,
    dtype: torch.dtype,
    quant: str,
    sparse_ffn: str,
    quantizer: _Quantizer | None,
) -> None:
    """What follows the model's build: the FFN values' transposed copy where wanted (CUDA with
    its kernels), the quantizer's totals logged, and a warning for 8-bit weights off CUDA."""
    if device.type == "cuda" and model.kernel_ops() and sparse_wanted(quant, sparse_ffn, dtype, model.name):
        _sparse_values(model, model.name)
    if quantizer is not None:
        quantizer.log(model.name)
    if quant != "none" and device.type != "cuda":
        log.warning(
            "%s weights on %s: the weights are smaller, but each product dequantizes its matrix "
            "first (slower than 16-bit); the 8-bit kernels are CUDA only",
            quant,
            device,
        )


def _file_quant(
    sd: dict[str, torch.Tensor], name: str, quant: str, dtype: torch.dtype
) -> tuple[str, dict[str, qlinear.QWeight]]:
    """(the model's quant mode, the file's 8-bit linears): a pre-quantized file's own mode and
    QWeights (taken out of sd), which `quant` must be none or equal to; else (quant, {})."""
    mode, weights = qfile.take_quantized(sd, dtype)
    if mode is None:
        return quant, weights
    if quant not in ("none", mode):
        raise checkpoint.CheckpointError(
            f"{name} holds {mode} weights (written by `rwkv-server quantize`): it cannot be loaded with "
            f"--quant {quant}; give the 16-bit checkpoint, or --quant {mode}"
        )
    log.info("%s: pre-quantized %s weights (%d linears): no quantization at load", name, mode, len(weights))
    return mode, weights


def _head8(head: torch.Tensor, name: str) -> qlinear.QWeight:
    """The int8 copy of the head that small products read (qlinear.HEAD8_MAX_ROWS), logged."""
    t0 = time.perf_counter()
    head8 = qlinear.quantize(head, "int8")
    log.info("%s: int8 copy of the head for products of <= %d rows: +%.2f GB in %.1fs", name,
             qlinear.HEAD8_MAX_ROWS, head8.nbytes() / 1e9, time.perf_counter() - t0)  # fmt: skip
    return head8


def sparse_wanted(quant: str, sparse_ffn: str, dtype: torch.dtype, name: str) -> bool:
    """Whether the FFN value weights get their transposed copy (_sparse_values): sparse_ffn auto
    with fp8 weights, on with any. Never for a model dtype other than fp16: the one-row product
    takes fp16 activations only, so the copy would be memory that nothing reads."""
    if not (quant == "fp8" if sparse_ffn == "auto" else sparse_ffn == "on"):
        return False
    if dtype != torch.float16:
        level = logging.WARNING if sparse_ffn == "on" else logging.INFO
        log.log(level, "%s: no transposed FFN value copy (--sparse-ffn): it needs fp16 activations, not %s", name,
                dtype)  # fmt: skip
        return False
    return True


def _sparse_values(model: RWKV7, name: str) -> None:
    """Each layer's FFN value weights transposed (LayerWeights.ffn_value_t) for the one-row product
    that skips relu^2's zeros (cuda_quant.sparse_relu2): B=1 decode reads only the nonzero inputs'
    weight rows, for the memory of a second copy of those weights (docs/performance.md, "Skipping
    relu^2's zeros"). By default with fp8 alone (sparse_ffn=auto): int8 is the mode chosen to fit
    a model in less memory, and a 16-bit copy costs twice the bytes."""
    from server.model import cuda_quant  # CUDA paths: imported when the model runs on CUDA

    t0, extra = time.perf_counter(), 0
    for lw in model.w.layers:
        lw.ffn_value_t = cuda_quant.sparse_codes(lw.ffn_value)
        extra += lw.ffn_value_t.qt.numel() * lw.ffn_value_t.qt.element_size() + lw.ffn_value_t.part.numel() * 4
    torch.cuda.synchronize(model.device)
    log.info("%s: FFN value weights transposed for one-row decode (zero inputs skipped): +%.2f GB in %.1fs", name,
             extra / 1e9, time.perf_counter() - t0)  # fmt: skip


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


class _Quantizer:
    """qlinear.quantize for one mode, with the time and bytes it took (logged once at the end)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.seconds, self.count, self.before, self.after = mode, 0.0, 0, 0, 0

    def __call__(self, w: torch.Tensor) -> Weight:
        t0 = time.perf_counter()
        qw = qlinear.quantize(w, self.mode)
        if w.is_cuda:
            torch.cuda.synchronize(w.device)  # the time logged is the work's, not its launches'
        self.seconds += time.perf_counter() - t0
        self.count += 1
        self.before += w.numel() * w.element_size()
        self.after += qw.nbytes()
        return qw

    def log(self, name: str) -> None:
        log.info("quantized %d linears of %s to %s in %.1fs: %.2f GB -> %.2f GB", self.count, name, self.mode,
                 self.seconds, self.before / 1e9, self.after / 1e9)  # fmt: skip
