"""Decode-time helpers: stacked projection weights (projections that share a launch) and a
side stream for the LoRAs, which run beside the big projections.

The decode step of one layer runs, per token, three (C, C) projections (r, k, v) and four
low-rank LoRAs (gate g1/g2, decay w1/w2, in-context rate a1/a2, value mix v1/v2) whose inputs
are different token-shift mixes of the same normalized x. At decode batch sizes each small GEMM
costs its launch, ramp-up and tail no matter how little it computes, so the decode path runs
them as stacked (P, N, K) weights against (P, B, K) planes of the token-shift output:

    planes of add_ln_mix (mix rows permuted): 0 g, 1 w, 2 a, 3 v, 4 k, 5 r
    vkr   (3, C, C)   = [wv, wk, wr]                    on planes 3..5   -> v, k, r
    lora1 (Q, D, C)   = [g1^T, w1^T, a1^T, v1^T]        on planes 0..Q-1 -> gate/decay/a/v-mix hidden
    lora2 (Q, C, D)   = [g2^T, w2^T, a2^T, v2^T]        on lora1's out   -> gate, wz, az, vz

D = the largest width stacked (smaller ones are zero-padded: zero rows/columns add nothing to
the real outputs, and the small-batch gemv does not read them: ops.linear's rows / cols hints
from DecodePack.widths); no value mix in layer 0 (Q = 3). So the four LoRAs are 2 launches, for
more (padded) FLOPs than 4 separate ones (docs/performance.md has the measurements); from
LORA_APART_MIN_ROWS rows, 4 launches on two streams (the gate's, and the others' at their width). The layer's
own fields (wr, wk, wv, w1, ...) become views into these tensors, so prefill is unchanged; the
padding is the only extra memory (~7 MB per layer at 2.9B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.model import qlinear
from server.model.checkpoint import LayerWeights
from server.model.qlinear import QWeight, Weight

LORA_APART_MIN_ROWS = 1024
"""From this many rows (batch) the decode runs the gate's LoRA apart from the others, on a stream
of its own, and stacks the others at their own widest width instead of the gate's
(DecodePack.gate_apart): there each stage's products fill few SMs, so two side by side take less
than one padded launch (docs/performance.md, "The decode LoRAs with the gate apart")."""

PLANE_ORDER = (5, 1, 4, 3, 2, 0)
"""Rows of LayerWeights.mix (x_r, x_w, x_k, x_v, x_a, x_g) in decode plane order g, w, a, v, k, r."""


@dataclass
class DecodePack:
    mix: torch.Tensor  # (6, C) mix rows in plane order
    vkr: Weight  # (3, C, C); 8-bit codes with (3, C) scales when the model is quantized
    lora1: torch.Tensor  # (Q, D, C) gate, decay, a[, v-mix]
    lora2: torch.Tensor  # (Q, C, D)
    widths: tuple[int, ...] = ()  # each plane's own LoRA width (<= D; the rest is zero padding)

    def gate_apart(self, rows: int) -> int:
        """The width d at which the LoRAs after the gate stack when the gate's runs apart (the
        views lora1[1:, :d] and lora2[1:, :, :d]), or 0: one stacked launch a stage. Apart from
        LORA_APART_MIN_ROWS rows, where the gate is the widest LoRA (its planes are then whole)."""
        if rows < LORA_APART_MIN_ROWS or len(self.widths) < 2 or self.widths[0] != self.lora1.shape[1]:
            return 0
        return max(self.widths[1:])


def pack_layer(lw: LayerWeights) -> DecodePack:
    """Stack one layer's decode projections; lw's fields are re-pointed at the stacked storage."""
    vkr: Weight
    ws = (lw.wv, lw.wk, lw.wr)
    qs = [w for w in ws if isinstance(w, QWeight)]
    ts = [w for w in ws if not isinstance(w, QWeight)]
    if len(qs) == 3:
        vkr = qlinear.stack(qs)  # (3, C, C) codes, (3, C) scales
        lw.wv, lw.wk, lw.wr = (vkr.plane(p) for p in range(3))
    elif len(ts) == 3:
        vkr = torch.stack(ts)  # (3, C, C)
        lw.wv, lw.wk, lw.wr = vkr.unbind(0)
    else:
        raise ValueError("r, k and v must be quantized alike")
    names = ["g", "w", "a"] + (["v"] if lw.v1 is not None else [])
    firsts = [getattr(lw, n + "1") for n in names]  # each (C, d)
    seconds = [getattr(lw, n + "2") for n in names]  # each (d, C)
    C, D = firsts[0].shape[0], max(t.shape[1] for t in firsts)
    lora1 = firsts[0].new_zeros(len(firsts), D, C)  # (Q, D, C)
    lora2 = firsts[0].new_zeros(len(firsts), C, D)  # (Q, C, D)
    for p, (n, t1, t2) in enumerate(zip(names, firsts, seconds)):
        d = t1.shape[1]
        lora1[p, :d].copy_(t1.t())
        lora2[p, :, :d].copy_(t2.t())
        setattr(lw, n + "1", lora1[p, :d].t())  # (C, d) view
        setattr(lw, n + "2", lora2[p, :, :d].t())  # (d, C) view
    mix = lw.mix[list(PLANE_ORDER)].contiguous()
    widths = tuple(t.shape[1] for t in firsts)
    return DecodePack(mix=mix, vkr=vkr, lora1=lora1, lora2=lora2, widths=widths)


class SideStream:
    """Fork/join of a side CUDA stream (captured by CUDA graphs as parallel branches). Memory
    allocated on the side stream is safe to reuse: every fork waits for all earlier work of the
    main stream, and the main stream waits for the side before reading its results."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self.main: torch.cuda.Stream | None = None  # the forking stream, set on entry
        self._ctx: torch.cuda.StreamContext | None = None

    def __enter__(self):
        if self.stream is not None:
            self.main = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(self.main)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False

    def join(self) -> None:
        if self.stream is not None and self.main is not None:
            self.main.wait_stream(self.stream)


def side_streams(device: torch.device, n: int, owned: dict[int, list[torch.cuda.Stream]]) -> list[SideStream]:
    """n side streams forked from the current stream (SideStream contexts), off CUDA n no-op ones.
    owned: the caller's streams per current stream's handle, so that each current stream has its
    own (work on different streams stays independent) and callers never share one."""
    if device.type != "cuda":
        return [SideStream(None) for _ in range(n)]
    have = owned.setdefault(torch.cuda.current_stream(device).cuda_stream, [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device))
    return [SideStream(s) for s in have[:n]]
