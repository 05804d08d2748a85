"""State codec: a `State` <-> plain bytes + JSON-able metadata (never pickle).

Blob layout: the raw little-endian bytes of att_shift, ffn_shift, wkv (each C-contiguous), one
after the other. The metadata names the layout, the model shape signature, and each tensor's
dtype, shape, offset and byte count; the checksum is the SHA-256 of the blob (equal to
`State.checksum()` of the same state when it is stored in its working dtypes).

`wkv_dtype="float16"` stores an fp32 WKV tensor (99% of a state's bytes) as fp16, halving the
blob; the metadata keeps the working dtype (`as`) and decoding widens it back. Such a state is
not the one the model computed (docs/deployment.md: a rebuilt state is exact, a down-cast one is
not). General-purpose compressors were measured and not adopted (docs/performance.md).

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


class StateShapeError(StateCodecError):
    """The stored state belongs to another model shape (not a corruption: the task was made
    with another model)."""


@dataclass
class EncodedState:
    meta: dict[str, Any]
    data: bytes | bytearray
    checksum: str
    signature: str

    @property
    def nbytes(self) -> int:
        return len(self.data)


def encode_state(state: State, signature: str, *, wkv_dtype: str | None = None) -> EncodedState:
    """Serialize a batch-1 state (any device) to bytes + metadata. Each tensor is copied once,
    straight into the blob (from the device too): a 2.9B fp32 state is 21 MB. `wkv_dtype`
    (one of DTYPES, e.g. "float16"): store a wider WKV tensor in that dtype (lossy)."""
    import numpy
    import torch

    if state.batch_size != 1:
        raise ValueError(f"only batch-1 states are stored (got batch {state.batch_size})")
    if wkv_dtype is not None and wkv_dtype not in DTYPES:
        raise ValueError(f"unsupported storage dtype {wkv_dtype!r} (one of {DTYPES})")
    tensors: list[dict[str, Any]] = []
    stored: list[torch.Tensor] = []
    offset = 0
    for name, t in zip(NAMES, state.tensors()):
        dtype_name = _dtype_name(t.dtype)
        if dtype_name is None:
            raise ValueError(f"unsupported state dtype {t.dtype}")
        spec: dict[str, Any] = {"name": name, "dtype": dtype_name, "shape": list(t.shape)}
        if name == "wkv" and wkv_dtype is not None and _narrower(wkv_dtype, t):
            t = _convert(t, wkv_dtype)
            spec.update(dtype=wkv_dtype, **{"as": dtype_name})
        n = t.numel() * t.element_size()
        spec.update(offset=offset, nbytes=n)
        tensors.append(spec)
        stored.append(t)
        offset += n
    data = bytearray(offset)
    if offset:
        blob = torch.frombuffer(data, dtype=torch.uint8)  # (nbytes,) a view of `data`
        host = numpy.frombuffer(data, dtype=numpy.uint8)  # (nbytes,) the same bytes
        for spec, t in zip(tensors, stored):
            if spec["nbytes"]:
                raw = t.detach().contiguous().view(torch.uint8).reshape(-1)  # (nbytes,) no copy
                dst = slice(spec["offset"], spec["offset"] + spec["nbytes"])
                if raw.device.type == "cpu":
                    # numpy copies on this thread (GIL released): torch's CPU copy would wake its
                    # whole intra-op pool, whose spinning threads took cores from the engine
                    host[dst] = raw.numpy()
                else:
                    blob[dst].copy_(raw)  # from the device
    meta = {"layout": LAYOUT, "signature": signature, "byteorder": sys.byteorder, "tensors": tensors}
    return EncodedState(meta, data, hashlib.sha256(data).hexdigest(), signature)


def _convert(t: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """t in another dtype; a CPU tensor numpy knows is converted by numpy (one thread, as the
    copies above), anything else by torch."""
    import torch

    if t.device.type == "cpu" and dtype_name in _NUMPY and _dtype_name(t.dtype) in _NUMPY:
        return torch.from_numpy(t.detach().contiguous().numpy().astype(dtype_name))
    return t.to(getattr(torch, dtype_name))


_NUMPY = ("float32", "float16", "float64")
"""The stored dtypes numpy has (not bfloat16)."""


def _narrower(dtype_name: str, t: torch.Tensor) -> bool:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype_name)).element_size() < t.element_size()


def decode_state(meta: dict[str, Any], data: bytes, expected_signature: str, checksum: str | None = None) -> State:
    """Rebuild a CPU state (in its working dtypes); refuses another model's shape
    (StateShapeError), a foreign layout, a bad checksum or inconsistent metadata."""
    try:
        return _decode(meta, data, expected_signature, checksum)
    except StateCodecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # malformed metadata
        raise StateCodecError(f"stored state metadata is malformed: {type(exc).__name__}: {exc}") from None


def _decode(meta: dict[str, Any], data: bytes, expected_signature: str, checksum: str | None) -> State:
    import torch

    from server.model.state import State

    sig = meta.get("signature")
    if sig != expected_signature:
        raise StateShapeError(
            f"stored state belongs to model shape {sig!r}, but the loaded model is "
            f"{expected_signature!r}; it cannot be used with this model"
        )
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
        working = spec.get("as", spec["dtype"])
        if working not in DTYPES:
            raise StateCodecError(f"unknown dtype {working!r} in a stored state")
        off, n = int(spec["offset"]), int(spec["nbytes"])
        if off < 0 or off + n > len(buf):
            raise StateCodecError("stored state is shorter than its metadata says")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off) if n else torch.empty(0, dtype=torch.uint8)
        try:
            t = flat.view(getattr(torch, spec["dtype"])).reshape(spec["shape"])
        except RuntimeError as exc:  # the byte count does not fit the dtype and shape
            raise StateCodecError(f"stored tensor {name!r} does not match its metadata: {exc}") from None
        out.append(t if working == spec["dtype"] else t.to(getattr(torch, working)))
    if len(out) != 3:
        raise StateCodecError("stored state metadata does not list three tensors")
    return State(*out)
