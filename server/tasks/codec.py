"""State codec: a `State` <-> plain bytes + JSON-able metadata (never pickle).

Blob layout: the raw little-endian bytes of att_shift, ffn_shift, wkv (each C-contiguous), one
after the other. The metadata names the layout, the model shape signature, and each tensor's
dtype, shape, offset and byte count; the checksum is the SHA-256 of the blob (equal to
`State.checksum()` of the same state).

torch is imported when a state is first encoded or decoded, so `import server.tasks` stays light.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from server.model.state import State

LAYOUT = "rwkv7-state-v1:att_shift(L,B,C),ffn_shift(L,B,C),wkv(L,B,H,N,N)"
NAMES = ("att_shift", "ffn_shift", "wkv")
DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The state dtypes stored, by their torch names."""


def _dtype_name(dtype: torch.dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPES else None


class StateCodecError(ValueError):
    """A stored state cannot be decoded (corrupt, foreign layout, or another model's shape)."""


@dataclass
class EncodedState:
    meta: dict[str, Any]
    data: bytes | bytearray
    checksum: str
    signature: str

    @property
    def nbytes(self) -> int:
        return len(self.data)


def encode_state(state: State, signature: str) -> EncodedState:
    """Serialize a batch-1 state (any device) to bytes + metadata. Each tensor is copied once,
    straight into the blob (from the device too): a 2.9B fp32 state is 21 MB."""
    import torch
    if state.batch_size != 1:
        raise ValueError(f"only batch-1 states are stored (got batch {state.batch_size})")
    tensors: list[dict[str, Any]] = []
    offset = 0
    for name, t in zip(NAMES, state.tensors()):
        dtype_name = _dtype_name(t.dtype)
        if dtype_name is None:
            raise ValueError(f"unsupported state dtype {t.dtype}")
        n = t.numel() * t.element_size()
        tensors.append({"name": name, "dtype": dtype_name, "shape": list(t.shape),
                        "offset": offset, "nbytes": n})
        offset += n
    data = bytearray(offset)
    if offset:
        blob = torch.frombuffer(data, dtype=torch.uint8)  # (nbytes,) a view of `data`
        for spec, t in zip(tensors, state.tensors()):
            if spec["nbytes"]:
                raw = t.detach().contiguous().view(torch.uint8).reshape(-1)  # (nbytes,) no copy
                blob[spec["offset"]:spec["offset"] + spec["nbytes"]].copy_(raw)
    meta = {"layout": LAYOUT, "signature": signature, "byteorder": sys.byteorder,
            "tensors": tensors}
    return EncodedState(meta, data, hashlib.sha256(data).hexdigest(), signature)


def decode_state(meta: dict[str, Any], data: bytes, expected_signature: str,
                 checksum: str | None = None) -> State:
    """Rebuild a CPU state; refuses another model's shape, a foreign layout or a bad checksum."""
    import torch

    from server.model.state import State

    sig = meta.get("signature")
    if sig != expected_signature:
        raise StateCodecError(
            f"stored state belongs to model shape {sig!r}, but the loaded model is "
            f"{expected_signature!r}; it cannot be used with this model")
    if meta.get("layout") != LAYOUT:
        raise StateCodecError(f"unknown state layout {meta.get('layout')!r} (expected {LAYOUT!r})")
    if meta.get("byteorder", "little") != sys.byteorder:
        raise StateCodecError(f"state stored with byte order {meta.get('byteorder')}, host is {sys.byteorder}")
    if checksum is not None and hashlib.sha256(data).hexdigest() != checksum:
        raise StateCodecError("state blob checksum mismatch (the stored bytes are corrupt)")
    buf = bytearray(data)  # one writable copy; the tensors below are views of it
    out = []
    for spec, name in zip(meta.get("tensors", []), NAMES):
        if spec.get("name") != name:
            raise StateCodecError(f"state tensor {spec.get('name')!r} where {name!r} was expected")
        if spec["dtype"] not in DTYPES:
            raise StateCodecError(f"unknown dtype {spec['dtype']!r} in a stored state")
        off, n = int(spec["offset"]), int(spec["nbytes"])
        if off < 0 or off + n > len(buf):
            raise StateCodecError("stored state is shorter than its metadata says")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off) if n else torch.empty(0, dtype=torch.uint8)
        t = flat.view(getattr(torch, spec["dtype"])).reshape(spec["shape"])
        out.append(t)
    if len(out) != 3:
        raise StateCodecError("stored state metadata does not list three tensors")
    return State(*out)
