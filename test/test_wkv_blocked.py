"""The WKV recurrence by blocks (server.model.wkv_chunked): the same result as the token-by-token
recurrence, checked in float64 against a loop written here (the algebra) and in fp32 against
ops.wkv_chunk's step-by-step path (what the model ran before), across block edges, padding and
the dtypes the model uses."""

from __future__ import annotations

import pytest
import torch

from server.model import ops
from server.model.wkv_chunked import BLOCK, block_prep, fits, wkv_blocked


def _inputs(B: int, T: int, H: int = 2, N: int = 64, seed: int = 0, strongest: float = 0.61):
    """The model's kind of inputs: decay exp(-exp(w)) with exp(w) in (0, strongest], a = -kk and
    b = kk * rate for a unit kk."""
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    w = torch.log(torch.rand(B, T, H, N, generator=g) * strongest + 1e-6)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    rate = torch.rand(B, T, H, N, generator=g)
    return [r, w, k, v, -kk, kk * rate]


def _recurrence64(s0: torch.Tensor, r, w, k, v, a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """S <- S diag(exp(-exp(w))) + (S a) b^T + v k^T; y = S r, token by token in float64."""
    S, ys = s0.double().clone(), []
    for t in range(r.shape[1]):
        rt, wt, kt, vt, at, bt = (x[:, t].double() for x in (r, w, k, v, a, b))  # (B, H, N)
        sa = S @ at.unsqueeze(-1)  # (B, H, N, 1)
        S = S * torch.exp(-torch.exp(wt)).unsqueeze(-2) + sa * bt.unsqueeze(-2) + vt.unsqueeze(-1) * kt.unsqueeze(-2)
        ys.append((S @ rt.unsqueeze(-1)).squeeze(-1))
    return torch.stack(ys, 1), S


@pytest.mark.parametrize("B,T", [(1, 1), (2, 5), (1, BLOCK), (3, BLOCK + 1), (2, 3 * BLOCK - 7), (1, 4 * BLOCK)])
def test_blocks_give_the_recurrence_exactly_in_float64(B: int, T: int):
    """The algebra: in float64 the blocked form equals the recurrence to rounding, whatever T's
    remainder after the last whole block."""
    x = _inputs(B, T, seed=T)
    s0 = torch.randn(B, 2, 64, 64, dtype=torch.float64) * 0.3
    y_ref, s_ref = _recurrence64(s0, *x)
    s = s0.clone()
    y = wkv_blocked(s, *(t.double() for t in x), acc=torch.float64)
    assert y.shape == (B, T, 2, 64) and y.dtype == torch.float64
    assert (y - y_ref).abs().max() <= 1e-10 * y_ref.abs().max()
    assert (s - s_ref).abs().max() <= 1e-10 * s_ref.abs().max()


def test_the_cuda_scans_form_of_the_records_gives_the_recurrence():
    """kernels/wkv7_blocks.cu reads the same records but steps the state as U = W S^T, then
    S diag(g_L) + U^T B~ + E, and writes y = Q S^T + Y_in: in float64, the recurrence."""
    B, T, H, N = 2, 3 * BLOCK - 5, 2, 64
    x = [t.double() for t in _inputs(B, T, seed=7)]
    s0 = torch.randn(B, H, N, N, dtype=torch.float64) * 0.3
    y_ref, s_ref = _recurrence64(s0, *x)
    blk = block_prep(*x, acc=torch.float64)
    s, ys = s0.reshape(B * H, N, N), []
    for j in range(blk.q.shape[0]):
        ys.append(blk.q[j] @ s.mT + blk.y_in[j])  # (BH, L, N_v)
        u = blk.w[j] @ s.mT  # (BH, L, N_v)
        s = s * blk.g[j] + u.mT @ blk.bt[j] + blk.e[j]
    y = torch.stack(ys).view(-1, B, H, BLOCK, N).permute(1, 0, 3, 2, 4).reshape(B, -1, H, N)[:, :T]
    assert (y - y_ref).abs().max() <= 1e-10 * y_ref.abs().max()
    assert (s.view(B, H, N, N) - s_ref).abs().max() <= 1e-10 * s_ref.abs().max()


def test_the_strongest_decay_a_model_gives_stays_in_range():
    """Every step at the model's strongest decay (w = -0.5: d = exp(-0.61)) over many blocks:
    the block's 1 / g stays finite, the result is the recurrence's."""
    x = _inputs(1, 5 * BLOCK, seed=3)
    x[1] = torch.full_like(x[1], -0.5)
    assert fits(x[1])
    s0 = torch.randn(1, 2, 64, 64, dtype=torch.float64)
    y_ref, s_ref = _recurrence64(s0, *x)
    s = s0.clone()
    y = wkv_blocked(s, *(t.double() for t in x), acc=torch.float64)
    assert torch.isfinite(y).all()
    assert (y - y_ref).abs().max() <= 1e-9 * y_ref.abs().max()
    assert (s - s_ref).abs().max() <= 1e-9 * s_ref.abs().max()


@pytest.mark.parametrize("state_dtype,act_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                   (torch.float32, torch.bfloat16)])  # fmt: skip
def test_fp32_blocks_match_the_step_by_step_path(state_dtype, act_dtype):
    """What the model gets: fp32 arithmetic, the state in its dtype, y in the inputs' dtype; the
    difference from the step-by-step path is fp32 rounding (and the state dtype's, once)."""
    B, T = 2, 2 * BLOCK + 9
    x = [t.to(act_dtype) for t in _inputs(B, T, seed=7)]
    s0 = (torch.randn(B, 2, 64, 64) * 0.3).to(state_dtype)
    s_steps, s_blocks = s0.clone(), s0.clone()
    y_steps = ops.wkv_steps(s_steps, *x)
    y_blocks = wkv_blocked(s_blocks, *x)
    assert y_blocks.dtype == act_dtype and s_blocks.dtype == state_dtype
    tol = 1e-5 if state_dtype == act_dtype == torch.float32 else 1e-2
    assert (y_blocks.float() - y_steps.float()).abs().max() <= tol * y_steps.float().abs().max()
    assert (s_blocks.float() - s_steps.float()).abs().max() <= tol * s_steps.float().abs().max()


def test_padding_steps_inside_a_block_leave_the_state_as_it_is():
    """The model pads ragged batches with identity steps (w = IDENTITY_W, k = b = 0): a sequence
    padded from T = 20 to 40 ends in the state of its 20 tokens alone."""
    r, w, k, v, a, b = _inputs(1, 40, seed=5)
    w[:, 20:], k[:, 20:], b[:, 20:] = ops.IDENTITY_W, 0, 0
    s0 = torch.randn(1, 2, 64, 64)
    s_pad, s_short = s0.clone(), s0.clone()
    wkv_blocked(s_pad, r, w, k, v, a, b)
    y = wkv_blocked(s_short, *(t[:, :20] for t in (r, w, k, v, a, b)))
    assert (s_pad - s_short).abs().max() <= 1e-5 * s_short.abs().max()
    y_pad = wkv_blocked(s0.clone(), r, w, k, v, a, b)
    assert (y_pad[:, :20] - y).abs().max() <= 1e-5 * y.abs().max()


def test_wkv_chunk_takes_blocks_only_where_they_are_safe():
    """ops.wkv_chunk: blocks for a long chunk of the model's decays; a decay too strong for a
    block's 1 / g (here exp(-exp(4)) per step) goes step by step, finite and exact."""
    B, T = 1, 3 * BLOCK
    x = _inputs(B, T, seed=11)
    s0 = torch.randn(B, 2, 64, 64) * 0.3
    y_ref, s_ref = _recurrence64(s0, *x)
    s = s0.clone()
    y = ops.wkv_chunk(s, *x)
    assert (y.double() - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    x[1][0, 17, 1, 5] = 4.0  # one step's decay factor exp(-e^4) ~ 1e-24: a block's g underflows
    assert not fits(x[1])
    y_ref, s_ref = _recurrence64(s0, *x)
    s = s0.clone()
    y = ops.wkv_chunk(s, *x)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    assert (y.double() - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    assert (s.double() - s_ref).abs().max() <= 1e-5 * s_ref.abs().max()


def test_strided_inputs_and_a_pool_slice_of_states():
    """The model hands views (a head split of a wider product, a slice of the state pool): the
    blocked form reads them as they are and writes the slice in place."""
    B, T = 2, BLOCK + 3
    wide = [torch.cat((t, torch.randn_like(t)), -1) for t in _inputs(B, T, seed=13)]  # (B, T, H, 2N)
    x = [t[..., :64] for t in wide]  # non-contiguous (B, T, H, N)
    x[1] = torch.clamp(x[1], max=-0.5)  # (the padding column may hold any w)
    assert not x[0].is_contiguous()
    pool = torch.randn(4, 2, 64, 64) * 0.3  # (slots, H, N, N)
    y_ref, s_ref = _recurrence64(pool[::2], *x)
    y = wkv_blocked(pool[::2], *x)  # (rows 0 and 2: not contiguous)
    assert (y.double() - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    assert (pool[::2].double() - s_ref).abs().max() <= 1e-5 * s_ref.abs().max()
