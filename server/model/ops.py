"""Pure-PyTorch WKV-7 primitives and the decode time-mix core (the reference path; the CUDA
twins live in server.model.cuda_ops).

Conventions shared with the CUDA twins (same names, same signatures, same semantics):

    state: (B, H, N, N)  WKV matrix per sequence and head, state[b, h, i, j] with i = value
                         index (row) and j = key index (column); fp32 or fp16; updated IN PLACE
    r, w, k, v, a, b:    (B, H, N) for one step, (B, T, H, N) for a chunk; compute dtype
                         (all six the same dtype). w is the log-log decay of the official
                         kernels: the decay factor is exp(-exp(w)), w <= -0.5 for real tokens.

One step, for every (b, h):

    S <- S @ diag(exp(-exp(w))) + (S @ a) b^T + v k^T          y = S @ r

(the model passes a = -kk and b = kk * a_gate, as the official kernels do). The arithmetic is
done in fp32 whatever the input dtypes; y is returned in r.dtype.

A step with w = IDENTITY_W, k = 0, b = 0 leaves the state unchanged (decay 1, nothing added):
the model uses that to pad ragged batches, so these functions take no mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.model.qlinear import (
    QRows,
    QWeight,
    ScaledProduct,
    SparseCodes,
    Weight,
    dense_native,
    quant_rows_native,
    rows_fp8_native,
)
from server.model.wkv_chunked import fits, wkv_blocked

IDENTITY_W = -1.0e4  # exp(-exp(-1e4)) == 1.0 exactly in fp16/bf16/fp32
BLOCKED_MIN_T = 16
"""wkv_chunk's fewest tokens for the blocked form on CPU (below, the steps cost less)."""
BLOCKED_MAX_HEADS = 16
"""wkv_chunk's most sequences x heads for the blocked form on CPU: beyond, each step is already a
large vectorized op and the blocks' N x N products (twice the FLOPs) measured slower."""


def _as_bhnn(state: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous fp32 (B*H, N, N) working copy or view of state; flag: copy back needed."""
    B, H, N, _ = state.shape
    if state.dtype == torch.float32 and state.is_contiguous():
        return state.view(B * H, N, N), False
    return state.reshape(B * H, N, N).float().clone(), True


def _matvec(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """s (BH, N, N) @ x (BH, N, 1) -> (BH, N, 1). On CPU bmm with one column is much slower
    than a multiply-and-sum; on CUDA bmm avoids a (BH, N, N) temporary."""
    if s.is_cuda:
        return torch.bmm(s, x)
    return torch.mul(s, x.transpose(1, 2)).sum(-1, keepdim=True)


def _step(s: torch.Tensor, r, decay, k, v, a, b) -> torch.Tensor:
    """One WKV step on s (BH, N, N) fp32 in place.

    r, v, a: (BH, N, 1);  decay, k, b: (BH, 1, N) (all fp32).  Returns y: (BH, N, 1).
    """
    sa = _matvec(s, a)  # (BH, N, 1)
    s.mul_(decay)  # decay per key column j
    s.baddbmm_(sa, b)  # += (S a) b^T
    s.baddbmm_(v, k)  # += v k^T
    return _matvec(s, r)


def wkv_decode(state: torch.Tensor, r, w, k, v, a, b) -> torch.Tensor:
    """One token for B sequences.

    state: (B, H, N, N) updated in place;  r, w, k, v, a, b: (B, H, N);  returns y: (B, H, N).
    """
    B, H, N = r.shape
    s, copy_back = _as_bhnn(state)  # (BH, N, N) fp32
    col = lambda t: t.reshape(B * H, N, 1).float()  # (BH, N, 1)
    row = lambda t: t.reshape(B * H, 1, N).float()  # (BH, 1, N)
    decay = torch.exp(-torch.exp(row(w)))  # (BH, 1, N)
    y = _step(s, col(r), decay, row(k), col(v), col(a), row(b))  # (BH, N, 1)
    if copy_back:
        state.copy_(s.view(B, H, N, N))
    return y.view(B, H, N).to(r.dtype)


def wkv_chunk(state: torch.Tensor, r, w, k, v, a, b) -> torch.Tensor:
    """T tokens for B sequences (padding encoded as identity steps, see the module doc).

    state: (B, H, N, N) updated in place;  r, w, k, v, a, b: (B, T, H, N);
    returns y: (B, T, H, N) in r.dtype. On CPU, from BLOCKED_MIN_T tokens of at most
    BLOCKED_MAX_HEADS sequences x heads whose decays allow it, by blocks of tokens
    (server.model.wkv_chunked: a few batched products per block instead of four per token); else
    step by step. Not blocked on CUDA: the check of the decays reads them on the host (no capture
    in a CUDA graph), and the CUDA kernels run the prefill there."""
    B, T, H, _ = r.shape
    if not r.is_cuda and T >= BLOCKED_MIN_T and B * H <= BLOCKED_MAX_HEADS and fits(w):
        return wkv_blocked(state, r, w, k, v, a, b)
    return wkv_steps(state, r, w, k, v, a, b)


def wkv_steps(state: torch.Tensor, r, w, k, v, a, b) -> torch.Tensor:
    """wkv_chunk one token after another (any decays; the reference the blocks are tested by)."""
    B, T, H, N = r.shape
    s, copy_back = _as_bhnn(state)  # (BH, N, N) fp32

    def seq(t: torch.Tensor) -> torch.Tensor:  # (B, T, H, N) -> (T, BH, N) fp32, contiguous
        return t.float().permute(1, 0, 2, 3).reshape(T, B * H, N)

    decay = torch.exp(-torch.exp(seq(w))).unsqueeze(2)  # (T, BH, 1, N), all steps at once
    rs, as_, vs = seq(r).unsqueeze(-1), seq(a).unsqueeze(-1), seq(v).unsqueeze(-1)  # (T, BH, N, 1)
    ks, bs = seq(k).unsqueeze(2), seq(b).unsqueeze(2)  # (T, BH, 1, N)
    y = torch.empty(T, B * H, N, 1, dtype=torch.float32, device=r.device)  # (T, BH, N, 1)
    for t in range(T):
        y[t] = _step(s, rs[t], decay[t], ks[t], vs[t], as_[t], bs[t])
    if copy_back:
        state.copy_(s.view(B, H, N, N))
    return y.view(T, B, H, N).permute(1, 0, 2, 3).to(r.dtype)


def tmix_decode(state, r, k, v, wz, az, vz, v_first, g, lw, layer0: bool, gn_eps: float = 64e-5,
                bias: bool = False) -> torch.Tensor:  # fmt: skip
    """The decode time-mix core between the projections and the output projection (one
    launch in the CUDA twin, kernels/wkv7_tmix_fused.cu). r, k, v, g: (B, C); wz, az, vz: LoRA outputs
    with their biases (w0, a0, v0) added, or without them when bias=True (then lw.w0, lw.a0,
    lw.v0 are added here) (vz, v_first unused when layer0: may be None);
    lw: k_k, k_a, k_a1 (C,), r_k (H, N), lnx_w, lnx_b (C,). state (B, H, N, N) updated in place;
    returns (B, C) in r.dtype: the input of the output projection. The same arithmetic as the
    prefill's tmix_prep, one WKV step and tmix_post."""
    H = state.shape[1]
    vz, v_first = (None, None) if layer0 else (vz, v_first)
    w, k, v, a, b = tmix_prep(k, v, wz, az, vz, v_first, lw, H, bias=bias)
    y = wkv_decode(state, *(t.unflatten(-1, (H, -1)) for t in (r, w, k, v, a, b)))  # (B, H, N)
    return tmix_post(y.flatten(-2), r, k, v, g, lw, H, gn_eps)


# ---- elementwise ops of the prefill's time-mix (CUDA twins: kernels/prefill_elementwise.cu) -----
def token_mix(x: torch.Tensor, shift: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The token-shift mixes of a chunk: x (B, T, C) (layer-normed), shift (B, C) the input
    before each sequence's first token, mix (K, C) -> (K, B, T, C):
    out[k] = x + (prev - x) * mix[k], prev = x one token back (shift at t = 0)."""
    prev = torch.cat((shift.to(x.dtype).unsqueeze(1), x[:, :-1]), dim=1)  # (B, T, C)
    return torch.addcmul(x, prev - x, mix.view(mix.shape[0], 1, 1, -1))


def tmix_prep(k, v, wz, az, vz, v_first, lw, H: int, bias: bool = True):
    """The time-mix's inputs to the WKV recurrence from the projections, all (..., C): k, v
    (r/k/v products), wz, az, vz (the decay, in-context rate and value-mix LoRAs; vz and v_first
    None in layer 0), their biases lw.w0, a0, v0 added here (bias) or already (not bias); lw:
    k_k, k_a, k_a1 (C,). Returns (w, k', v', a, b): the log-log decay, the rescaled key, the value
    (mixed with v_first after layer 0), a = -kk and b = kk * sigmoid(a0 + az), kk the key's unit
    direction per head. The CUDA twin writes w, k', v', a over wz, k, v, az (the caller does not
    read those again)."""
    if bias:
        wz, az = lw.w0 + wz, lw.a0 + az
        vz = None if vz is None else lw.v0 + vz
    w = F.logsigmoid(wz) - 0.5  # == -softplus(-z) - 0.5
    a = torch.sigmoid(az)
    kk = F.normalize((k * lw.k_k).unflatten(-1, (H, -1)), dim=-1).flatten(-2)
    k = k * torch.addcmul(lw.k_a1, a, lw.k_a)  # k * (1 + (a - 1) * k_a)
    if vz is not None:
        v = torch.lerp(v, v_first, torch.sigmoid(vz))
    return w, k, v, -kk, kk * a


def tmix_post(y, r, k, v, g, lw, H: int, eps: float = 64e-5) -> torch.Tensor:
    """The time-mix's output before its projection, all (..., C): the WKV output y normalized
    per head (lw.lnx_w, lnx_b), plus each head's bonus sum(r k' r_k) times v', times the gate."""
    hd = lambda t: t.unflatten(-1, (H, -1))  # (..., C) -> (..., H, N)
    y = F.group_norm(y.reshape(-1, y.shape[-1]), H, lw.lnx_w, lw.lnx_b, eps=eps).view_as(y)
    y = y + ((hd(r) * hd(k) * lw.r_k).sum(-1, keepdim=True) * hd(v)).flatten(-2)
    return y * g


# ---- fused elementwise ops of the decode step (CUDA twins: kernels/fused_elementwise.cu) ------
def add_ln_mix(x, dx: torch.Tensor | ScaledProduct | None, ln_w, ln_b, mix, shift,
               eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Residual add + LayerNorm + token-shift mixes of one decode step, all (B, C) rows:

        x' = x + dx (x itself when dx is None; a ScaledProduct's value added in fp32, rounded once)
        xn = layer_norm(x', ln_w, ln_b, eps)
        shift (None, or (B, C) updated in place): prev = shift, then shift <- xn
        mix None: out = xn (B, C);  mix (K, C): out[k] = xn + (prev - xn) * mix[k]  (K, B, C)

    Returns (x', out). The CUDA twin writes x' to a new tensor (x is never modified)."""
    if isinstance(dx, ScaledProduct):
        x = (x.float() + dx.value()).to(x.dtype)
    elif dx is not None:
        x = x + dx
    xn = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps)
    if mix is None:
        if shift is not None:
            shift.copy_(xn)
        return x, xn
    prev = shift.to(xn.dtype) - xn
    out = torch.addcmul(xn, prev, mix.view(mix.shape[0], 1, -1))  # (K, B, C)
    shift.copy_(xn)
    return x, out


def add_ln_mix_q(x, dx: torch.Tensor | ScaledProduct | None, ln_w, ln_b, mix, shift, nq: int, keep: int,
                 eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, QRows]:  # fmt: skip
    """add_ln_mix whose last nq planes also come back as e4m3 rows (QRows (nq, B, C) codes, (nq, B,
    1) scales: quant_rows_native of those planes), for the fp8 products that read them
    (linear_q); out holds only the planes k < keep: (keep, B, C). The CUDA twin writes the codes
    from the same pass (no plane it quantizes is stored in 16 bits unless k < keep)."""
    x, out = add_ln_mix(x, dx, ln_w, ln_b, mix, shift, eps)  # (K, B, C)
    K, B, C = out.shape
    q, s = quant_rows_native(out[K - nq :].reshape(-1, C))  # (nq * B, C), (nq * B, 1)
    return x, out[:keep], QRows(q.view(nq, B, C), s.view(nq, B, 1))


def quantizes_rows(w: Weight, rows: int) -> bool:
    """Whether w's product of `rows` rows reads them quantized to e4m3 (so that add_ln_mix_q and
    linear_q may serve it). Here never: the pure-torch products use the rows as they are."""
    return False


def linear_q(x: QRows, w: QWeight) -> torch.Tensor:
    """linear() of rows already quantized (x (M, K) or planes (P, M, K), w fp8 (N, K) / (P, N, K))
    -> (M, N) / (P, M, N): the fp8 x fp8 product of the codes, scaled (qlinear.rows_fp8_native)."""
    return rows_fp8_native(x, w)


def relu_square(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2 (the channel-mix activation); the CUDA twin works in place on h."""
    return torch.relu(h).square()


def relu2_linear(h: torch.Tensor, w: Weight, wt: SparseCodes | None = None) -> torch.Tensor:
    """linear(relu_square(h), w): the channel-mix's second projection with its activation (the
    CUDA twin fuses the activation into the small-batch projection; h may be changed in place).
    wt: w transposed (LayerWeights.ffn_value_t), which the CUDA twin's one-row product reads
    skipping the zero inputs; the same product, not read here."""
    return linear(relu_square(h), w)


def residual_linear(x: torch.Tensor, w: Weight, wt: SparseCodes | None = None,
                    act: bool = False) -> torch.Tensor | ScaledProduct:  # fmt: skip
    """relu2_linear(x, w, wt) (act) or linear(x, w) for a product whose only use is add_ln_mix's
    dx (the output projection, the FFN value projection): the CUDA twin may return an fp8
    product as a ScaledProduct, whose scales add_ln_mix applies. Here always the tensor."""
    return relu2_linear(x, w, wt) if act else linear(x, w)


def lora_act(hw: torch.Tensor, hg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tanh(hw), sigmoid(hg)) in place: the decay and gate LoRA activations (one launch on
    CUDA); returns (hw, hg)."""
    return hw.tanh_(), hg.sigmoid_()


def dense(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x (..., K) @ w^T -> (..., N) for a 2-D weight (N, K), 16-bit or 8-bit (QWeight: its
    dequantized value; the CUDA twin multiplies the codes)."""
    return dense_native(x, w)


def linear(x: torch.Tensor, w: Weight, rows=None, cols=None) -> torch.Tensor:
    """x @ w^T with w in the nn.Linear layout (out, in):
    x (M, K), w (N, K) -> (M, N);  stacked: x (P, M, K), w (P, N, K) -> (P, M, N) (plane p
    uses weight p). The CUDA twin takes a hand-written matrix-vector kernel for small M.
    rows / cols: zero-padding hints for stacked planes of different widths: plane p's weight
    rows from rows[p] on (or its columns from cols[p] on) are zero. The product here is the same
    with or without them; the CUDA twin's kernel skips reading the padding. An 8-bit w (QWeight)
    is dequantized first."""
    if isinstance(w, QWeight):
        w = w.dequantize()
    if x.dim() == 2:
        return F.linear(x, w)
    return torch.bmm(x, w.transpose(1, 2))  # (P, M, N)
