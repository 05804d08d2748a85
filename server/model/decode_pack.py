"""Decode-time helpers: stacked projection weights (projections that share a launch) and a
side stream for the LoRAs, which run beside the big projections.

The decode step of one layer runs, per token, three (C, C) projections (r, k, v) and three
low-rank first stages (decay w1, in-context rate a1, value-mix v1) whose inputs are different
token-shift mixes of the same normalized x. At decode batch sizes each small GEMM costs a few
microseconds of ramp-up and tail no matter how little it computes (cuBLAS on the H200: 10.4 us
for one 2560x2560 projection at M=1, 6.3 us each when three run as one bmm), so the decode path
runs them as stacked (P, N, K) weights against (P, B, K) planes of the token-shift output:

    planes of add_ln_mix (mix rows permuted): 0 w, 1 a, 2 v, 3 k, 4 r, 5 g
    vkr   (3, C, C)   = [wv, wk, wr]             on planes 2..4   -> v, k, r
    lora1 (P, D, C)   = [w1^T, a1^T, v1^T]       on planes 0..2   -> decay/a/v-mix hidden
    lora2 (P, C, D)   = [w2^T, a2^T, v2^T]       on lora1's out   -> wz, az, vz

D = the largest of the three LoRA widths (smaller ones are zero-padded: zero rows/columns add
nothing); P = 2 in layer 0 (no value mix there). The layer's own fields (wr, wk, wv, w1, ...)
become views into these tensors, so the stacking costs no memory and prefill is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.model.checkpoint import LayerWeights

PLANE_ORDER = (1, 4, 3, 2, 0, 5)
"""Rows of LayerWeights.mix (x_r, x_w, x_k, x_v, x_a, x_g) in decode plane order w, a, v, k, r, g."""


@dataclass
class DecodePack:
    mix: torch.Tensor  # (6, C) mix rows in plane order
    vkr: torch.Tensor  # (3, C, C)
    lora1: torch.Tensor  # (P, D, C)
    lora2: torch.Tensor  # (P, C, D)
    g1: torch.Tensor  # (d_gate, C)  nn.Linear layout
    g2: torch.Tensor  # (C, d_gate)


def pack_layer(lw: LayerWeights) -> DecodePack:
    """Stack one layer's decode projections; lw's fields are re-pointed at the stacked storage."""
    vkr = torch.stack([lw.wv, lw.wk, lw.wr])  # (3, C, C)
    lw.wv, lw.wk, lw.wr = vkr.unbind(0)
    firsts = [lw.w1, lw.a1] + ([lw.v1] if lw.v1 is not None else [])  # each (C, d)
    seconds = [lw.w2, lw.a2] + ([lw.v2] if lw.v2 is not None else [])  # each (d, C)
    C, D = lw.w1.shape[0], max(t.shape[1] for t in firsts)
    lora1 = firsts[0].new_zeros(len(firsts), D, C)  # (P, D, C)
    lora2 = firsts[0].new_zeros(len(firsts), C, D)  # (P, C, D)
    for p, (t1, t2) in enumerate(zip(firsts, seconds)):
        d = t1.shape[1]
        lora1[p, :d].copy_(t1.t())
        lora2[p, :, :d].copy_(t2.t())
    views1 = [lora1[p, : t.shape[1]].t() for p, t in enumerate(firsts)]  # (C, d) views
    views2 = [lora2[p, :, : t.shape[1]].t() for p, t in enumerate(firsts)]  # (d, C) views
    lw.w1, lw.a1 = views1[0], views1[1]
    lw.w2, lw.a2 = views2[0], views2[1]
    if lw.v1 is not None:
        lw.v1, lw.v2 = views1[2], views2[2]
    g1, g2 = lw.g1.t().contiguous(), lw.g2.t().contiguous()  # (d_gate, C), (C, d_gate)
    lw.g1, lw.g2 = g1.t(), g2.t()
    return DecodePack(mix=lw.mix[list(PLANE_ORDER)].contiguous(), vkr=vkr, lora1=lora1, lora2=lora2, g1=g1, g2=g2)


class SideStream:
    """Fork/join of a side CUDA stream (captured by CUDA graphs as parallel branches). Memory
    allocated on the side stream is safe to reuse: every fork waits for all earlier work of the
    main stream, and the main stream waits for the side before reading its results."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream, self.main, self._ctx = stream, None, None

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
        if self.stream is not None:
            self.main.wait_stream(self.stream)
