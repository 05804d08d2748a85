"""Parity of the prefill time-mix's elementwise kernels (cuda_prefill.token_mix, tmix_prep,
tmix_post; kernels/prefill_elementwise.cu) with their pure-torch twins (server.model.ops), and
of a model's prefill through them with the same prefill through the twins."""

from __future__ import annotations

import types

import pytest
import torch

from server.model import cuda_ops, cuda_prefill, ops

H, N = 4, 64
C = H * N
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else (1e-2 if dtype == torch.bfloat16 else 2e-3)


def _gen(seed: int, dev, dtype):
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731


def _layer(dev, dtype, seed: int):
    rnd = _gen(seed, dev, dtype)
    k_a = 1 + 0.1 * rnd(C)
    return types.SimpleNamespace(
        w0=0.3 * rnd(C) - 1.0, a0=0.3 * rnd(C), v0=0.3 * rnd(C), k_k=1 + 0.1 * rnd(C), k_a=k_a, k_a1=1 - k_a,
        r_k=0.1 * rnd(H, N), lnx_w=1 + 0.1 * rnd(C), lnx_b=0.1 * rnd(C),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (1, 300), (3, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 6])
def test_token_mix_matches_twin(B, T, dtype, K):
    dev = torch.device("cuda")
    assert cuda_ops.available(dev)
    rnd = _gen(B * 100 + T + K, dev, dtype)
    x = rnd(B, T, C)
    pool = rnd(B + 2, C)
    shift = pool[1 : B + 1]  # rows of a pool (a view, as the state's shift rows)
    mix = torch.rand(K, C, generator=torch.Generator().manual_seed(K)).to(dev, dtype)
    ref = ops.token_mix(x, shift, mix)
    got = cuda_prefill.token_mix(x, shift, mix)
    assert got.shape == (K, B, T, C) and got.dtype == dtype
    assert _rel(got, ref) < _tol(dtype)  # a row mixed with the wrong previous token is off by ~1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer0", [True, False])
def test_tmix_prep_matches_twin(rows, dtype, layer0):
    dev = torch.device("cuda")
    lw = _layer(dev, dtype, rows)
    rnd = _gen(rows + 1, dev, dtype)
    k, v, wz, az, vz, vf = (rnd(rows, C) for _ in range(6))
    wz = wz * 0.5 - 1.0
    vz, vf = (None, None) if layer0 else (vz, vf)
    ref = ops.tmix_prep(k, v, wz, az, vz, vf, lw, H)
    ins = [t.clone() for t in (k, v, wz, az)]
    got = cuda_prefill.tmix_prep(*ins, vz, vf, lw, H)
    assert got[0].data_ptr() == ins[2].data_ptr() and got[1].data_ptr() == ins[0].data_ptr()  # over wz, k
    for name, g, r in zip("wkvab", got, ref):
        assert g.shape == (rows, C) and g.dtype == dtype, name
        assert _rel(g, r) < _tol(dtype), name
    if layer0:
        assert torch.equal(got[2], v)  # v untouched in layer 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tmix_post_matches_twin(rows, dtype):
    dev = torch.device("cuda")
    lw = _layer(dev, dtype, rows + 3)
    rnd = _gen(rows + 5, dev, dtype)
    y, r, k, v, g = (rnd(rows, C) for _ in range(5))
    y = y * 3 + 0.5
    ref = ops.tmix_post(y, r, k, v, g, lw, H)
    got = cuda_prefill.tmix_post(y.view(rows, H, N), r, k, v, g, lw, H)  # y as the WKV kernel returns it
    assert got.shape == (rows, C) and got.dtype == dtype
    assert _rel(got, ref) < _tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_prefill_through_the_kernels_matches_the_twins(state_dtype):
    """A ragged prefill on pool slots with the three kernels against the same model with their
    pure-torch twins (everything else the same CUDA ops); then a decode step from both states."""
    from server.model import load_model

    dev = torch.device("cuda")
    a = load_model("synthetic:tiny", device=dev, dtype=torch.float16, state_dtype=state_dtype)
    b = load_model("synthetic:tiny", device=dev, dtype=torch.float16, state_dtype=state_dtype)
    assert a.ops.tmix_decode is cuda_ops.tmix_decode  # the CUDA ops
    names = ("token_mix", "tmix_prep", "tmix_post")
    a.ops = types.SimpleNamespace(**{**vars(a.ops), **{n: getattr(cuda_prefill, n) for n in names}})
    b.ops = types.SimpleNamespace(**{**vars(a.ops), **{n: getattr(ops, n) for n in names}})
    prompts = [list(range(1, 40)), [7], list(range(50, 61))]
    s1, s2 = a.zero_state(5), b.zero_state(5)
    l1 = a.forward(prompts, s1, slots=[4, 0, 2])
    l2 = b.forward(prompts, s2, slots=[4, 0, 2])
    assert _rel(l1, l2) < 1e-2
    assert _rel(s1.wkv, s2.wkv) < 1e-2 and _rel(s1.att_shift, s2.att_shift) < 1e-2
    assert (s1.wkv[[1, 3]] == 0).all()  # the slots not named stay as they were
    tok = torch.tensor([1, 2, 3, 4, 5], device=dev)
    assert _rel(a.decode(tok, s1), b.decode(tok, s2)) < 1e-2
