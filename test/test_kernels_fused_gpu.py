"""Parity of the fused decode kernels (cuda_ops.tmix_decode, add_ln_mix, relu_square, lora_act)
with their pure-torch twins (server.model.ops), and of the model's fused decode path with its
unfused one."""

from __future__ import annotations

import types

import pytest
import torch

from server.model import cuda_ops, ops

H, N = 4, 64
C = H * N


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _layer(dtype, dev, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    c = h * N
    lw = types.SimpleNamespace(
        k_k=1 + 0.1 * rnd(c), k_a=1 + 0.1 * rnd(c),
        r_k=0.1 * rnd(h, N), lnx_w=1 + 0.1 * rnd(c), lnx_b=0.1 * rnd(c),
        w0=0.3 * rnd(c) - 1.0, a0=0.3 * rnd(c), v0=0.3 * rnd(c),
    )  # fmt: skip
    for n, t in vars(lw).items():
        setattr(lw, n, t.to(device=dev, dtype=dtype))
    lw.k_a1 = 1 - lw.k_a  # (the twin's form of the key's rescale, as LayerWeights has it)
    return lw


def _acts(B, dtype, dev, seed, h=H):
    g = torch.Generator().manual_seed(seed + 7)
    xs = [torch.randn(B, h * N, generator=g) * s for s in (1, 1, 1, 0.5, 0.5, 0.5, 1, 1)]
    xs[3] = xs[3] - 2.0  # wz: realistic decays
    return [x.to(device=dev, dtype=dtype) for x in xs]


PIPE_MIN_B = cuda_ops.TMIX_PIPE_MIN_B  # the default route


def _tmix_path(monkeypatch, path: str) -> None:
    """Route cuda_ops.tmix_decode: "auto" (the default: the pipelined kernel for a 16-bit state
    from TMIX_PIPE_MIN_B rows on, else the head-per-block kernel), "head" (the head-per-block
    kernel at every batch), "pipe" (the pipelined kernel at every batch for a 16-bit state; an fp32
    state always runs the head kernel)."""
    monkeypatch.setattr(cuda_ops, "TMIX_PIPE_MIN_B", {"auto": PIPE_MIN_B, "head": 1 << 30, "pipe": 1}[path])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 33, 130])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layer0", [True, False])
@pytest.mark.parametrize("path", ["auto", "head", "pipe"])
@pytest.mark.parametrize("bias", [False, True])
def test_tmix_decode_matches_twin(B, dtype, state_dtype, layer0, path, bias, monkeypatch):
    _tmix_path(monkeypatch, path)
    dev = torch.device("cuda")
    assert cuda_ops.available(dev)
    lw = _layer(dtype, dev, seed=B)
    r, k, v, wz, az, vz, v_first, g = _acts(B, dtype, dev, seed=B)
    s0 = (torch.randn(B, H, N, N, generator=torch.Generator().manual_seed(B)) * 0.3).to(dev, state_dtype)
    s_ref, s_cu = s0.clone(), s0.clone()
    args = (r, k, v, wz, az, None if layer0 else vz, None if layer0 else v_first, g, lw, layer0)
    ref = ops.tmix_decode(s_ref, *args, bias=bias)
    got = cuda_ops.tmix_decode(s_cu, *args, bias=bias)
    tol = 1e-4 if dtype == torch.float32 else (3e-2 if dtype == torch.bfloat16 else 1e-2)
    assert got.shape == (B, C) and got.dtype == dtype
    assert _rel(got, ref) < tol
    assert _rel(s_cu, s_ref) < (1e-4 if dtype == torch.float32 else tol)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layer0", [True, False])
def test_tmix_decode_head_size_32(B, dtype, state_dtype, layer0):
    """Head sizes under 64 run the head kernel with 2 state rows per thread (a build of its own:
    the kernels are compiled per head size)."""
    dev, h, n = torch.device("cuda"), 8, 32
    assert cuda_ops.available(dev, head_size=n)
    g = torch.Generator().manual_seed(B + 32)
    lw = types.SimpleNamespace(k_k=1 + 0.1 * torch.randn(h * n, generator=g), k_a=1 + 0.1 * torch.randn(h * n, generator=g),
                               r_k=0.1 * torch.randn(h, n, generator=g), lnx_w=1 + 0.1 * torch.randn(h * n, generator=g),
                               lnx_b=0.1 * torch.randn(h * n, generator=g), w0=0.3 * torch.randn(h * n, generator=g) - 1.0,
                               a0=0.3 * torch.randn(h * n, generator=g), v0=0.3 * torch.randn(h * n, generator=g))  # fmt: skip
    for name, t in vars(lw).items():
        setattr(lw, name, t.to(device=dev, dtype=dtype))
    lw.k_a1 = 1 - lw.k_a
    xs = [(torch.randn(B, h * n, generator=g) * sc).to(dev, dtype) for sc in (1, 1, 1, 0.5, 0.5, 0.5, 1, 1)]
    xs[3] = xs[3] - 2.0  # wz: realistic decays
    r, k, v, wz, az, vz, v_first, gate = xs
    s0 = (torch.randn(B, h, n, n, generator=g) * 0.3).to(dev, state_dtype)
    s_ref, s_cu = s0.clone(), s0.clone()
    args = (r, k, v, wz, az, None if layer0 else vz, None if layer0 else v_first, gate, lw, layer0)
    ref = ops.tmix_decode(s_ref, *args, bias=True)
    got = cuda_ops.tmix_decode(s_cu, *args, bias=True)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert got.shape == (B, h * n) and _rel(got, ref) < tol
    assert _rel(s_cu, s_ref) < max(tol, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [64, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layer0", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["head", "pipe"])
def test_tmix_on_a_pool_view_matches_twin(B, dtype, state_dtype, layer0, bias, path, monkeypatch):
    """Each kernel vs ops.tmix_decode on a state that is a strided view of a pool (every other
    slot): the other slots stay untouched."""
    dev = torch.device("cuda")
    assert cuda_ops.available(dev)
    lw = _layer(dtype, dev, seed=B + 1)
    r, k, v, wz, az, vz, v_first, g = _acts(B, dtype, dev, seed=B + 1)
    s0 = (torch.randn(B, H, N, N, generator=torch.Generator().manual_seed(B + 1)) * 0.3).to(dev, state_dtype)
    pool = (torch.randn(2 * B + 1, H, N, N, generator=torch.Generator().manual_seed(3)) * 0.3).to(dev, state_dtype)
    pool[1::2] = s0
    pool0 = pool.clone()
    s_cu = pool[1::2]  # (B, H, N, N), batch stride 2*H*N*N: not contiguous
    assert not s_cu.is_contiguous()
    s_ref = s0.clone()
    args = (r, k, v, wz, az, None if layer0 else vz, None if layer0 else v_first, g, lw, layer0)
    ref = ops.tmix_decode(s_ref, *args, bias=bias)
    _tmix_path(monkeypatch, path)
    got = cuda_ops.tmix_decode(s_cu, *args, bias=bias)
    assert got.shape == (B, C) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else (3e-2 if dtype == torch.bfloat16 else 1e-2)
    assert _rel(got, ref) < tol
    assert _rel(s_cu, s_ref) < (1e-4 if dtype == torch.float32 else tol)
    assert torch.equal(pool[0::2], pool0[0::2])  # slots outside the view untouched


@pytest.mark.gpu
@pytest.mark.parametrize("B", [130, 1024])
def test_tmix_pipe_blocks_per_sm_cap_is_the_same_bits(B, monkeypatch):
    """The pipelined kernel's blocks-per-SM cap (cuda_ops.TMIX_PIPE_PER_SM) changes only which
    block takes which head: every cap gives the full wave's output and new state bit for bit, and
    a cap over what fits is the full wave. The 2.9B head count, fp16 activations and state."""
    dev, h = torch.device("cuda"), 40
    _tmix_path(monkeypatch, "pipe")
    lw = _layer(torch.float16, dev, seed=5, h=h)
    acts = _acts(B, torch.float16, dev, seed=5, h=h)
    s0 = (torch.randn(B, h, N, N, generator=torch.Generator().manual_seed(5)) * 0.3).to(dev, torch.float16)
    outs = {}
    for cap in (0, 1, 2, 3, 4, 5, 64):
        monkeypatch.setattr(cuda_ops, "TMIX_PIPE_PER_SM", cap)
        s = s0.clone()
        outs[cap] = (cuda_ops.tmix_decode(s, *acts, lw, layer0=False, bias=True), s)
    out0, s_full = outs[0]
    assert not torch.equal(s_full, s0)  # the step ran
    for cap, (out, s) in outs.items():
        assert torch.equal(out, out0) and torch.equal(s, s_full), cap


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["auto", "head", "pipe"])
def test_tmix_model_shape(state_dtype, path, monkeypatch):
    """The 2.9B head count (H=40, C=2560), B=64 and B=300, fp16 activations, bias in the kernel:
    each route vs the twin and vs the head kernel, three chained steps (the state feeds the next
    step)."""
    dev = torch.device("cuda")
    h = 40
    lw = _layer(torch.float16, dev, seed=5, h=h)
    for B in (64, 300):
        s_ref = (torch.randn(B, h, N, N, generator=torch.Generator().manual_seed(B)) * 0.3).to(dev, state_dtype)
        s_hd, s_cu = s_ref.clone(), s_ref.clone()
        for t in range(3):
            r, k, v, wz, az, vz, v_first, g = _acts(B, torch.float16, dev, seed=B + t, h=h)
            args = (r, k, v, wz, az, vz, v_first, g, lw, False)
            ref = ops.tmix_decode(s_ref, *args, bias=True)
            _tmix_path(monkeypatch, "head")
            head = cuda_ops.tmix_decode(s_hd, *args, bias=True)
            _tmix_path(monkeypatch, path)
            got = cuda_ops.tmix_decode(s_cu, *args, bias=True)
            assert _rel(got, ref) < 1e-2 and _rel(s_cu, s_ref) < 1e-2
            assert _rel(got, head) < 1e-4 and _rel(s_cu, s_hd) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("B", [3, 700, 2001])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layer0", [True, False])
def test_tmix_pipe_matches_head_kernel(B, dtype, layer0, monkeypatch):
    """The pipelined kernel (persistent blocks, several heads per block through shared-memory
    slots, tensor-core row steps; fp16 state) vs the head-per-block kernel and the twin, two
    chained steps on every other slot of a pool. B = 700 and 2001 give each block several heads
    (2001: an uneven last block), so slots are refilled and their mbarriers go through several
    phases."""
    dev = torch.device("cuda")
    lw = _layer(dtype, dev, seed=B + 2)
    pool = (torch.randn(2 * B, H, N, N, generator=torch.Generator().manual_seed(B)) * 0.3).to(dev, torch.float16)
    s_ref, pool_head = pool[1::2].clone(), pool.clone()
    for t in range(2):
        r, k, v, wz, az, vz, v_first, g = _acts(B, dtype, dev, seed=B + 10 * t)
        args = (r, k, v, wz, az, None if layer0 else vz, None if layer0 else v_first, g, lw, layer0)
        ref = ops.tmix_decode(s_ref, *args, bias=True)
        _tmix_path(monkeypatch, "head")
        head = cuda_ops.tmix_decode(pool_head[1::2], *args, bias=True)
        _tmix_path(monkeypatch, "pipe")
        got = cuda_ops.tmix_decode(pool[1::2], *args, bias=True)
        tol = 1e-4 if dtype == torch.float32 else (3e-2 if dtype == torch.bfloat16 else 1e-2)
        assert _rel(got, ref) < tol and _rel(pool[1::2], s_ref) < max(tol, 1e-4)
        # the same sums in another order (tensor cores, hi + lo fp16 vectors)
        assert _rel(got, head) < 1e-4 and _rel(pool, pool_head) < 1e-4
    assert torch.equal(pool[0::2], pool_head[0::2])  # the slots in between untouched


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 5, 130, 1030])  # 1030 rows of 2560: fewer waves with the mix rows read late
@pytest.mark.parametrize("Cn", [256, 2560, 4100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [0, 1, 6])
@pytest.mark.parametrize("with_dx", [False, True])
def test_add_ln_mix_matches_twin(B, Cn, dtype, K, with_dx):
    dev = torch.device("cuda")
    assert cuda_ops.available(dev)
    g = torch.Generator().manual_seed(B * 7 + Cn + K)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    x, dx = rnd(B, Cn) * 3 + 0.5, (rnd(B, Cn) if with_dx else None)
    ln_w, ln_b = 1 + 0.2 * rnd(Cn), 0.2 * rnd(Cn)
    mix = torch.rand(K, Cn, generator=g).to(dev, dtype) if K else None
    pool = rnd(3, B, Cn)  # the shift is a row of a pool (a view, like state.att_shift[i])
    sh_ref, sh_cu = pool.clone(), pool.clone()
    shift_ref = sh_ref[1] if K or with_dx else None
    shift_cu = sh_cu[1] if K or with_dx else None
    x0 = x.clone()
    xr, outr = ops.add_ln_mix(x, dx, ln_w, ln_b, mix, shift_ref)
    xc, outc = cuda_ops.add_ln_mix(x, dx, ln_w, ln_b, mix, shift_cu)
    assert torch.equal(x, x0)  # never written
    assert outc.shape == outr.shape == ((K, B, Cn) if K else (B, Cn)) and outc.dtype == dtype
    assert torch.equal(xc, xr)  # the rounded residual add is exact
    assert _rel(outc, outr) < _tol(dtype)
    assert _rel(sh_cu, sh_ref) < _tol(dtype)
    assert torch.equal(sh_cu[0], pool[0]) and torch.equal(sh_cu[2], pool[2])  # other rows untouched


@pytest.mark.gpu
@pytest.mark.parametrize("B", [5, 1030])
@pytest.mark.parametrize("Cn", [2560, 4100])  # 4100: the general kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K", [0, 6])
def test_add_ln_mix_scales_a_scaled_product_as_its_twin(B, Cn, dtype, K):
    """dx as a ScaledProduct (an fp8 product's raw sums with its row and column scales): the
    kernel's residual add is bitwise its twin's (one fp32 sum, rounded once), and so is x' against
    adding the product's value by hand."""
    from server.model.qlinear import RAW_UNIT, ScaledProduct

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(B + Cn + K)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    x = (rnd(B, Cn) * 3 + 0.5).to(dtype)
    raw = (rnd(B, Cn) * 100 * RAW_UNIT * 448).to(dtype)  # sums of ~100 code products of ~448
    sp = ScaledProduct(raw, rnd(B, 1).abs() / 448, rnd(Cn).abs() / 448 * 0.05)
    ln_w, ln_b = (1 + 0.2 * rnd(Cn)).to(dtype), (0.2 * rnd(Cn)).to(dtype)
    mix = torch.rand(K, Cn, generator=g).to(dev, dtype) if K else None
    pool = rnd(3, B, Cn).to(dtype)
    sh_ref, sh_cu = pool.clone(), pool.clone()
    xr, outr = ops.add_ln_mix(x, sp, ln_w, ln_b, mix, sh_ref[1] if K else None)
    xc, outc = cuda_ops.add_ln_mix(x, sp, ln_w, ln_b, mix, sh_cu[1] if K else None)
    assert torch.equal(xc, xr)
    assert torch.equal(xr, (x.float() + raw.float() * (sp.row / RAW_UNIT) * sp.col).to(dtype))
    assert _rel(outc, outr) < _tol(dtype) and _rel(sh_cu, sh_ref) < _tol(dtype)
    assert not torch.equal(xc, (x + raw).to(dtype))  # the scales were applied


@pytest.mark.gpu
def test_add_ln_mix_reads_the_mix_rows_late_only_where_that_saves_a_wave():
    """2.9B's rows (C = 2,560, fp16): two blocks per SM fit with the mix rows held in registers,
    three without. At 4 * SMs - 8 rows both kernels take two waves (the held rows win); at 6 * SMs
    the held kernel takes three and the lean one two. The kernel's name says which ran (its last
    template arguments 0, 0: no planes quantized, fused_add_ln_mix_q's variants)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    Cn, dt = 2560, torch.float16
    for B, hold in ((4 * sms - 8, "true"), (6 * sms, "false")):
        x, dx, shift = (torch.randn(B, Cn, device=dev, dtype=dt) for _ in range(3))
        ln_w, ln_b, mix = (
            torch.ones(Cn, device=dev, dtype=dt),
            torch.zeros(Cn, device=dev, dtype=dt),
            torch.rand(6, Cn, device=dev, dtype=dt),
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cuda_ops.add_ln_mix(x, dx, ln_w, ln_b, mix, shift)
            torch.cuda.synchronize(dev)
        names = {e.name for e in prof.events() if "add_ln_mix" in e.name}
        assert names == {f"void wkv7::add_ln_mix_v2_kernel<__half, {hold}, 0, 0>(wkv7::LnArgs)"}, (B, names)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 4096, 2560 * 4 * 3 + 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_relu_square_and_lora_act_match_twins(n, dtype):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(n)
    h = (torch.randn(n, generator=g) * 2).to(dev, dtype)
    ref = ops.relu_square(h)
    got = cuda_ops.relu_square(h.clone())
    assert torch.equal(got, ref)  # exact: one rounding either way
    a, b = (torch.randn(3, n, generator=g) * 2).to(dev, dtype), (torch.randn(n + 5, generator=g) * 3).to(dev, dtype)
    ra, rb = ops.lora_act(a.clone(), b.clone())
    ca, cb = cuda_ops.lora_act(a.clone(), b.clone())
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(ca, ra, atol=atol, rtol=0) and torch.allclose(cb, rb, atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_fused_model_decode_matches_model(state_dtype):
    from server.model import load_model
    from server.model.graphs import DecodeGraphs

    dev = torch.device("cuda")
    base = load_model("synthetic:tiny", device=dev, dtype=torch.float16, state_dtype=state_dtype)
    fused = load_model("synthetic:tiny", device=dev, dtype=torch.float16, state_dtype=state_dtype)
    assert fused.ops.tmix_decode is cuda_ops.tmix_decode and fused._fused()  # the default on CUDA
    assert fused.ops.add_ln_mix is cuda_ops.add_ln_mix and fused.ops.relu_square is cuda_ops.relu_square
    base.fused_decode = False
    s1, s2 = base.zero_state(4), fused.zero_state(4)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    base.forward(prompts, s1), fused.forward(prompts, s2)
    graphs = DecodeGraphs(fused, s2, buckets=[4])
    graphs.capture([4])  # the warm-up step writes slot 0: resync it
    for t1, t2 in zip(s1.tensors(), s2.tensors()):
        t2.copy_(t1)
    tok = torch.tensor([12, 13, 14, 15], device=dev)
    for _ in range(8):
        l1 = base.decode(tok, s1)
        t2 = graphs.step(4, tok)
        assert _rel(graphs.logits(4), l1) < 2e-2
        assert _rel(s2.wkv, s1.wkv) < 2e-2
        tok = l1.argmax(-1)


def test_fused_path_matches_model_on_cpu():
    """The fused decode path (LoRAs as addmm + ops.tmix_decode) equals the unfused one
    (catches layout drift without a GPU: on CPU it runs the pure-torch twin)."""
    from server.model import load_model

    base = load_model("synthetic:tiny", device="cpu", dtype=torch.float32)
    fused = load_model("synthetic:tiny", device="cpu", dtype=torch.float32)
    assert not base._fused()
    fused.fused_decode = True
    s1, s2 = base.zero_state(2), fused.zero_state(2)
    base.forward([[1, 2, 3], [4]], s1), fused.forward([[1, 2, 3], [4]], s2)
    tok = torch.tensor([5, 6])
    for _ in range(3):
        l1, l2 = base.decode(tok, s1), fused.decode(tok, s2)
        assert torch.allclose(l1, l2, atol=1e-4, rtol=1e-4)
        tok = l1.argmax(-1)
    assert torch.allclose(s1.wkv, s2.wkv, atol=1e-5)
