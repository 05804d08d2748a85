"""Batched sampling on the device: one call per step, fixed shapes (B,), no host sync inside.

For row b with logits z (V,), per-slot penalty P (V,) and parameters (T, top_p, top_k,
presence, repetition, decay, seed), at generated-token index `pos`:

    z' = z - P                                         penalties (zero at the start of a request)
    greedy (T == 0):   t = argmax z'
    otherwise (the RWKV `sample_logits` convention: filter on the T=1 distribution, then T):
        p = softmax(z'); sort p descending (p_(1) >= p_(2) >= ...)
        top-p: cutoff = p_(m) with m the first rank whose cumulative sum >= top_p;
               keep tokens with p >= cutoff (ties kept; top_p = 0 keeps only the maximum)
        top-k: if top_k > 0 keep only the first top_k ranks
        weights w_i = (p_i / p_(1)) ** (1 / T) on the kept tokens (computed as exp((z'_i-z'_max)/T)),
                  each truncated to a multiple of 2^-46 (exact integer sums in any order)
        u = uniform(seed, pos) in [0, 1) (counter-based: splitmix64(splitmix64(seed) + pos))
        t = the first kept token IN ID ORDER whose cumulative weight exceeds floor(u * sum(w))
            (the inverse CDF; any order gives the same distribution, as torch.multinomial's;
            id order spares the kernel a select over the weights)
    then, only for rows that commit a real token:
        P *= decay;   P[t] += presence if t was not generated before in this request else repetition

Candidates (no full-vocabulary sort). The kept set is almost always tiny, so each row ranks only
its K = CANDIDATES[0] most probable tokens (torch.topk: a static shape, CUDA-graph safe), ordered
canonically (p descending, ties by token id ascending, as a stable sort of the whole row would).
The sorted values p_(1..K) are exactly the first K of the full sort (whatever tied tokens topk
picked), so cum, m and the cutoff are exact when m < K; only the identity of tokens tied with the
K-th value p_(K) is uncertain. A row is therefore exact unless its last kept rank has p <= p_(K)
(the kept set may reach p_(K) ties outside the candidates): such an "overflow" row (top-p mass of
the candidates < top_p, top_p = 1, flat logits, ...) is re-sampled from more candidates and finally
from a stable full sort of that row only. On the CPU this happens inside `sample`; on CUDA (where
`sample` runs inside a CUDA graph) `sample` returns -1 for those rows and leaves their penalties
untouched, and the caller runs `resolve(...)` afterwards (eager, only when a -1 came back).

Non-finite rows: a row whose z holds a NaN or +inf, or no finite value (the model overflowed: an
extreme state, NaN weights) samples nothing: its token is NONFINITE_TOKEN (-3), its penalties are
decayed (a commit row's, as every row's) but count no token; the scheduler fails that request
alone. The kernel does the same for rows with no finite z (all NaN: what an overflow gives, as
NaN spreads through the layer norms to every logit) and samples a row with only some NaN or
+inf z as its phases make of it.

Grammar masks (server.engine.grammar): a constrained row's disallowed tokens have their logits set
to -inf before `sample` (apply_token_bitmask, on the device); they get p = 0 and weight 0, so
no path above (greedy, top-p, top-k, the inverse CDF, the fused kernel) can pick one.

Penalties count only this request's generated tokens (not the prompt), like ChatRWKV/RWKV-Runner,
but the whole penalty decays (one (V,) tensor per slot; ChatRWKV's presence part never decays).
The random stream depends only on (seed, pos): a request gives the same tokens alone or in any
batch. Defaults (types.SamplingParams): the ChatRWKV RWKV-7 chat demo's (API_DEMO_CHAT), T=1.0,
top_p=0.3, top_k=0, presence 0.5, repetition (frequency) 0.5, decay 0.996.

Where it runs: on CUDA, `SamplerSlots.sample` is one kernel (kernels/sampler.cu via
server.model.cuda_sampler.fused_sample): exact (a stable full sort's result up to fp32 near ties,
see the kernel's header), never -1, so no resolve. The torch code here is the CPU path, the twin
the GPU tests compare the kernel with, and the fallback where the kernel cannot run (no kernels
built, a vocabulary over 131072).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .types import NONFINITE_TOKEN, OVERFLOW_TOKEN, SamplingParams

_U64 = 1 << 64


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def uniform(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform randoms in [0, 1) (float32, 24 random bits) for (seed, pos) pairs."""
    z = splitmix64(splitmix64(seed) + pos)  # (B,) int64
    return _srl(z, 40).to(torch.float32) * (1.0 / (1 << 24))


FPARAMS = ("temperature", "top_p", "presence_penalty", "repetition_penalty", "penalty_decay")
"""The per-slot float32 columns, by SamplingParams' names in the kernel's order (KERNEL_FPARAMS,
checked once per CUDA SamplerSlots: check_kernel_layout); indexed by name (_F)."""
IPARAMS = ("top_k", "seed")
"""The int64 ones, likewise (KERNEL_IPARAMS); `seed`: SamplingParams.seed or the engine's draw."""
_F = {name: i for i, name in enumerate(FPARAMS)}
_I = {name: i for i, name in enumerate(IPARAMS)}


def check_kernel_layout(kernel_f: Sequence[str], kernel_i: Sequence[str]) -> None:
    """ValueError naming both layouts when FPARAMS / IPARAMS are not the CUDA kernel's columns."""
    for what, ours, kernel in (("FPARAMS", FPARAMS, kernel_f), ("IPARAMS", IPARAMS, kernel_i)):
        if tuple(ours) != tuple(kernel):
            raise ValueError(f"sampler.{what} {ours} is not kernels/sampler.cu's {tuple(kernel)} (KERNEL_{what})")


CANDIDATES = (1024, 8192)
"""Candidate counts: the first is the static fast path (also inside CUDA graphs); rows that
overflow it are retried with the next counts, then with a stable full sort (same result).
1024 covers the nucleus of flat distributions too (random-weight models put ~200-450 tokens in a
top_p=0.3 nucleus, which made K=256 resolve nearly every row outside the graph).
() = always a full sort (the reference the candidates must equal)."""


class SamplerSlots:
    """Per-slot sampling state on the device: parameters and penalties (move with their slot)."""

    def __init__(self, slots: int, vocab: int, device: torch.device | str):
        self.penalty = torch.zeros(slots, vocab, dtype=torch.float32, device=device)  # (S, V)
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)  # (S, V)
        self.fparams = torch.zeros(slots, len(FPARAMS), dtype=torch.float32, device=device)  # (S, 5) FPARAMS
        self.iparams = torch.zeros(slots, len(IPARAMS), dtype=torch.long, device=device)  # (S, 2) IPARAMS
        self.device = torch.device(device)
        if self.device.type == "cuda":  # (once: the columns are constants)
            from server.model import cuda_sampler

            check_kernel_layout(cuda_sampler.KERNEL_FPARAMS, cuda_sampler.KERNEL_IPARAMS)

    def reset(self, slots: Sequence[int], params: Sequence[SamplingParams], seeds: Sequence[int]) -> None:
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        f = [[getattr(p, name) for name in FPARAMS] for p in params]
        i = [[_s64(s) if name == "seed" else getattr(p, name) for name in IPARAMS] for p, s in zip(params, seeds)]
        self.fparams.index_copy_(0, idx, torch.tensor(f, dtype=torch.float32).to(self.device))
        self.iparams.index_copy_(0, idx, torch.tensor(i, dtype=torch.long).to(self.device))
        self.penalty.index_fill_(0, idx, 0.0)
        self.seen.index_fill_(0, idx, False)

    def move(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy rows src -> dst for each (dst, src) pair (dst and src sets are disjoint)."""
        dst = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        src = torch.tensor([s for _, s in pairs], dtype=torch.long, device=self.device)
        for t in (self.penalty, self.seen, self.fparams, self.iparams):
            t.index_copy_(0, dst, t.index_select(0, src))

    def sample(
        self, logits: torch.Tensor, positions: torch.Tensor, commit: torch.Tensor, greedy_only: bool = False,
        resolve: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Sample one token for each of the first B slots; update their penalties in place.
        On CUDA: the fused kernel (exact, never -1). The torch sampler (CPU, or CUDA without the
        kernel) with resolve (default: on the CPU only) finishes overflow rows here (host
        syncs); otherwise they come back as -1 with untouched penalties (graph-safe) and
        `resolve()` finishes them."""
        B = logits.shape[0]
        if resolve is None:
            resolve = self.device.type == "cpu"
        args = (self.penalty[:B], self.seen[:B], self.fparams[:B], self.iparams[:B])
        if logits.is_cuda:
            from server.model import cuda_sampler  # deferred: no kernel build at import

            tok = cuda_sampler.fused_sample(logits, *args, positions, commit, greedy_only)
            if tok is not None:
                return tok
        tok = sample(logits, *args, positions, commit, greedy_only)
        if resolve:
            rows = (tok == OVERFLOW_TOKEN).nonzero().flatten()  # (R,) host sync
            if len(rows):
                tok[rows] = self.resolve(logits, rows, positions, commit)
        return tok

    def resolve(self, logits: torch.Tensor, rows, positions: torch.Tensor, commit: torch.Tensor) -> torch.Tensor:
        """Sample the given overflow rows exactly (more candidates, then a full sort) and update
        their penalties; returns their tokens (R,). logits/positions/commit: the step's (B, ...)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=logits.device)  # (R,)
        pen, fp, ip = self.penalty[rows], self.fparams[rows], self.iparams[rows]  # (R, V), (R, 5), (R, 2)
        z = logits[rows].float() - pen  # (R, V)
        tok = _sample_wide(z, fp, ip, positions[rows])  # (R,)
        seen = self.seen[rows]  # (R, V)
        _update_penalty(pen, seen, tok, fp, commit[rows])
        self.penalty[rows], self.seen[rows] = pen, seen
        return tok


def sample(
    logits: torch.Tensor,  # (B, V) fp32
    penalty: torch.Tensor,  # (B, V) fp32, updated in place
    seen: torch.Tensor,  # (B, V) bool, updated in place
    fparams: torch.Tensor,  # (B, 5) columns FPARAMS
    iparams: torch.Tensor,  # (B, 2) columns IPARAMS
    positions: torch.Tensor,  # (B,) long
    commit: torch.Tensor,  # (B,) bool: rows whose token is real (penalties update)
    greedy_only: bool = False,
) -> torch.Tensor:
    """One token per row, OVERFLOW_TOKEN (-1) for overflow rows (penalties untouched) and
    NONFINITE_TOKEN (-3) for rows with a NaN or +inf z, or no finite one (penalties decayed, no
    token counted). No host sync."""
    z = logits.float() - penalty  # (B, V)
    bad = ~(z < float("inf")).all(-1) | ~(z > float("-inf")).any(-1)  # (B,) a NaN or +inf; no finite z
    z = torch.where(bad[:, None], 0.0, z)  # (B, V) a row the sort and cumsum can walk
    if greedy_only:
        tok = z.argmax(-1)  # (B,)
    else:
        K = min(CANDIDATES[0], z.shape[1]) if CANDIDATES else z.shape[1]
        tok, overflow = _sample_top(z, fparams, iparams, positions, K)
        overflow = overflow & ~bad
        tok = torch.where(overflow, OVERFLOW_TOKEN, tok)  # (B,)
        commit = commit & ~overflow
    tok = torch.where(bad, NONFINITE_TOKEN, tok)  # (B,)
    _update_penalty(penalty, seen, tok.clamp(min=0), fparams, commit, counted=commit & ~bad)
    return tok


def _sample_top(z, fparams, iparams, pos, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample among the K most probable tokens of each row; also flag inexact (overflow) rows."""
    probs = torch.softmax(z, dim=-1)  # (B, V)
    if z.shape[1] <= K:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)  # (B, V) ties: ids ascending
        return _pick(z, sp, si, fparams, iparams, pos)[0], torch.zeros_like(pos, dtype=torch.bool)
    sp, si = probs.topk(K, dim=-1)  # (B, K) ties in any order
    si, perm = si.sort(dim=-1)  # (B, K) ids ascending
    sp, perm = sp.gather(1, perm).sort(dim=-1, descending=True, stable=True)  # (B, K) canonical order
    si = si.gather(1, perm)  # (B, K)
    return _pick(z, sp, si, fparams, iparams, pos)


def _sample_wide(z, fparams, iparams, pos) -> torch.Tensor:
    """Exact sampling for a few rows: more candidates, then a full sort (host checks between)."""
    V = z.shape[1]
    tok = torch.full_like(pos, -1)  # (R,)
    rows = torch.arange(len(pos), device=z.device)
    for k in CANDIDATES[1:] + (V,):
        t, overflow = _sample_top(z[rows], fparams[rows], iparams[rows], pos[rows], min(k, V))
        tok[rows] = t
        if k >= V or not overflow.any():
            break
        rows = rows[overflow]
    return tok


def _pick(z, sp, si, fparams, iparams, pos) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from the canonically sorted probabilities sp (B, K) of tokens si; also flag rows
    whose kept set may reach tokens outside the K candidates (ties with sp[:, -1]; K < V)."""
    K = sp.shape[1]
    temp, top_p = fparams[:, _F["temperature"]], fparams[:, _F["top_p"]]  # (B,)
    top_k, seed = iparams[:, _I["top_k"]], iparams[:, _I["seed"]]  # (B,)
    cum = sp.cumsum(dim=-1)  # (B, K)
    m = (cum < top_p[:, None]).sum(-1)  # (B,) rank of the top-p cutoff
    cutoff = sp.gather(1, m.clamp(max=K - 1)[:, None])  # (B, 1)
    rank = torch.arange(K, device=z.device)[None, :]  # (1, K)
    keep = (sp >= cutoff) & ((top_k[:, None] <= 0) | (rank < top_k[:, None]))  # (B, K), a prefix
    n_keep = keep.sum(-1, keepdim=True)  # (B, 1) >= 1
    last = sp.gather(1, n_keep - 1)  # (B, 1) value of the last kept rank
    overflow = (last <= sp[:, -1:]).squeeze(1) & (temp > 0) & (z.shape[1] > K)  # (B,)
    zs = z.gather(1, si)  # (B, K) sorted logits
    t_safe = torch.where(temp > 0, temp, torch.ones_like(temp))  # (B,)
    w = torch.exp((zs - zs[:, :1]) / t_safe[:, None]).clamp(max=_W_MAX)  # (B, K) fp32
    fix = 2.0 ** (46 - max(0, (K - 1).bit_length() - 17))  # the kernel's 2^46 for K <= 2^17
    wfix = (w * fix).to(torch.int64) * keep  # (B, K) truncated, as the kernel's __float2ull_rz
    # the inverse CDF in id order: the kept candidates by id (the others, weight 0, last)
    ids, perm = torch.where(keep, si, z.shape[1]).sort(dim=-1)  # (B, K)
    cdf = wfix.gather(1, perm).cumsum(dim=-1)  # (B, K) exact sums < 2^64, as uint64 bits in int64
    total = cdf[:, -1].double() + (cdf[:, -1] < 0) * 2.0**64  # (B,) their unsigned value (> 0)
    t = (total * uniform(seed, pos).double()).floor()  # (B,) < total, an integer in double
    t = torch.where(t >= 2.0**63, t - 2.0**64, t).to(torch.int64)  # (B,) the same uint64 bits
    # unsigned order as signed order: flip the sign bit of both sides
    idx = torch.searchsorted(cdf ^ _SIGN, (t ^ _SIGN)[:, None], right=True).clamp(max=K - 1)  # (B, 1) first cdf > t
    sampled = ids.gather(1, idx).squeeze(1)  # (B,)
    return torch.where((temp > 0) & (total > 0), sampled, z.argmax(-1)), overflow


_SIGN = -(2**63)
_W_MAX = 1.9
"""Weights are clamped here (only reachable when the rank-0 token is not the argmax by an exp
tie and T is tiny). With the fixed-point unit 2^-46, as the kernel, up to 2^17 weights sum below
2^64 exactly (wrapping int64 holds them as uint64 bits), so the sums do not depend on the order
they are added in; wider candidate sets (vocabularies the kernel does not cover) coarsen the unit."""


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[j], v] = -inf for every token v whose bit is 0 in bitmask[j] (in place; bit i
    of int32 word w is token 32w + i, the grammar library's layout). logits (B, V) any float
    dtype, bitmask (>= R, ceil(V/32)) int32, rows (R,) long, all on one device. No host sync."""
    R, V = rows.shape[0], logits.shape[1]
    if R == 0:
        return
    bits = _BITS.get(logits.device)
    if bits is None:  # (32,) int32: 1 << i (bit 31 is the sign bit)
        bits = _BITS[logits.device] = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                                   device=logits.device)  # fmt: skip
    banned = (bitmask[:R].unsqueeze(-1) & bits).eq(0).view(R, -1)[:, :V]  # (R, V)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(banned, float("-inf")))


def _update_penalty(
    penalty: torch.Tensor,
    seen: torch.Tensor,
    tok: torch.Tensor,
    fparams: torch.Tensor,
    commit: torch.Tensor,
    counted: torch.Tensor | None = None,
) -> None:
    """Commit rows decay their penalties; `counted` rows (default: commit; a non-finite row is
    decayed, as the kernel's load pass does, but has no token to count) add their token's."""
    counted = commit if counted is None else counted  # (B,)
    presence, repetition = fparams[:, _F["presence_penalty"]], fparams[:, _F["repetition_penalty"]]  # (B,)
    decay = fparams[:, _F["penalty_decay"]]  # (B,)
    penalty.mul_(torch.where(commit, decay, torch.ones_like(decay))[:, None])  # (B, V)
    t = tok[:, None]  # (B, 1)
    was_seen = seen.gather(1, t).squeeze(1)  # (B,)
    add = torch.where(was_seen, repetition, presence) * counted  # (B,)
    penalty.scatter_add_(1, t, add[:, None])
    seen.scatter_(1, t, (was_seen | counted)[:, None])
