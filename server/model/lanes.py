"""Two-lane decode: a large decode batch as two halves whose phases interleave on two CUDA streams.

The rows of a decode batch never interact, so the batch can run as halves A (rows [0, h)) and
B (rows [h, B)). `steps(x, state)` is the model's decode as a generator that yields between
phases (r/k/v projections, time-mix, output projection + FFN, per layer) and returns the logits.
Half A runs on the current stream; half B on a lane stream, each of its phases waiting for the
same phase of A to finish (an event). So B's projections (tensor cores) run beside A's time-mix
(HBM-bound state update), and B's time-mix beside A's FFN GEMMs, instead of every kernel of the
step waiting for the previous one. Inside a CUDA graph capture the events become graph edges.

Off by default (RWKV_TWO_LANE_MIN=0): an A/B switch until the H200 says it pays.
"""

from __future__ import annotations

import os
from typing import Callable, Generator

import torch

from server.model.state import State

TWO_LANE_MIN = int(os.environ.get("RWKV_TWO_LANE_MIN", "0"))
"""Decode batches of at least this many rows (even, on CUDA) run as two lanes; 0: never."""

Steps = Callable[[torch.Tensor, State], Generator[None, None, torch.Tensor]]
_lane_streams: dict[torch.device, torch.cuda.Stream] = {}


def run(gen: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Drive a decode generator to its end on the current stream; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def use_two_lanes(x: torch.Tensor) -> bool:
    """x: the (B, C) decode input."""
    B = x.shape[0]
    return x.is_cuda and TWO_LANE_MIN > 0 and B >= TWO_LANE_MIN and B % 2 == 0


def two_lanes(steps: Steps, x: torch.Tensor, state: State) -> torch.Tensor:
    """steps over rows [0, h) on the current stream and [h, B) on the lane stream, phase k of
    the second after phase k of the first; returns the logits of all rows (B, V)."""
    B, h = x.shape[0], x.shape[0] // 2
    main = torch.cuda.current_stream(x.device)
    lane = _lane_streams.get(x.device)
    if lane is None:
        lane = _lane_streams[x.device] = torch.cuda.Stream(x.device)
    lane.wait_stream(main)  # the inputs (x, the pool) are ready on the main stream
    a, b = steps(x[:h], state.view(0, h)), steps(x[h:], state.view(h, B))
    out_a = out_b = None
    while out_b is None:
        if out_a is None:
            try:
                next(a)
            except StopIteration as stop:
                out_a = stop.value
        done_a = torch.cuda.Event()
        done_a.record(main)
        with torch.cuda.stream(lane):
            lane.wait_event(done_a)
            try:
                next(b)
            except StopIteration as stop:
                out_b = stop.value
    main.wait_stream(lane)  # B's logits (made on the lane) are read on the main stream
    return torch.cat((out_a, out_b))  # (B, V)
