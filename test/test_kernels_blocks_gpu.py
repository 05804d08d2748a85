"""The blocked WKV-7 prefill kernels (kernels/wkv7_blocks.cu, taken by cuda_ops.wkv_chunk from
BLOCKS_MIN_T tokens) against the token-by-token kernel and the pure-torch step path: any
remainder after the last block, every dtype pair, strided inputs, and blocks whose decay is too
strong for the block form (run token by token inside the scan) mixed with ordinary blocks in one
call. Slots and lengths inside the pool: test_kernels_gpu.test_chunk_lengths_and_slots, with the
blocks on and off."""

from __future__ import annotations

import pytest
import torch
from test_kernels_gpu import STATE_DTYPES, _inputs, _rel, _state, _state_tol, _tol

from server.model import cuda_ops, ops

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
H, N = 4, 64  # as test_kernels_gpu's inputs


def _run(monkeypatch, blocked: bool, state, acts, **kw):
    monkeypatch.setattr(cuda_ops, "BLOCKS_MIN_T", 1 if blocked else None)
    return cuda_ops.wkv_chunk(state, *acts, **kw)


@pytest.mark.parametrize("B,T", [(1, 32), (1, 33), (2, 100), (3, 257), (1, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_blocks_match_steps(dev, monkeypatch, B, T, dtype, state_dtype):
    acts = _inputs((B, T), dtype, dev, seed=B * 7 + T)
    s0 = _state(B, state_dtype, dev, seed=T)
    s_blk, s_kern, s_ref = s0.clone(), s0.clone(), s0.clone()
    y_blk = _run(monkeypatch, True, s_blk, acts)
    y_kern = _run(monkeypatch, False, s_kern, acts)
    y_ref = ops.wkv_steps(s_ref, *acts)
    assert y_blk.shape == (B, T, H, N) and y_blk.dtype == dtype
    assert _rel(y_blk, y_ref) < _tol(dtype), _rel(y_kern, y_ref)
    assert _rel(s_blk, s_ref) < _state_tol(state_dtype), _rel(s_kern, s_ref)


def test_blocks_strided_inputs(dev, monkeypatch):
    """Activations as views of one (B, T, 6, C) buffer, w from another: the kernels' own strides."""
    B, T = 2, 96
    base = _inputs((B, T), torch.float16, dev, seed=31)
    big = torch.stack(base, 2).reshape(B, T, 6, H, N)  # (B, T, 6, H, N)
    wbuf = torch.zeros(B, T + 3, H, N, device=dev, dtype=torch.float16)
    wbuf[:, 3:] = base[1]
    acts = (big[:, :, 0], wbuf[:, 3:], big[:, :, 2], big[:, :, 3], big[:, :, 4], big[:, :, 5])
    s0 = _state(B, torch.float32, dev, seed=31)
    s_blk, s_ref = s0.clone(), s0.clone()
    y = _run(monkeypatch, True, s_blk, acts)
    y_ref = ops.wkv_steps(s_ref, *base)
    assert _rel(y, y_ref) < _tol(torch.float16)
    assert _rel(s_blk, s_ref) < 1e-5


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_blocks_strong_decay_go_token_by_token(dev, monkeypatch, state_dtype):
    """Decays a block form cannot take (exp(-exp(w)) near 0, and exactly 0) in some blocks of one
    sequence, ordinary ones elsewhere: every block right, none NaN."""
    B, T = 2, 160
    r, w, k, v, a, b = _inputs((B, T), torch.float32, dev, seed=41)
    w = w.clone()
    w[0, 40:50] = 2.5  # log decay -12 a token: block 1 falls past exp(-60)
    w[1, 100:101, :, :5] = 30.0  # decay 0 in a few channels
    acts = (r, w, k, v, a, b)
    s0 = _state(B, state_dtype, dev, seed=41)
    s_blk, s_ref = s0.clone(), s0.clone()
    y = _run(monkeypatch, True, s_blk, acts)
    y_ref = ops.wkv_steps(s_ref, *acts)
    assert _rel(y, y_ref) < 1e-5
    assert _rel(s_blk, s_ref) < _state_tol(state_dtype)


def test_blocks_in_cuda_graph_equal_eager(dev, monkeypatch):
    B, T = 2, 128
    acts = [t.clone() for t in _inputs((B, T), torch.float16, dev, seed=51)]
    s0 = _state(B, torch.float16, dev, seed=51)
    s_eager, s_graph = s0.clone(), s0.clone()
    y_eager = _run(monkeypatch, True, s_eager, acts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(monkeypatch, True, s0.clone(), acts)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_graph = _run(monkeypatch, True, s_graph, acts)
    s_graph.copy_(s0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y_eager) and torch.equal(s_graph, s_eager)
