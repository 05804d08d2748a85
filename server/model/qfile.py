"""Pre-quantized checkpoints: an official RWKV-7 .pth whose large linears are stored in 8 bits.

`rwkv-server quantize MODEL.pth OUT.pth --quant int8|fp8` writes one once; loading it skips the
quantization and reads about half the bytes of the 16-bit file (the linears are ~85% of a model).

Layout: the official state dict, where each quantized `<name>.weight` (the layers' r/k/v/o and
FFN key/value, qlinear.WEIGHT_MODES' scope) is replaced by `<name>.weight.q` (codes, (N, K), int8
or float8_e4m3fn) and `<name>.weight.scale` (fp32, (N,)), plus QUANT_MARK: a one-element int64
tensor, the mode's index in qlinear.WEIGHT_MODES. It stays a dict of tensors (weights_only
loading). The `rwkv` package cannot read it; keep the 16-bit file for other tools.
"""

from __future__ import annotations

import os

import torch

from server.model import checkpoint, qlinear
from server.model.checkpoint import CheckpointError
from server.model.qlinear import QWeight
from server.model.state import ModelShape

QUANT_MARK = "_quant_mode"
CODES, SCALES = ".q", ".scale"


def linear_keys(shape: ModelShape) -> list[str]:
    """The keys `--quant` quantizes, in file order."""
    out = []
    for i in range(shape.n_layer):
        a = f"blocks.{i}.att."
        out += [a + n + ".weight" for n in ("receptance", "key", "value", "output")]
        out += [f"blocks.{i}.ffn.key.weight", f"blocks.{i}.ffn.value.weight"]
    return out


def save_quantized(src: str, out: str, mode: str, dtype: torch.dtype, device: str = "cpu") -> tuple[ModelShape, int]:
    """Quantize the 16-bit checkpoint `src` as `--quant mode` at `dtype` does at load, write it to
    `out`; (its shape, the bytes of the tensors written)."""
    if mode not in qlinear.WEIGHT_MODES:
        raise ValueError(f"quant must be one of {', '.join(qlinear.WEIGHT_MODES)}, not {mode!r}")
    if os.path.exists(out) and os.path.samefile(src, out):
        raise CheckpointError(f"{out!r} is the checkpoint being read: write the 8-bit copy elsewhere")
    sd = checkpoint.read_checkpoint(src)
    if QUANT_MARK in sd:
        raise CheckpointError(f"{src!r} is already quantized ({file_mode(sd)}): give the 16-bit checkpoint")
    shape = checkpoint.validate({k: v for k, v in sd.items() if k != checkpoint.SYNTHETIC_MARK})
    for key in linear_keys(shape):
        w = sd.pop(key).to(device=device).to(dtype=dtype).contiguous()  # as checkpoint.convert takes it
        qw = qlinear.quantize(w, mode)
        sd[key + CODES], sd[key + SCALES] = qw.q.cpu(), qw.scale.cpu()
    sd[QUANT_MARK] = torch.tensor([qlinear.WEIGHT_MODES.index(mode)], dtype=torch.int64)
    checkpoint.save_whole(sd, out)
    return shape, sum(t.numel() * t.element_size() for t in sd.values())


def file_mode(sd: dict[str, torch.Tensor]) -> str | None:
    """The mode a pre-quantized state dict holds, or None for a 16-bit one."""
    mark = sd.get(QUANT_MARK)
    if mark is None:
        return None
    i = int(mark.reshape(-1)[0]) if mark.numel() == 1 else -1
    if not 0 <= i < len(qlinear.WEIGHT_MODES):
        raise CheckpointError(f"unknown quantization mark {mark.tolist()} in key {QUANT_MARK!r}")
    return qlinear.WEIGHT_MODES[i]


def take_quantized(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[str | None, dict[str, QWeight]]:
    """Split a pre-quantized state dict: (its mode, {key: QWeight on the CPU}), leaving in `sd` an
    empty placeholder of each key's shape so that checkpoint.validate checks it like a 16-bit
    file's; (None, {}) for a 16-bit file. Raises CheckpointError naming a bad key."""
    mode = file_mode(sd)
    if mode is None:
        return None, {}
    del sd[QUANT_MARK]
    codes = {k[: -len(CODES)]: sd.pop(k) for k in [k for k in sd if k.endswith(CODES)]}
    for key, q in codes.items():
        if q.dtype != qlinear.CODE_DTYPES[mode] or q.dim() != 2:
            raise CheckpointError(f"key {key + CODES!r}: {q.dtype} {tuple(q.shape)}, expected 2-D {mode} codes")
        sd[key] = torch.empty(q.shape, dtype=dtype, device="meta")  # validated, never read
    want = _linear_shapes(sd)
    pre: dict[str, QWeight] = {}
    for key, q in codes.items():
        if key in want and tuple(q.shape) != want[key]:  # the codes first: a scale's length follows them
            raise CheckpointError(f"misshapen key {key + CODES!r}: shape {tuple(q.shape)}, expected {want[key]}")
        scale = sd.pop(key + SCALES, None)
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != q.shape[:1]:
            got = "missing" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise CheckpointError(f"key {key + SCALES!r}: {got}, expected float32 ({q.shape[0]},)")
        pre[key] = QWeight(q, scale, dtype)
    return mode, pre


def _linear_shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The shapes the linears must have by the rest of the file's keys (checkpoint.infer_shape,
    over their placeholders), or {} where those keys cannot tell (checkpoint.validate's to say)."""
    try:
        return checkpoint.expected_shapes(checkpoint.infer_shape(sd))
    except (CheckpointError, ValueError, IndexError):
        return {}
