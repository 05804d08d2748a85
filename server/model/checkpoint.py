"""Official RWKV-7 checkpoints: reading (.pth, mmap), validation, conversion to model weights.

An official checkpoint is a flat state dict (see `expected_shapes`). We validate every key and
shape before converting anything, then convert tensor by tensor onto the target device/dtype
(no full-precision copy of the whole model), folding blocks.0.ln0 into the embedding.
The big matrices keep the nn.Linear layout (out, in) and are applied with F.linear (no
transposed copies); the low-rank w1/a1/v1/g1 (C, d) and w2/a2/v2/g2 (d, C) keep the official
(in, out) layout and are applied as x @ w1 (other helpers' code relies on this layout).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.model.qlinear import QWeight, SparseCodes, Weight
from server.model.state import ModelShape

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ATT_MIX = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


SYNTHETIC_MARK = "_synthetic_seed"
"""A one-element tensor that `save_synthetic` adds to the files it writes (the seed of their
random weights), so a synthetic file is recognised wherever it is loaded from. Other readers
(the `rwkv` package) ignore it."""


def save_whole(sd: Mapping[str, torch.Tensor], path: str) -> None:
    """torch.save to `path` through `<path>.partial`, then a rename: a crash, a full disk or an
    interrupt leaves no half-written checkpoint under `path` (nor the partial file)."""
    tmp = f"{path}.partial"
    try:
        torch.save(dict(sd), tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class CheckpointError(ValueError):
    """The file is not a loadable RWKV-7 checkpoint (the message says why)."""


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Open an official RWKV-7 .pth file with mmap (tensors stay on disk until converted)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix != ".pth":
        raise CheckpointError(
            f"unsupported checkpoint format {suffix or '(no suffix)'!r} for {path!r}: only official "
            "RWKV-7 .pth files (a torch.save'd state dict) are supported; use a .pth file or "
            "'synthetic:<preset>[:seed]'"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path!r}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path!r} is empty (an interrupted download or copy?)")
    from server.checks_args import unreadable  # (a light module: os only)

    if why := unreadable(path):  # (is_zipfile says False for a file it cannot open; torch.load's error reads as damage)
        raise CheckpointError(f"cannot read {path!r}: {why}")
    zipped = zipfile.is_zipfile(path)  # torch.save's format since 1.6; mmap needs it
    try:
        with warnings.catch_warnings():  # torch's warnings about a pickle it refuses: the error says it
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", mmap=zipped, weights_only=True)
    except OSError as exc:  # reading failed (an I/O error): not the file's content
        raise CheckpointError(f"cannot read {path!r}: {exc.strerror or exc}") from exc
    except Exception as exc:  # pickle errors, zip errors, ...
        # (torch's own message runs over many lines, and for a file that is no checkpoint at all
        # it suggests loading it with weights_only=False: never for an untrusted file)
        what = "a torch .pth state dict" if zipped else "a torch checkpoint (in neither of torch.save's formats)"
        first = str(exc).strip().splitlines()[0][:200] if zipped and str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot read {path!r} as {what}: the file is damaged, truncated or of another kind ({first})"
        ) from exc
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path!r} is not a state dict of tensors (not an RWKV-7 checkpoint)")
    return dict(sd)


def _need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"not an RWKV-7 checkpoint: missing key {key!r}")
    return sd[key]


def infer_shape(sd: Mapping[str, torch.Tensor]) -> ModelShape:
    """Dimensions from the keys: V, C from emb; H, N from r_k; widths from w1/a1/v1/g1."""
    emb, r_k = _need(sd, "emb.weight"), _need(sd, "blocks.0.att.r_k")
    if emb.dim() != 2 or r_k.dim() != 2:
        raise CheckpointError("misshapen key 'emb.weight' or 'blocks.0.att.r_k' (expected 2-D)")
    V, C = emb.shape
    H, N = r_k.shape
    if H * N != C:
        raise CheckpointError(f"misshapen key 'blocks.0.att.r_k': {tuple(r_k.shape)}, H*N != C={C}")
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    L = max(layers) + 1
    width = lambda key: _need(sd, key).shape[-1]
    return ModelShape(
        n_layer=L, n_embd=C, n_head=H, head_size=N, vocab_size=V,
        ffn_dim=_need(sd, "blocks.0.ffn.key.weight").shape[0],
        d_decay=width("blocks.0.att.w1"), d_aaa=width("blocks.0.att.a1"),
        d_mv=width("blocks.1.att.v1") if L > 1 else 32, d_gate=width("blocks.0.att.g1"),
    )  # fmt: skip


def expected_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every key of an official checkpoint and its shape (vectors listed as (C,): any shape
    that squeezes to it is accepted, e.g. the official [1, 1, C])."""
    C, V, F_ = s.n_embd, s.vocab_size, s.ffn_dim
    out: dict[str, tuple[int, ...]] = {"emb.weight": (V, C), "blocks.0.ln0.weight": (C,), "blocks.0.ln0.bias": (C,)}
    for i in range(s.n_layer):
        p = f"blocks.{i}."
        for n in ("ln1", "ln2"):
            out[p + n + ".weight"] = out[p + n + ".bias"] = (C,)
        a = p + "att."
        for n in ATT_MIX + ("w0", "a0", "k_k", "k_a", "ln_x.weight", "ln_x.bias"):
            out[a + n] = (C,)
        for n, d in (("w", s.d_decay), ("a", s.d_aaa), ("g", s.d_gate)) + ((("v", s.d_mv),) if i else ()):
            out[a + n + "1"], out[a + n + "2"] = (C, d), (d, C)
        if i:
            out[a + "v0"] = (C,)
        out[a + "r_k"] = (s.n_head, s.head_size)
        for n in ("receptance", "key", "value", "output"):
            out[a + n + ".weight"] = (C, C)
        out[p + "ffn.x_k"] = (C,)
        out[p + "ffn.key.weight"], out[p + "ffn.value.weight"] = (F_, C), (C, F_)
    out.update({"ln_out.weight": (C,), "ln_out.bias": (C,), "head.weight": (V, C)})
    return out


def validate(sd: Mapping[str, torch.Tensor]) -> ModelShape:
    """Check every key and shape; raise CheckpointError naming the first bad key."""
    shape = infer_shape(sd)
    for key, want in expected_shapes(shape).items():
        t = _need(sd, key)
        if len(want) == 1:  # a vector: any shape with one non-1 dimension of the right size
            ok = t.numel() == want[0] and sum(d != 1 for d in t.shape) <= 1
        else:
            ok = tuple(t.shape) == want
        if not ok:
            raise CheckpointError(f"misshapen key {key!r}: shape {tuple(t.shape)}, expected {want}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"key {key!r} has dtype {t.dtype}; supported: bf16, fp16, fp32")
    return shape


@dataclass
class LayerWeights:
    ln1_w: torch.Tensor  # (C,)
    ln1_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    mix: torch.Tensor  # (6, C): x_r, x_w, x_k, x_v, x_a, x_g
    w0: torch.Tensor  # (C,)
    w1: torch.Tensor  # (C, d_decay)  official (in, out): x @ w1
    w2: torch.Tensor  # (d_decay, C)
    a0: torch.Tensor  # (C,)
    a1: torch.Tensor  # (C, d_aaa)
    a2: torch.Tensor  # (d_aaa, C)
    v0: torch.Tensor | None  # (C,); None in layer 0 (v_first is v there)
    v1: torch.Tensor | None  # (C, d_mv)
    v2: torch.Tensor | None  # (d_mv, C)
    g1: torch.Tensor  # (C, d_gate)
    g2: torch.Tensor  # (d_gate, C)
    k_k: torch.Tensor  # (C,)
    k_a: torch.Tensor  # (C,)
    k_a1: torch.Tensor  # (C,) 1 - k_a
    r_k: torch.Tensor  # (H, N)
    wr: Weight  # (C, C) nn.Linear layout (out, in); 8-bit (QWeight) when quantized at load
    wk: Weight
    wv: Weight
    wo: Weight
    lnx_w: torch.Tensor  # (C,)
    lnx_b: torch.Tensor
    ffn_xk: torch.Tensor  # (C,)
    ffn_key: Weight  # (F, C)
    ffn_value: Weight  # (C, F)
    ffn_value_t: SparseCodes | None = None
    """ffn_value transposed for one-row decode that skips relu^2's zero inputs (--sparse-ffn;
    set by the loader on CUDA); not read by anything else."""


@dataclass
class Weights:
    emb: torch.Tensor  # (V, C) with ln0 folded in
    layers: list[LayerWeights]
    ln_out_w: torch.Tensor  # (C,)
    ln_out_b: torch.Tensor
    head: torch.Tensor  # (V, C)
    head8: QWeight | None = None
    """--quant int8|fp8: the head's int8 codes (V, C), which products of at most
    qlinear.HEAD8_MAX_ROWS rows use (the gemv reads half the bytes); None without --quant."""


def convert(sd: dict[str, torch.Tensor], shape: ModelShape, device, dtype: torch.dtype,
            progress: Callable[[int, int], None] | None = None,
            quantize: Callable[[torch.Tensor], Weight] | None = None,
            prequantized: Mapping[str, QWeight] | None = None) -> Weights:  # fmt: skip
    """Move and cast tensor by tensor (entries of sd are dropped as they are converted);
    progress(layers done, layers) after each layer. quantize (e.g. qlinear.quantize for a mode):
    applied to each layer's r/k/v/o and FFN linears as they arrive, so an 8-bit model never
    holds more than one of its matrices in 16 bits. prequantized: those linears as a
    pre-quantized file holds them (server.model.qfile; sd has placeholders for their keys)."""
    device = torch.device(device)
    pre = prequantized or {}

    def take(key: str, vector: bool = False) -> torch.Tensor:
        t = sd.pop(key).to(device=device).to(dtype=dtype)  # device first: casts run there
        return t.reshape(-1) if vector else t.contiguous()

    def linear(key: str) -> Weight:
        if key in pre:
            del sd[key]  # its placeholder
            return pre[key].to(device)
        t = take(key)
        return quantize(t) if quantize is not None else t

    emb = _fold_ln0(
        sd.pop("emb.weight"), take("blocks.0.ln0.weight", True), take("blocks.0.ln0.bias", True), device, dtype
    )
    layers = []
    for i in range(shape.n_layer):
        p, a = f"blocks.{i}.", f"blocks.{i}.att."
        for n in ("v0", "v1", "v2") if i == 0 else ():
            sd.pop(a + n, None)  # some official files carry unused layer-0 v0/v1/v2
        layers.append(LayerWeights(
            ln1_w=take(p + "ln1.weight", True), ln1_b=take(p + "ln1.bias", True),
            ln2_w=take(p + "ln2.weight", True), ln2_b=take(p + "ln2.bias", True),
            mix=torch.stack([take(a + n, True) for n in ATT_MIX]),
            w0=take(a + "w0", True), w1=take(a + "w1"), w2=take(a + "w2"),
            a0=take(a + "a0", True), a1=take(a + "a1"), a2=take(a + "a2"),
            v0=take(a + "v0", True) if i else None, v1=take(a + "v1") if i else None,
            v2=take(a + "v2") if i else None,
            g1=take(a + "g1"), g2=take(a + "g2"),
            k_k=take(a + "k_k", True), k_a=(k_a := take(a + "k_a", True)), k_a1=1 - k_a,
            r_k=take(a + "r_k"),
            wr=linear(a + "receptance.weight"), wk=linear(a + "key.weight"),
            wv=linear(a + "value.weight"), wo=linear(a + "output.weight"),
            lnx_w=take(a + "ln_x.weight", True), lnx_b=take(a + "ln_x.bias", True),
            ffn_xk=take(p + "ffn.x_k", True), ffn_key=linear(p + "ffn.key.weight"),
            ffn_value=linear(p + "ffn.value.weight"),
        ))  # fmt: skip
        if progress is not None:
            progress(i + 1, shape.n_layer)
    return Weights(
        emb=emb,
        layers=layers,
        ln_out_w=take("ln_out.weight", True),
        ln_out_b=take("ln_out.bias", True),
        head=take("head.weight"),
    )


def _fold_ln0(emb: torch.Tensor, w: torch.Tensor, b: torch.Tensor, device, dtype, rows: int = 8192) -> torch.Tensor:
    """emb = layer_norm(emb, ln0) computed in fp32, a block of rows at a time."""
    V, C = emb.shape
    out = torch.empty(V, C, device=device, dtype=dtype)
    for s in range(0, V, rows):
        blk = emb[s : s + rows].to(device=device).float()  # (rows, C)
        out[s : s + rows] = F.layer_norm(blk, (C,), w.float(), b.float())
    return out
