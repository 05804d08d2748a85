"""RWKV-7 state files (the format RWKV-PEFT's state tuning writes and RWKV-Runner mounts) <-> `State`.

The file is a `torch.save`'d dict `{"blocks.{i}.att.time_state": Tensor[H, N, N]}` for every
layer i, in any float dtype (usually bf16). `time_state[h, i, j]` has the value index i in rows
and the key index j in columns: the orientation of `State.wkv[l, 0, h, i, j]`, so it is used as
it is, never transposed. A tuned file has no token-shift parts: a state read from one has zero
shifts (state tuning trains with zero shifts too). Files are read with `weights_only=True`
(nothing but tensors and plain containers is unpickled) and told from model checkpoints by
their keys, never by their name.

Our export adds four keys under the prefix "rwkv_server." (the FULL format), so that a state
leaves the server and comes back bit for bit, with what it has not consumed yet:

    rwkv_server.att_shift  (L, C)   the time-mix token shift, in the state's dtype
    rwkv_server.ffn_shift  (L, C)   the channel-mix token shift
    rwkv_server.pending    (P,)     int64: tokens the state has NOT consumed yet (fed first when
                                    it is used: the engine's `pending_tokens` contract)
    rwkv_server.meta       (K,)     uint8: UTF-8 JSON {"format", "signature", ...}

RWKV-Runner accepts a file only when its key count equals the layer count, so it refuses a FULL
file: the PLAIN format (`full=False`) is the bare time_state dict, for RWKV-Runner and the `rwkv`
package; it loses the shifts and the pending tokens (see docs/states.md for what that means).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from server.model.state import ModelShape, State

PREFIX = "rwkv_server."
ATT_SHIFT, FFN_SHIFT, PENDING, META = (PREFIX + k for k in ("att_shift", "ffn_shift", "pending", "meta"))
FORMAT = "rwkv_server.state.v1"
"""The `format` of our metadata (the FULL format's version)."""
_LAYER_KEY = re.compile(r"blocks\.(\d+)\.att\.time_state")
_CHECKPOINT_KEYS = ("emb.weight", "head.weight", "blocks.0.att.r_k", "blocks.0.att.receptance.weight")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class StateFileError(ValueError):
    """The data is not a state file this model can use (the message names the file and key)."""


@dataclass
class StateFile:
    """A state file read for one model."""

    state: State
    """Batch 1, on the CPU, in the dtypes asked for (zero shifts for a PLAIN file)."""
    pending: list[int] = field(default_factory=list)
    """Tokens to feed before anything else (FULL files only; [] for a tuned state)."""
    full: bool = False
    """The file carried our extra keys (shifts, pending tokens, metadata)."""
    meta: dict[str, Any] = field(default_factory=dict)
    dtype: str = ""
    """The dtype of the file's time_state tensors (e.g. "bfloat16")."""


def read_state_file(
    data: bytes | str | Path,
    shape: ModelShape,
    *,
    source: str | None = None,
    shift_dtype: torch.dtype = torch.float32,
    wkv_dtype: torch.dtype = torch.float32,
    max_pending: int | None = None,
) -> StateFile:
    """Read and validate a state file (bytes, or a path) for a model of `shape`. `source` names
    it in errors (default: the path, or "the upload"). More than `max_pending` pending tokens are
    refused (the server's --max-prompt-tokens: a run feeds them first, uncounted as history).
    Raises StateFileError."""
    src = source or (str(data) if isinstance(data, (str, Path)) else "the upload")
    try:
        if isinstance(data, (str, Path)):
            sd = torch.load(str(data), map_location="cpu", weights_only=True)
        else:
            sd = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateFileError(f"{src}: no such file") from None
    except Exception as exc:
        raise StateFileError(
            f"{src}: cannot be read as a torch state file (truncated, or not a "
            f".pth written by torch.save?): {_short(exc)}"
        ) from None
    return state_from_dict(sd, shape, source=src, shift_dtype=shift_dtype, wkv_dtype=wkv_dtype, max_pending=max_pending)


def state_from_dict(
    sd: Any,
    shape: ModelShape,
    *,
    source: str,
    shift_dtype: torch.dtype = torch.float32,
    wkv_dtype: torch.dtype = torch.float32,
    max_pending: int | None = None,
) -> StateFile:
    """Validate a loaded state dict against the model and build its State (see read_state_file)."""
    layers = check_state_dict(sd, shape, source)
    wkv = torch.stack([layers[i] for i in range(shape.n_layer)]).unsqueeze(1)  # (L, 1, H, N, N)
    wkv = _cast(wkv, wkv_dtype, "blocks.*.att.time_state", source).contiguous()
    L, C = shape.n_layer, shape.n_embd
    full = META in sd
    if not full and (part := next((k for k in (ATT_SHIFT, FFN_SHIFT, PENDING) if k in sd), None)):
        raise StateFileError(f"{source}: has {part!r} but not {META!r} (a damaged export)")
    if full:
        meta = _meta(sd[META], shape, source)
        att = _cast(_shift(sd, ATT_SHIFT, (L, C), source), shift_dtype, ATT_SHIFT, source).reshape(L, 1, C)
        ffn = _cast(_shift(sd, FFN_SHIFT, (L, C), source), shift_dtype, FFN_SHIFT, source).reshape(L, 1, C)
        att, ffn = att.contiguous(), ffn.contiguous()
        pending = _pending(sd.get(PENDING), shape, source, max_pending)
    else:
        meta, pending = {}, []
        att = torch.zeros(L, 1, C, dtype=shift_dtype)
        ffn = torch.zeros(L, 1, C, dtype=shift_dtype)
    dtype = str(layers[0].dtype).removeprefix("torch.")
    return StateFile(State(att, ffn, wkv), pending=pending, full=full, meta=meta, dtype=dtype)


def check_state_dict(sd: Any, shape: ModelShape, source: str) -> dict[int, torch.Tensor]:
    """The time_state tensor of each layer, once every key, shape and value fits the model."""
    if not isinstance(sd, Mapping):
        raise StateFileError(f"{source}: not a state file (a dict of tensors), but a {type(sd).__name__}")
    ckpt = next((k for k in _CHECKPOINT_KEYS if k in sd), None)
    if ckpt is not None:
        raise StateFileError(
            f"{source}: this is a model checkpoint (it has the key {ckpt!r}), not a "
            "state file; a model is given with --model"
        )
    H, N, L = shape.n_head, shape.head_size, shape.n_layer
    layers: dict[int, torch.Tensor] = {}
    for key, value in sd.items():
        m = _LAYER_KEY.fullmatch(str(key))
        if m is None:
            if key in (ATT_SHIFT, FFN_SHIFT, PENDING, META):
                continue
            raise StateFileError(
                f"{source}: unexpected key {key!r} (an RWKV-7 state file has only 'blocks.<i>.att.time_state' keys)"
            )
        layers[int(m.group(1))] = _tensor(value, key, source)
    if not layers:
        raise StateFileError(f"{source}: no 'blocks.<i>.att.time_state' key: not an RWKV-7 state file")
    if max(layers) >= L:
        raise StateFileError(
            f"{source}: has layers up to {max(layers)} (key 'blocks.{max(layers)}.att.time_state'), "
            f"this model has {L} layers: a state of another model"
        )
    missing = [i for i in range(L) if i not in layers]
    if missing:
        raise StateFileError(
            f"{source}: missing key 'blocks.{missing[0]}.att.time_state' "
            f"({len(layers)} of the model's {L} layers are in the file)"
        )
    for i in range(L):
        t = layers[i]
        if tuple(t.shape) != (H, N, N):
            raise StateFileError(
                f"{source}: key 'blocks.{i}.att.time_state' has shape {tuple(t.shape)}; this "
                f"model needs ({H}, {N}, {N}) (heads, head size, head size): a state of "
                "another model size"
            )
        if not torch.isfinite(t).all():
            raise StateFileError(f"{source}: key 'blocks.{i}.att.time_state' holds NaN or infinite values")
    return layers


def write_state_file(
    state: State, *, full: bool = True, pending: Sequence[int] = (), meta: Mapping[str, Any] | None = None
) -> bytes:
    """The bytes of a state file of a batch-1 state, in the state's own dtypes (bit-exact).
    full=False: the bare RWKV-7 file (time_state keys only)."""
    if state.batch_size != 1:
        raise ValueError(f"a state file holds one sequence, got a batch of {state.batch_size}")
    wkv = state.wkv.detach().cpu()
    sd: dict[str, torch.Tensor] = {
        f"blocks.{i}.att.time_state": wkv[i, 0].clone()  # (H, N, N)
        for i in range(wkv.shape[0])
    }
    if full:
        sd[ATT_SHIFT] = state.att_shift.detach().cpu()[:, 0].clone()  # (L, C)
        sd[FFN_SHIFT] = state.ffn_shift.detach().cpu()[:, 0].clone()  # (L, C)
        sd[PENDING] = torch.tensor(list(pending), dtype=torch.int64)
        body = {"format": FORMAT, **(meta or {})}
        sd[META] = torch.frombuffer(bytearray(json.dumps(body).encode()), dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


# --- helpers -----------------------------------------------------------------------------------
def _tensor(value: Any, key: str, source: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise StateFileError(f"{source}: key {key!r} is a {type(value).__name__}, not a tensor")
    if value.dtype not in _FLOATS:
        raise StateFileError(f"{source}: key {key!r} has dtype {value.dtype}; a state is floating point")
    return value


def _shift(sd: Mapping[str, Any], key: str, want: tuple[int, int], source: str) -> torch.Tensor:
    if key not in sd:
        raise StateFileError(f"{source}: has {META!r} but not {key!r} (a damaged export)")
    t = _tensor(sd[key], key, source)
    if tuple(t.shape) != want:
        raise StateFileError(f"{source}: key {key!r} has shape {tuple(t.shape)}; this model needs {want}")
    if not torch.isfinite(t).all():
        raise StateFileError(f"{source}: key {key!r} holds NaN or infinite values")
    return t


def _cast(t: torch.Tensor, dtype: torch.dtype, key: str, source: str) -> torch.Tensor:
    """t in the state's dtype; StateFileError where a finite value of a wider dtype (float64)
    does not fit it (it would become infinite)."""
    out = t.to(dtype)
    if not torch.isfinite(out).all():
        raise StateFileError(f"{source}: key {key!r} holds values too large for the state's {dtype} (past its range)")
    return out


def _pending(value: Any, shape: ModelShape, source: str, limit: int | None) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point:
        raise StateFileError(f"{source}: key {PENDING!r} must be a 1-D integer tensor of token ids")
    if limit is not None and value.numel() > limit:
        raise StateFileError(
            f"{source}: key {PENDING!r} holds {value.numel()} pending tokens, more than this server's "
            f"--max-prompt-tokens ({limit}): a run would feed them all first"
        )
    ids = [int(x) for x in value.tolist()]
    bad = next((x for x in ids if not 0 <= x < shape.vocab_size), None)
    if bad is not None:
        raise StateFileError(
            f"{source}: key {PENDING!r} holds token id {bad}, outside the vocabulary [0, {shape.vocab_size})"
        )
    return ids


def _meta(value: Any, shape: ModelShape, source: str) -> dict[str, Any]:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise StateFileError(f"{source}: key {META!r} must be a 1-D uint8 tensor (UTF-8 JSON)")
    try:
        meta = json.loads(bytes(value.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"{source}: key {META!r} is not UTF-8 JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFileError(f"{source}: key {META!r} is not {FORMAT!r} metadata")
    sig = meta.get("signature")
    if sig is not None and sig != shape.signature():
        raise StateFileError(f"{source}: exported from a model of shape {sig!r}; this model is {shape.signature()!r}")
    return meta


def _short(exc: BaseException) -> str:
    """The first line of exc's message; for torch's weights-only refusal, its reason (the rest is
    torch's advice to load the file with weights_only=False, which is not ours to give)."""
    if "WeightsUnpickler error:" in str(exc):
        why = [ln for ln in str(exc).split("WeightsUnpickler error:", 1)[1].splitlines() if ln.strip()]
        return f"it holds more than tensors and plain data ({why[0].strip() if why else 'unsupported content'})"
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 200 else first[:200] + "..."


__all__ = [
    "FORMAT",
    "StateFile",
    "StateFileError",
    "check_state_dict",
    "read_state_file",
    "state_from_dict",
    "write_state_file",
]
