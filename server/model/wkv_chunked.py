"""The WKV-7 recurrence of a chunk of tokens in blocks of L tokens: each block's work in a few
batched matrix products, then one state step per block instead of one per token (the
pure-torch ops' prefill; the algebra a tensor-core prefill kernel would follow).

The step (server.model.ops, per sequence and head; S is (N_v, N_k)):

    S_t = S_{t-1} diag(d_t) + (S_{t-1} a_t) b_t^T + v_t k_t^T,   y_t = S_t r_t,   d_t = exp(-exp(w_t))

Inside a block starting from S_0, with g_t = d_1 * ... * d_t (elementwise, g_0 = 1) and the
"pseudo-values" u_t = S_{t-1} a_t, unrolling gives

    S_t = S_0 diag(g_t) + sum_{i<=t} (u_i b_i^T + v_i k_i^T) diag(g_t / g_i).

With a'_t = a_t g_{t-1}, b'_i = b_i / g_i, k'_i = k_i / g_i, r'_t = r_t g_t (rows of (L, N)
matrices A', B', K', R'), the u_t solve a unit lower-triangular system,

    (I - tril_strict(A' B'^T)) U = A' S_0^T + tril_strict(A' K'^T) V,

so U = W S_0^T + U_v with W, U_v from one triangular solve that does not need S_0. Then

    Y   = (R' + tril(R' B'^T) W) S_0^T + (tril(R' B'^T) U_v + tril(R' K'^T) V)  =  Q S_0^T + Y_in
    S_L = S_0 diag(g_L) + U^T B~ + (U_v^T B~ + V^T K~)                           =  S_0 diag(g_L) + U^T B~ + E

where B~ = B g_L / g and K~ = K g_L / g. W, Q, B~, Y_in and E are computed for every block at
once (`block_prep`: the record kernels/wkv7_blocks.cu writes per block); the loop over blocks
does two products each here, Y = Q S^T + Y_in and S <- S P + E with P = diag(g_L) + W^T B~
formed with the rest. The CUDA scan does three smaller ones instead (U = W S^T, then U^T B~):
the same product, without P's N x N x L per block in its preparation. Only ratios g_t / g_i
with i <= t enter the result, but 1 / g_i is formed on its own: the block's total decay must
stay within fp32's range. A model's tokens always do (w <= -0.5 gives d >= exp(-0.61):
g_L >= exp(-0.61 L)); other inputs whose decay falls below exp(-MAX_LOG_DECAY) within a block
go step by step (`fits` here; the CUDA kernels check each block on the device and run the
failing ones token by token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
"""Tokens per block (the L above)."""
MAX_LOG_DECAY = 60.0
"""The most a block's decay may fall, -log(g_L), for the blocked form (exp(60) ~ 1e26 stays far
inside fp32 after multiplying values of order 1e6)."""


def fits(w: torch.Tensor, block: int = BLOCK) -> bool:
    """Whether the blocked form may take log-log decays w (..., T, H, N) (a host sync): every
    block's decay stays above exp(-MAX_LOG_DECAY), bounded here by the strongest step's."""
    return bool(torch.exp(w.float().max()) * block <= MAX_LOG_DECAY)


class Blocks(NamedTuple):
    """block_prep's result: one entry per block, (nb, BH, ...) in the arithmetic's dtype."""

    w: torch.Tensor  # (nb, BH, L, N) W
    q: torch.Tensor  # (nb, BH, L, N) Q
    bt: torch.Tensor  # (nb, BH, L, N) B~
    y_in: torch.Tensor  # (nb, BH, L, N_v) Y_in (the scan adds Q S^T)
    e: torch.Tensor  # (nb, BH, N_v, N) E
    g: torch.Tensor  # (nb, BH, 1, N) g_L


def wkv_blocked(state: torch.Tensor, r, w, k, v, a, b, block: int = BLOCK, acc: torch.dtype = torch.float32):
    """ops.wkv_chunk's result by blocks (see the module doc): state (B, H, N, N) updated in
    place; r, w, k, v, a, b (B, T, H, N); returns y (B, T, H, N) in r.dtype. acc: the dtype of
    the arithmetic (float64 in the tests that check the algebra)."""
    B, T, H, N = r.shape
    blk = block_prep(r, w, k, v, a, b, block, acc)
    p = blk.w.mT @ blk.bt  # (nb, BH, N, N)
    p.diagonal(dim1=-2, dim2=-1).add_(blk.g.squeeze(2))  # P = diag(g_L) + W^T B~
    s = state.reshape(B * H, N, N).to(acc)  # (BH, N, N) a working copy
    for j in range(p.shape[0]):
        blk.y_in[j].baddbmm_(blk.q[j], s.mT)  # Y = Q S^T + Y_in
        s = torch.baddbmm(blk.e[j], s, p[j])  # S <- S P + E
    state.copy_(s.view(B, H, N, N))
    nb = p.shape[0]
    y = blk.y_in.view(nb, B, H, block, N).permute(1, 0, 3, 2, 4).reshape(B, nb * block, H, N)[:, :T]  # (B, T, H, N)
    return y.to(r.dtype)


def block_prep(r, w, k, v, a, b, block: int = BLOCK, acc: torch.dtype = torch.float32) -> Blocks:
    """Every block's W, Q, B~, Y_in, E and g_L at once from r, w, k, v, a, b (B, T, H, N)."""
    T, N = r.shape[1], r.shape[-1]
    L, nb = block, -(-T // block)
    seq = lambda t, fill=0.0: _blocks(t, nb, L, fill, acc)  # (nb, BH, L, N): a block's rows contiguous
    r_, k_, v_, a_, b_ = (seq(t) for t in (r, k, v, a, b))
    ld = -torch.exp(seq(w, float("-inf")))  # (nb, BH, L, N) log decay per step; padding: 0
    lg = ld.cumsum(2)  # log g_t
    last = lg[:, :, -1:]  # (nb, BH, 1, N) log g_L
    ra = r_ * lg.exp()  # R'
    aa = a_ * (lg - ld).exp()  # A'
    inv, tail = (-lg).exp(), (last - lg).exp()
    bb, kb = b_ * inv, k_ * inv  # B', K'
    bt, kt = b_ * tail, k_ * tail  # B~, K~
    m_ab, m_ak = torch.tril(aa @ bb.mT, -1), torch.tril(aa @ kb.mT, -1)  # (nb, BH, L, L), i < t
    m_rb, m_rk = torch.tril(ra @ bb.mT), torch.tril(ra @ kb.mT)  # i <= t
    eye = torch.eye(L, dtype=acc, device=r.device)
    wu = torch.linalg.solve_triangular(eye - m_ab, torch.cat((aa, m_ak @ v_), -1), upper=False, unitriangular=True)
    wa, uv = wu.split(N, -1)  # (nb, BH, L, N) W, U_v
    q = ra + m_rb @ wa  # (nb, BH, L, N)
    y_in = m_rb @ uv + m_rk @ v_  # (nb, BH, L, N)
    e = uv.mT @ bt + v_.mT @ kt  # (nb, BH, N, N)
    return Blocks(wa, q, bt, y_in, e, last.exp())


def _blocks(t: torch.Tensor, nb: int, L: int, fill: float, acc: torch.dtype) -> torch.Tensor:
    """(B, T, H, N) -> (nb, B*H, L, N) in acc, padded to nb * L tokens with `fill` (w = -inf,
    the rest 0: steps that leave the state as it is, decay 1 and nothing added)."""
    B, T, H, N = t.shape
    x = t.to(acc)
    if nb * L > T:
        x = torch.cat((x, x.new_full((B, nb * L - T, H, N), fill)), 1)
    return x.reshape(B, nb, L, H, N).permute(1, 0, 3, 2, 4).reshape(nb, B * H, L, N)
