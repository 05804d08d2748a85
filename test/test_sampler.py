"""Sampler: the documented formula (checked against a plain-Python reference), counter-based
randoms, penalties, batch invariance, and the CPU candidate shortcut."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import server.engine.sampler as S
from server.engine.sampler import SamplerSlots, splitmix64, uniform
from server.engine.types import SamplingParams

M64 = (1 << 64) - 1


def py_splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_uniform(seed: int, pos: int) -> float:
    return (py_splitmix((py_splitmix(seed & M64) + pos) & M64) >> 40) / (1 << 24)


def reference(z: list[float], p: SamplingParams, u: float) -> int:
    """The module docstring's formula, written plainly."""
    if p.temperature == 0:
        return max(range(len(z)), key=lambda i: z[i])
    zmax = max(z)
    e = [math.exp(v - zmax) for v in z]
    tot = sum(e)
    probs = [v / tot for v in e]
    order = sorted(range(len(z)), key=lambda i: -probs[i])
    cum, m = 0.0, len(order) - 1
    for r, i in enumerate(order):
        cum += probs[i]
        if cum >= p.top_p:
            m = r
            break
    cutoff = probs[order[m]]
    kept = [i for i in order if probs[i] >= cutoff]
    if p.top_k > 0:
        kept = kept[: p.top_k]
    top = kept[0]
    kept.sort()  # the draw walks the kept tokens in id order
    w = [math.exp((z[i] - z[top]) / p.temperature) for i in kept]
    target, acc = u * sum(w), 0.0
    for i, wi in zip(kept, w):
        acc += wi
        if acc > target:
            return i
    return kept[-1]


def slots_for(params: list[SamplingParams], vocab: int, seeds=None) -> SamplerSlots:
    s = SamplerSlots(len(params), vocab, "cpu")
    s.reset(range(len(params)), params, seeds or [p.seed or 0 for p in params])
    return s


def test_splitmix_matches_python():
    xs = [0, 1, 2, 12345678901234567, M64, 1 << 63, 0x9E3779B97F4A7C15]
    signed = [x - (1 << 64) if x >= 1 << 63 else x for x in xs]
    got = [v & M64 for v in splitmix64(torch.tensor(signed)).tolist()]
    assert got == [py_splitmix(x) for x in xs]
    seeds, pos = torch.tensor([0, 7, -3, 2**62]), torch.tensor([0, 5, 9, 1000])
    assert uniform(seeds, pos).tolist() == [py_uniform(s, q) for s, q in zip(seeds.tolist(), pos.tolist())]


def test_uniform_is_roughly_uniform():
    u = uniform(torch.full((20000,), 42), torch.arange(20000))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_matches_reference_formula(scale):
    V, B = 50, 24
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, V, generator=g) * scale
    params = [
        SamplingParams(temperature=[0.0, 0.5, 1.0, 1.7][i % 4], top_p=[0.0, 0.3, 0.8, 1.0][(i // 4) % 4],
                       top_k=[0, 3][i % 2], seed=1000 + i)
        for i in range(B)
    ]  # fmt: skip
    s = slots_for(params, V)
    pos = torch.arange(B) * 7
    tok = s.sample(logits, pos, torch.ones(B, dtype=torch.bool))
    for b in range(B):
        u = py_uniform(params[b].seed, int(pos[b]))
        assert tok[b].item() == reference(logits[b].tolist(), params[b], u), b


def test_greedy_top_p_zero_and_top_k_one_pick_the_argmax():
    V = 1000
    logits = torch.randn(3, V)
    no_pen = dict(presence_penalty=0, repetition_penalty=0)
    params = [SamplingParams(temperature=0, **no_pen), SamplingParams(top_p=0.0, seed=1, **no_pen),
              SamplingParams(top_k=1, top_p=1.0, seed=2, **no_pen)]  # fmt: skip
    for _ in range(3):
        s = slots_for(params, V)
        assert s.sample(logits, torch.arange(3), torch.ones(3, dtype=torch.bool)).tolist() == logits.argmax(-1).tolist()


def test_empirical_distribution_follows_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None].repeat(4000, 1)  # (N, 3)
    for temp in (1.0, 0.5):
        params = [SamplingParams(temperature=temp, top_p=1.0, seed=9)] * 4000
        s = slots_for(params, 3)
        tok = s.sample(logits, torch.arange(4000), torch.zeros(4000, dtype=torch.bool))
        freq = torch.bincount(tok, minlength=3).float() / 4000
        want = torch.tensor([0.5, 0.3, 0.2]) ** (1 / temp)
        assert torch.allclose(freq, want / want.sum(), atol=0.03), (temp, freq)


def test_same_token_alone_or_in_a_batch():
    V = 65536
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=g) * 2
    params = [SamplingParams(seed=77 + i) for i in range(64)]
    batch = slots_for(params, V).sample(logits, torch.arange(64), torch.ones(64, dtype=torch.bool))
    for b in (0, 13, 63):
        alone = slots_for([params[b]], V).sample(logits[b : b + 1], torch.tensor([b]), torch.ones(1, dtype=torch.bool))
        assert alone.item() == batch[b].item()


def _logit_cases(B: int, V: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    rnd = torch.randn(B, V, generator=g)
    peaked = rnd.clone()
    peaked[:, :5] += 12.0
    return {
        "normal1": rnd, "normal2": rnd * 2, "normal8": rnd * 8, "peaked": peaked,
        "flat": torch.zeros(B, V),  # every token tied: the kept set always reaches past any K
        "blocks": (rnd * 2).round(),  # many ties, also at the candidates' boundary
        "flat_top": torch.where(rnd > 2.5, 3.0, 0.0),  # a tied head of ~0.6% of the vocabulary
    }  # fmt: skip


def _params(B: int) -> list[SamplingParams]:
    return [
        SamplingParams(seed=i, temperature=[1.0, 0.7, 1.3, 0.0][i % 4], top_p=[0.3, 0.9, 1.0, 0.05, 0.0][i % 5],
                       top_k=[0, 0, 5000, 1, 5, 300][i % 6])
        for i in range(B)
    ]  # fmt: skip


@pytest.mark.parametrize("case", ["normal1", "normal2", "normal8", "peaked", "flat", "blocks", "flat_top"])
def test_candidates_equal_full_sort(case, monkeypatch):
    """The top-K fast path (+ exact widening) == a stable full sort of every row (the old sampler)."""
    V, B = 65536, 30
    logits = _logit_cases(B, V)[case]
    params = _params(B)
    fast_s = slots_for(params, V)
    fast = fast_s.sample(logits, torch.arange(B), torch.ones(B, dtype=torch.bool))
    monkeypatch.setattr(S, "CANDIDATES", ())
    full_s = slots_for(params, V)
    full = full_s.sample(logits, torch.arange(B), torch.ones(B, dtype=torch.bool))
    assert fast.tolist() == full.tolist()
    assert torch.equal(fast_s.penalty, full_s.penalty) and torch.equal(fast_s.seen, full_s.seen)


def test_graph_mode_marks_overflow_rows_and_resolve_finishes_them():
    """resolve=False (what runs inside a CUDA graph): overflow rows come back -1 with untouched
    penalties; resolve() on them gives the same tokens and penalties as sampling at once."""
    V, B = 4096, 12
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(5))
    logits[::2, :3] += 15.0  # even rows: a peaked head (fits the candidates); odd rows: flat-ish
    params = [SamplingParams(seed=i, top_p=0.9) for i in range(B)]
    pos, commit = torch.arange(B), torch.ones(B, dtype=torch.bool)
    ref_s, s = slots_for(params, V), slots_for(params, V)
    ref = ref_s.sample(logits, pos, commit)
    tok = s.sample(logits, pos, commit, resolve=False)
    rows = (tok < 0).nonzero().flatten()
    assert rows.tolist() == list(range(1, B, 2))
    assert s.penalty[rows].abs().sum() == 0 and not s.seen[rows].any()
    tok[rows] = s.resolve(logits, rows, pos, commit)
    assert tok.tolist() == ref.tolist()
    assert torch.equal(s.penalty, ref_s.penalty) and torch.equal(s.seen, ref_s.seen)


@pytest.mark.parametrize("case", ["normal2", "flat", "blocks", "flat_top"])
def test_small_candidates_match_reference_formula(case, monkeypatch):
    """Tiny candidate counts force every widening level; still the documented formula exactly
    (including ties: ranked by token id, as the reference's stable sort does)."""
    monkeypatch.setattr(S, "CANDIDATES", (4, 16))
    V, B = 200, 30
    logits = _logit_cases(B, V)[case]
    params = _params(B)
    no_pen = [SamplingParams(**{**p.__dict__, "presence_penalty": 0.0}) for p in params]
    pos = torch.arange(B) * 3
    tok = slots_for(no_pen, V).sample(logits, pos, torch.ones(B, dtype=torch.bool))
    for b in range(B):
        u = py_uniform(no_pen[b].seed, int(pos[b]))
        assert tok[b].item() == reference(logits[b].tolist(), no_pen[b], u), b


def test_penalty_formula_and_commit_mask():
    V = 8
    p = SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=0.25, penalty_decay=0.9)
    s = slots_for([p, p], V)
    logits = torch.zeros(2, V)
    seq = [3, 3, 5]
    for t in seq:  # steer the greedy choice with a big logit on t (row 0 commits, row 1 does not)
        lg = logits.clone()
        lg[:, t] = 100.0
        s.sample(lg, torch.zeros(2, dtype=torch.long), torch.tensor([True, False]))
    want = [0.0] * V
    seen = set()
    for t in seq:
        want = [w * 0.9 for w in want]
        want[t] += 0.25 if t in seen else 0.5
        seen.add(t)
    assert torch.allclose(s.penalty[0], torch.tensor(want)) and s.penalty[1].abs().sum() == 0
    assert s.seen[0].nonzero().flatten().tolist() == [3, 5]
    lg = torch.zeros(2, V)
    lg[:, 3] = 0.5  # 0.5 - penalty(3) < 0 - penalty(0): the penalty changes the greedy pick
    assert s.sample(lg, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)).tolist() == [0, 3]


@pytest.mark.parametrize("bad", ["nan", "inf", "one nan", "all -inf"])
@pytest.mark.parametrize("greedy", [False, True])
def test_a_row_with_nan_or_inf_logits_gets_the_nonfinite_token_alone(bad, greedy):
    """A model that overflowed on one row (an extreme state, NaN weights): that row's token is
    NONFINITE_TOKEN and only its decay touches its penalties; the other rows sample as they
    would without it (the torch sampler used to fail the whole step on an index of -1)."""
    V = 2000
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, V, generator=g) * 3
    params = [SamplingParams(seed=5 + i, temperature=0.0 if greedy else 1.0, penalty_decay=0.5) for i in range(4)]
    commit = torch.ones(4, dtype=torch.bool)
    clean = slots_for(params, V)
    clean.penalty[:] = 1.0
    want = clean.sample(logits, torch.arange(4), commit)
    spoiled = logits.clone()
    spoiled[2] = {"nan": float("nan"), "inf": float("inf"), "one nan": spoiled[2], "all -inf": float("-inf")}[bad]
    if bad == "one nan":
        spoiled[2, 17] = float("nan")
    s = slots_for(params, V)
    s.penalty[:] = 1.0
    got = s.sample(spoiled, torch.arange(4), commit)
    assert got[2].item() == S.NONFINITE_TOKEN
    assert got[[0, 1, 3]].tolist() == want[[0, 1, 3]].tolist()
    assert torch.equal(s.penalty[[0, 1, 3]], clean.penalty[[0, 1, 3]])
    assert torch.equal(s.penalty[2], torch.full((V,), 0.5)) and not s.seen[2].any()  # decayed, nothing counted


def test_move_and_reset_rows():
    V = 6
    s = slots_for([SamplingParams(temperature=0.3 * i, seed=i) for i in range(4)], V)
    s.penalty[3] = 1.0
    s.move([(0, 3), (1, 2)])
    assert torch.equal(s.penalty[0], torch.ones(V)) and s.iparams[0, 1] == 3 and s.iparams[1, 1] == 2
    s.reset([0], [SamplingParams(seed=-1 & M64)], [M64])
    assert s.penalty[0].sum() == 0 and s.iparams[0, 1] == -1


@pytest.mark.parametrize("temp, top_p, top_k", [(1.0, 1.0, 0), (1.0, 0.3, 0), (2.0, 1.0, 5), (0.0, 0.9, 0), (0.7, 0.95, 3)])
def test_masked_rows_sample_only_allowed_tokens_by_the_formula(temp, top_p, top_k):
    """Grammar masks set disallowed logits to -inf before sampling: the kept set, weights and
    draw follow the documented formula on the masked logits, never a disallowed token (also
    with top_p = 1, where the nucleus reaches the zero-probability tokens)."""
    from server.engine.grammar import pack_bits
    from server.engine.sampler import apply_token_bitmask

    V, B = 300, 32
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, V, generator=g) * 2
    allowed = torch.rand(B, V, generator=g) < 0.05
    allowed[torch.arange(B), torch.randint(0, V, (B,), generator=g)] = True
    apply_token_bitmask(logits, torch.stack([pack_bits(a) for a in allowed]), torch.arange(B))
    params = [SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=50 + i) for i in range(B)]
    pos = torch.arange(B) * 3
    tok = slots_for(params, V).sample(logits, pos, torch.ones(B, dtype=torch.bool))
    assert allowed[torch.arange(B), tok].all()
    for b in range(B):
        assert tok[b].item() == reference(logits[b].tolist(), params[b], py_uniform(params[b].seed, int(pos[b]))), b


@pytest.mark.parametrize("V", [1000, 131072, 300000])
def test_tied_rows_draw_in_id_order_past_the_int64_range(V, monkeypatch):
    """Every token tied, top_p = 1: each weighs exactly 1, so the id-order inverse CDF picks token
    floor(u * V). At V = 131,072 the fixed-point total is 2^63 (past int64: the sums are held as
    uint64 bits), at 300,000 the unit coarsens; both must still give that token."""
    monkeypatch.setattr(S, "CANDIDATES", ())
    B = 6
    params = [SamplingParams(top_p=1.0, seed=50 + i, presence_penalty=0, repetition_penalty=0) for i in range(B)]
    pos = torch.arange(B) * 11
    tok = slots_for(params, V).sample(torch.zeros(B, V), pos, torch.ones(B, dtype=torch.bool))
    want = [int(py_uniform(p.seed, int(q)) * V) for p, q in zip(params, pos)]
    assert tok.tolist() == want


def test_clamped_weights_past_2_63_keep_exact_sums(monkeypatch):
    """Weights reach their 1.9 clamp when the rank-0 token (the smallest id among the top p) has a
    lower z than tokens tied with it in p, and T is tiny: here token 0 weighs 1 and the other
    131,071 weigh 1.9 each, so the fixed-point cumulative sums pass 2^63 (held as uint64 bits).
    The token must be the exact integer inverse CDF's."""
    monkeypatch.setattr(S, "CANDIDATES", ())
    V, B = 131072, 4
    z = torch.full((B, V), 2.0**-30)
    z[:, 0] = 0.0
    p = torch.softmax(z, -1)
    assert (p == p[:, :1]).all(), "precondition: the row's p values tie in fp32"
    params = [SamplingParams(temperature=1e-12, top_p=1.0, seed=7 + i, presence_penalty=0, repetition_penalty=0)
              for i in range(B)]  # fmt: skip
    pos = torch.arange(B) * 5
    tok = slots_for(params, V).sample(z, pos, torch.ones(B, dtype=torch.bool))
    w1 = int(float(torch.tensor(1.9, dtype=torch.float32)) * 2**46)  # the clamp in 2^-46 units
    total = 2**46 + (V - 1) * w1
    assert total >= 2**63
    want = []
    for prm, q in zip(params, pos):
        t = math.floor(float(total) * py_uniform(prm.seed, int(q)))
        want.append(0 if t < 2**46 else 1 + (t - 2**46) // w1)  # the first cumulative sum > t
    assert tok.tolist() == want


# --- the parameter columns: one layout, the kernel's ----------------------------------------------
_KERNEL_NAMES = {"T": "temperature", "top_p": "top_p", "decay": "penalty_decay", "top_k": "top_k", "seed": "seed"}
"""kernels/sampler.cu's local names of the parameters it reads by column."""


def kernel_columns(array: str) -> dict[str, int]:
    """{SamplingParams name: column} of what kernels/sampler.cu reads from a.<array>, and each
    read's row stride as "stride" (one value, else the test fails)."""
    src = (Path(__file__).resolve().parents[1] / "kernels" / "sampler.cu").read_text()
    strides = set(re.findall(rf"a\.{array}\[row \* (\d+) \+ \d+\]", src))
    assert len(strides) == 1, strides
    cols = {_KERNEL_NAMES[n]: int(k) for n, k in re.findall(rf"\b(\w+) = a\.{array}\[row \* \d+ \+ (\d+)\]", src)}
    # the penalty update: repetition if the token was seen, else presence
    was = re.search(rf"was \? a\.{array}\[row \* \d+ \+ (\d+)\] : a\.{array}\[row \* \d+ \+ (\d+)\]", src)
    if was:
        cols.update(repetition_penalty=int(was.group(1)), presence_penalty=int(was.group(2)))
    return {**cols, "stride": int(strides.pop())}


def test_the_sampler_columns_are_the_kernels():
    """FPARAMS / IPARAMS (how the sampler builds and reads its parameter tensors) equal the
    kernel's layout constants, and those say what kernels/sampler.cu reads at each column."""
    from server.model.cuda_sampler import KERNEL_FPARAMS, KERNEL_IPARAMS

    assert S.FPARAMS == KERNEL_FPARAMS and S.IPARAMS == KERNEL_IPARAMS
    for array, layout in (("fparams", KERNEL_FPARAMS), ("iparams", KERNEL_IPARAMS)):
        assert kernel_columns(array) == {**{n: k for k, n in enumerate(layout)}, "stride": len(layout)}


def test_reset_writes_each_parameter_in_its_named_column():
    p = SamplingParams(temperature=0.25, top_p=0.5, top_k=7, presence_penalty=1.5, repetition_penalty=2.5,
                       penalty_decay=0.75)  # fmt: skip
    s = slots_for([p], 4)
    assert s.fparams[0].tolist() == [getattr(p, n) for n in S.FPARAMS]
    assert s.iparams[0, S.IPARAMS.index("top_k")] == 7 and s.iparams[0, S.IPARAMS.index("seed")] == 0


@pytest.mark.parametrize("what", ["fparams order", "iparams order"])
def test_a_layout_the_kernel_does_not_read_raises(what, monkeypatch):
    """Columns in another order than the kernel's are a programming error (ValueError naming both
    layouts), not a reason to fall back to the torch sampler."""
    from server.model.cuda_sampler import KERNEL_FPARAMS, KERNEL_IPARAMS

    S.check_kernel_layout(KERNEL_FPARAMS, KERNEL_IPARAMS)  # the real layouts agree
    if what == "fparams order":
        monkeypatch.setattr(S, "FPARAMS", S.FPARAMS[1::-1] + S.FPARAMS[2:])
    else:
        monkeypatch.setattr(S, "IPARAMS", S.IPARAMS[::-1])
    with pytest.raises(ValueError, match="KERNEL_") as e:
        S.check_kernel_layout(KERNEL_FPARAMS, KERNEL_IPARAMS)
    ours, kernel = (S.FPARAMS, KERNEL_FPARAMS) if what[0] == "f" else (S.IPARAMS, KERNEL_IPARAMS)
    assert str(ours) in str(e.value) and str(kernel) in str(e.value)


@pytest.mark.parametrize("what", ["fparams", "iparams"])
def test_fused_sample_raises_on_a_width_the_kernel_does_not_read(what):
    """A parameter tensor one column wider than the kernel reads: ValueError before anything
    needs a GPU (it was a silent fallback to the torch sampler)."""
    from server.model import cuda_sampler

    B, V = 2, 8
    fp, ip = torch.zeros(B, len(S.FPARAMS)), torch.zeros(B, len(S.IPARAMS), dtype=torch.long)
    if what == "fparams":
        fp = torch.zeros(B, len(S.FPARAMS) + 1)
    else:
        ip = torch.zeros(B, len(S.IPARAMS) + 1, dtype=torch.long)
    zeros = torch.zeros(B, dtype=torch.long)
    with pytest.raises(ValueError, match=f"KERNEL_{what[0].upper()}PARAMS"):
        cuda_sampler.fused_sample(torch.zeros(B, V), torch.zeros(B, V), torch.zeros(B, V, dtype=torch.bool), fp, ip,
                                  zeros, zeros.bool())  # fmt: skip
