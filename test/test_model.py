"""RWKV-7 forward: parity with the `rwkv` package (the oracle), chunking, ragged batches, slots."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from server.model import load_model
from server.model.synthetic import save_synthetic

TOL = 1e-4
# the rwkv package always TorchScripts its RWKV-7 code (deprecated API)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 when both are all zeros)."""
    diff = (a.float() - ref.float()).abs().max().item()
    return diff / max(ref.float().abs().max().item(), 1e-30)


@pytest.fixture(scope="module")
def oracle():
    """The rwkv package's RWKV_x070 on `cpu fp32` (its flags are read at import time)."""
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    if "rwkv.model" in sys.modules:
        mod = importlib.reload(sys.modules["rwkv.model"])
    else:
        mod = importlib.import_module("rwkv.model")
    return mod.RWKV_x070


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny:1", chunk_len=5)


def _prompts():
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, 65536, (n,), generator=g).tolist() for n in (1, 7, 3, 12)]


@pytest.mark.parametrize(
    "preset,save_dtype", [("tiny", torch.float32), ("L3-C256:5", torch.bfloat16), ("L1-C64-V300", torch.float32)]
)
def test_logits_match_rwkv_package(oracle, tmp_path, preset, save_dtype):
    path = tmp_path / "model.pth"
    save_synthetic(preset, str(path), dtype=save_dtype)
    ref = oracle(str(path)[: -len(".pth")], "cpu fp32")
    model = load_model(str(path), chunk_len=4)  # 10 tokens -> chunks of 4, 4, 2
    prompt = [t % model.shape.vocab_size for t in (1, 500, 65000, 7, 7, 7, 42, 3, 0, 99)]
    ref_logits, ref_state = ref.forward(prompt, None)
    state = model.zero_state(1)
    logits = model.forward([prompt], state)
    assert logits.shape == (1, model.shape.vocab_size) and logits.dtype == torch.float32
    assert rel_err(logits[0], ref_logits) < TOL
    for tok in (5, 17, 5):  # decode (the oracle's forward_one path)
        ref_logits, ref_state = ref.forward([tok], ref_state)
        logits = model.decode(torch.tensor([tok]), state)
        assert rel_err(logits[0], ref_logits) < TOL
    L = model.shape.n_layer
    for i in range(L):  # the oracle's state: [att_shift, wkv (H, N, N), ffn_shift] per layer
        assert rel_err(state.att_shift[i, 0], ref_state[3 * i]) < TOL
        assert rel_err(state.wkv[i, 0], ref_state[3 * i + 1]) < TOL
        assert rel_err(state.ffn_shift[i, 0], ref_state[3 * i + 2]) < TOL


def _alone(model, prompt):
    state = model.zero_state(1)
    return model.forward([prompt], state)[0], state


def _assert_states_close(a, b, tol=TOL):
    for x, y in zip(a.tensors(), b.tensors()):
        assert rel_err(x, y) <= tol


def test_chunked_prefill_equals_token_by_token_decode(tiny):
    prompt = _prompts()[3]  # 12 tokens, chunk_len 5
    logits, state = _alone(tiny, prompt)
    s2 = tiny.zero_state(1)
    for tok in prompt:
        dec = tiny.decode(torch.tensor([tok]), s2)
    assert rel_err(logits, dec[0]) < TOL
    _assert_states_close(state, s2)
    big = load_model("synthetic:tiny:1", chunk_len=256)  # one chunk
    s3 = big.zero_state(1)
    assert rel_err(big.forward([prompt], s3)[0], logits) < TOL
    _assert_states_close(s3, state)


def test_ragged_batch_equals_each_alone(tiny):
    prompts = _prompts()
    state = tiny.zero_state(len(prompts))
    logits = tiny.forward(prompts, state)
    for i, p in enumerate(prompts):
        ref, ref_state = _alone(tiny, p)
        assert rel_err(logits[i], ref) < TOL
        _assert_states_close(state.view(i, i + 1), ref_state)


def test_non_contiguous_slots_and_untouched_slots(tiny):
    prompts = _prompts()[:3]
    pool = tiny.zero_state(6)
    pool.wkv[:, 0].fill_(0.5)  # a slot that must not change
    before = pool.view(0, 1).clone()
    logits = tiny.forward(prompts, pool, slots=[4, 1, 3])
    for slot, p, lg in zip([4, 1, 3], prompts, logits):
        ref, ref_state = _alone(tiny, p)
        assert rel_err(lg, ref) < TOL
        _assert_states_close(pool.view(slot, slot + 1), ref_state)
    _assert_states_close(pool.view(0, 1), before, tol=0)
    for slot in (2, 5):
        assert all(t.abs().max() == 0 for t in pool.view(slot, slot + 1).tensors())
    # continuing from a slot: decode on a prefix view of the pool equals continuing alone
    pool.copy_slot(0, 4)
    ref, ref_state = _alone(tiny, prompts[0] + [77])
    out = tiny.decode(torch.tensor([77, 1]), pool.view(0, 2))
    assert rel_err(out[0], ref) < TOL
    _assert_states_close(pool.view(0, 1), ref_state)


def test_forward_padded_equals_forward(tiny):
    """forward_padded (the prefill graphs' function: right-padded ids, lengths, slots, all on the
    device) updates the given slots and returns the logits as forward() does, and leaves the
    padding and the other slots out."""
    prompts = _prompts()[1:4]  # 7, 3 and 12 tokens, padded to 16
    pool, ref_pool = tiny.zero_state(5), tiny.zero_state(5)
    pool.wkv[:, 0].fill_(0.5)
    ref_pool.wkv[:, 0].fill_(0.5)
    ids = torch.full((3, 16), 65535, dtype=torch.long)  # padding: a valid id, never read as a token
    for j, p in enumerate(prompts):
        ids[j, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    got = tiny.forward_padded(ids, lengths, torch.tensor([4, 1, 2], dtype=torch.int32), pool)
    want = tiny.forward(prompts, ref_pool, slots=[4, 1, 2])
    assert got.shape == want.shape and rel_err(got, want) < TOL
    for slot in range(5):
        _assert_states_close(pool.view(slot, slot + 1), ref_pool.view(slot, slot + 1))


def test_forward_rejects_bad_input(tiny):
    state = tiny.zero_state(2)
    with pytest.raises(ValueError):
        tiny.forward([[1], []], state)
    with pytest.raises(ValueError):
        tiny.forward([[1], [2]], state, slots=[0, 0])
    with pytest.raises(ValueError):
        tiny.forward([[1]], state, slots=[2])
    with pytest.raises(ValueError, match="token id"):
        tiny.forward([[1, 65536]], state)


def test_fp16_state_close_to_fp32():
    m32 = load_model("synthetic:tiny:2")
    m16 = load_model("synthetic:tiny:2", state_dtype=torch.float16)
    prompt = _prompts()[3]
    s32, s16 = m32.zero_state(1), m16.zero_state(1)
    assert s16.wkv.dtype == torch.float16
    a, b = m32.forward([prompt], s32), m16.forward([prompt], s16)
    for tok in (3, 4):
        a, b = m32.decode(torch.tensor([tok]), s32), m16.decode(torch.tensor([tok]), s16)
    assert rel_err(b, a) < 1e-2


def test_bf16_compute_runs_close():
    m32 = load_model("synthetic:tiny:2")
    mb = load_model("synthetic:tiny:2", dtype=torch.bfloat16)
    prompt = _prompts()[3]
    a = m32.forward([prompt], m32.zero_state(1))
    b = mb.forward([prompt], mb.zero_state(1))
    assert mb.zero_state(1).att_shift.dtype == torch.bfloat16
    assert torch.isfinite(b).all() and rel_err(b, a) < 0.1


def test_defaults_and_token_cap_shrinks_chunks(tiny):
    """CPU default chunking is unchanged (256); the per-call token cap shrinks the chunk length
    when many sequences prefill together, without changing the result."""
    m = load_model("synthetic:tiny:1")
    assert (m.chunk_len, m.max_chunk_tokens, m._fused()) == (256, 16384, False)
    capped = load_model("synthetic:tiny:1", chunk_len=5, max_chunk_tokens=6)  # 4 seqs -> T = 1
    prompts = _prompts()
    s1, s2 = tiny.zero_state(4), capped.zero_state(4)
    a, b = tiny.forward(prompts, s1), capped.forward(prompts, s2)
    assert rel_err(b, a) < TOL
    _assert_states_close(s2, s1)


def test_kernel_path_slots_and_lengths(tiny):
    """The CUDA-path plumbing (pool + slots= + lengths= handed to wkv_chunk, shifts indexed by
    slot) run on CPU through cuda_ops' fallback, which implements the same contract."""
    import types

    from server.model import cuda_ops, ops
    from server.model.rwkv7 import OP_NAMES

    k = load_model("synthetic:tiny:1", chunk_len=5)
    k.ops = types.SimpleNamespace(**{**{n: getattr(ops, n) for n in OP_NAMES}, "wkv_chunk": cuda_ops.wkv_chunk})
    assert k.kernel_ops() and not tiny.kernel_ops()
    prompts = _prompts()
    p1, p2 = tiny.zero_state(6), k.zero_state(6)
    for pool in (p1, p2):
        pool.wkv[:, 0].fill_(0.5)
    a = tiny.forward(prompts, p1, slots=[5, 0, 3, 1])
    b = k.forward(prompts, p2, slots=[5, 0, 3, 1])
    assert rel_err(b, a) < TOL
    _assert_states_close(p2, p1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_raw_logits_are_the_head_output(dtype):
    """raw_logits=True (what DecodeGraphs feeds the fused sampler) returns the head's output in
    the model dtype; widening it gives exactly the default fp32 logits."""
    model = load_model("synthetic:tiny:3", dtype=dtype)
    s1, s2 = model.zero_state(2), model.zero_state(2)
    tok = torch.tensor([5, 9])
    raw, full = model.decode(tok, s1, raw_logits=True), model.decode(tok, s2)
    assert raw.dtype == dtype and full.dtype == torch.float32
    assert torch.equal(raw.float(), full)
    assert all(torch.equal(a, b) for a, b in zip(s1.tensors(), s2.tensors()))


def test_fused_decode_path_equals_unfused():
    """The fused decode (stacked projections and LoRAs, decode_pack) run on CPU through the ops'
    pure-torch twins gives the unfused loop's logits and states, with the four LoRAs merged into
    one stacked launch per stage; layer 0 has no value-mix LoRA."""
    fused, plain = load_model("synthetic:L3-C128-V512:4"), load_model("synthetic:L3-C128-V512:4")
    fused.fused_decode = True
    assert fused._fused() and not plain._fused()
    s1, s2 = fused.zero_state(3), plain.zero_state(3)
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5]]
    fused.forward(prompts, s1), plain.forward(prompts, s2)
    tok = torch.tensor([4, 40, 400])
    for _ in range(3):
        a, b = fused.decode(tok, s1), plain.decode(tok, s2)
        assert rel_err(a, b) < 1e-5
        tok = b.argmax(-1)
    _assert_states_close(s1, s2, tol=1e-5)
    pk = fused._decode_packs()
    assert pk[0].lora1.shape[0] == 3 and pk[1].lora1.shape[0] == 4  # gate, decay, a[, v-mix]
    # the layers' own fields are views into the stacked storage (prefill reads them)
    lw = fused.w.layers[1]
    assert lw.g1.untyped_storage().data_ptr() == pk[1].lora1.untyped_storage().data_ptr()


def test_decode_loras_with_the_gate_apart_equal_the_stacked_launch(monkeypatch):
    """From LORA_APART_MIN_ROWS rows the gate's LoRA runs apart and the others stack at their own
    widest width (views of the padded stacks): the same LoRA outputs as the one stacked launch a
    stage, in every layer (layer 0 without the value mix), and the same decode."""
    from server.model import decode_pack

    model = load_model("synthetic:L2-C256-V512:4")  # LoRA widths g 64, w / a / v 32
    model.fused_decode = True
    packs = model._decode_packs()
    assert [pk.widths for pk in packs] == [(64, 32, 32), (64, 32, 32, 32)]
    B = 5
    xs = torch.randn(6, B, model.shape.n_embd)
    states = [model.zero_state(B) for _ in range(2)]
    tok = torch.tensor([4, 40, 400, 7, 0])
    logits = []
    for min_rows, state in zip((B + 1, B), states):
        monkeypatch.setattr(decode_pack, "LORA_APART_MIN_ROWS", min_rows)
        assert [pk.gate_apart(B) for pk in packs] == ([0, 0] if min_rows > B else [32, 32])
        outs = [model._decode_loras(xs, pk) for pk in packs]
        if min_rows > B:
            stacked = outs
        else:
            for (z, gz), (z0, gz0) in zip(outs, stacked):
                assert z.shape == z0.shape and gz.shape == gz0.shape
                assert rel_err(z, z0) < 1e-5 and rel_err(gz, gz0) < 1e-5
        logits.append(model.decode(tok, state))
    assert rel_err(logits[1], logits[0]) < 1e-5


def test_capture_graph_is_thread_local_and_pauses_the_collector(monkeypatch):
    """graphs.capture_graph: a thread-local capture with no automatic collection inside it (it
    could destroy a dead object's CUDA resources mid-capture), the collector's state restored
    after, also when the capture raises, and left off when it was off; a kept graph is edited and
    instantiated after a capture that ended, not after one that raised."""
    import contextlib
    import gc

    from server.model import graphs

    seen, done = [], []

    @contextlib.contextmanager
    def fake_graph(g, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"  # other threads' CUDA calls are theirs
        seen.append((g, pool, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(graphs, "_new_graph", lambda: ("g", True))
    monkeypatch.setattr(graphs, "_edit_and_instantiate", done.append)
    was = gc.isenabled()
    try:
        gc.enable()
        with graphs.capture_graph("pool") as g:
            assert g == "g" and not gc.isenabled()
        assert gc.isenabled() and seen == [("g", "pool", False)] and done == ["g"]
        with pytest.raises(ValueError), graphs.capture_graph(None):
            raise ValueError("capture failed")
        assert gc.isenabled() and done == ["g"]
        gc.disable()
        with graphs.capture_graph(None):
            pass
        assert not gc.isenabled() and [s[2] for s in seen] == [False, False, False]
    finally:
        (gc.enable if was else gc.disable)()


def test_a_graph_the_driver_cannot_edit_is_instantiated_as_captured(monkeypatch, caplog):
    """graphs._edit_and_instantiate: a DriverError from the edit (an old driver) is a warning,
    any other error an error with its traceback, and the graph is instantiated all the same."""
    from server.model import graph_driver, graphs

    calls = []

    class Graph:
        def raw_cuda_graph(self):
            return 1234

        def instantiate(self):
            calls.append("instantiate")

    def no_driver(raw, as_kernels):
        calls.append(raw)
        raise graph_driver.DriverError("the CUDA driver has no cuGraphAddDependencies_v2")

    monkeypatch.setattr(graph_driver, "hoist_memsets", no_driver)
    with caplog.at_level("WARNING", logger="server.model.graphs"):
        graphs._edit_and_instantiate(Graph())
    assert calls == [1234, "instantiate"]
    assert "cuGraphAddDependencies_v2" in caplog.text

    def bug(raw, as_kernels):  # a bug in the edit is logged, and the server still starts
        raise TypeError("wrong type")

    monkeypatch.setattr(graph_driver, "hoist_memsets", bug)
    with caplog.at_level("WARNING", logger="server.model.graphs"):
        graphs._edit_and_instantiate(Graph())
    assert calls[-1] == "instantiate" and "its edit failed" in caplog.text and "TypeError" in caplog.text
