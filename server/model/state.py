"""Model shape and the per-sequence recurrent state of RWKV-7.

Layout (shared by the model, the engine's slot pool, the kernels and the task store):

    att_shift: (L, B, C)       last input of each time-mix block      (compute dtype)
    ffn_shift: (L, B, C)       last input of each channel-mix block   (compute dtype)
    wkv:       (L, B, H, N, N) WKV matrix per head, wkv[l, b, h, i, j] with i = value index
                               (row) and j = key index (column), the same orientation as the
                               `rwkv` package's state; dtype fp32 or fp16 (state_dtype)

The batch axis comes second so that the first B slots of a pool are one contiguous block per
layer: decoding the active prefix [0, B) works on views, with no gather or copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    n_layer: int  # L
    n_embd: int  # C
    n_head: int  # H
    head_size: int  # N (64 for all official models)
    vocab_size: int  # V
    ffn_dim: int  # 4C for official models
    d_decay: int  # low-rank width of w1/w2
    d_aaa: int  # low-rank width of a1/a2
    d_mv: int  # low-rank width of v1/v2
    d_gate: int  # low-rank width of g1/g2

    def signature(self) -> str:
        """A short string that identifies the state layout; stored with every saved state."""
        return f"rwkv7-L{self.n_layer}-C{self.n_embd}-H{self.n_head}-N{self.head_size}"

    def state_bytes(self, shift_dtype: torch.dtype, wkv_dtype: torch.dtype) -> int:
        """Bytes of one sequence's state."""
        shift = 2 * self.n_layer * self.n_embd * _itemsize(shift_dtype)
        wkv = self.n_layer * self.n_head * self.head_size**2 * _itemsize(wkv_dtype)
        return shift + wkv


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class State:
    """Recurrent state of B sequences (see the module docstring for the layout)."""

    att_shift: torch.Tensor  # (L, B, C)
    ffn_shift: torch.Tensor  # (L, B, C)
    wkv: torch.Tensor  # (L, B, H, N, N)

    @classmethod
    def zeros(
        cls,
        shape: ModelShape,
        batch: int,
        device: torch.device | str = "cpu",
        shift_dtype: torch.dtype = torch.float32,
        wkv_dtype: torch.dtype = torch.float32,
    ) -> State:
        L, C, H, N = shape.n_layer, shape.n_embd, shape.n_head, shape.head_size
        return cls(
            att_shift=torch.zeros(L, batch, C, device=device, dtype=shift_dtype),
            ffn_shift=torch.zeros(L, batch, C, device=device, dtype=shift_dtype),
            wkv=torch.zeros(L, batch, H, N, N, device=device, dtype=wkv_dtype),
        )

    @property
    def batch_size(self) -> int:
        return self.wkv.shape[1]

    @property
    def device(self) -> torch.device:
        return self.wkv.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.att_shift, self.ffn_shift, self.wkv)

    def view(self, start: int, stop: int) -> State:
        """Slots [start, stop) as views (writes go to this state)."""
        return State(self.att_shift[:, start:stop], self.ffn_shift[:, start:stop], self.wkv[:, start:stop])

    def gather(self, slots: Sequence[int] | torch.Tensor) -> State:
        """A new state holding copies of the given slots, in that order."""
        idx = _index(slots, self.device)
        return State(*(t.index_select(1, idx) for t in self.tensors()))

    def scatter(self, src: State, slots: Sequence[int] | torch.Tensor) -> None:
        """Copy src's sequences (batch = len(slots)) into the given slots, converting dtypes."""
        idx = _index(slots, self.device)
        for dst, s in zip(self.tensors(), src.tensors()):
            dst.index_copy_(1, idx, s.to(device=dst.device, dtype=dst.dtype))

    def copy_slot(self, dst: int, src: int) -> None:
        """Copy one slot onto another in place (used to keep active slots a prefix)."""
        for t in self.tensors():
            t[:, dst].copy_(t[:, src])

    def zero_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        idx = _index(slots, self.device)
        for t in self.tensors():
            t.index_fill_(1, idx, 0)

    def clone(self) -> State:
        return State(*(t.clone() for t in self.tensors()))

    def to(self, device: torch.device | str | None = None, non_blocking: bool = False) -> State:
        return State(*(t.to(device=device, non_blocking=non_blocking) for t in self.tensors()))

    def checksum(self) -> str:
        h = hashlib.sha256()
        for t in self.tensors():
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _index(slots: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.long)
    return torch.tensor(list(slots), device=device, dtype=torch.long)
