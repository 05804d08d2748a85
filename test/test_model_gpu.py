"""RWKV-7 forward on CUDA: fp16 parity with CPU fp32, CUDA-graph decode equals eager."""

from __future__ import annotations

import pytest
import torch

from server.model import load_model
from server.model.rwkv7 import select_ops
from server.model.synthetic import save_synthetic

pytestmark = pytest.mark.gpu


def rel_err(a, ref):
    return ((a.float().cpu() - ref.float().cpu()).abs().max() / ref.float().cpu().abs().max()).item()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "m.pth"
    save_synthetic("synthetic:L4-C512:1", str(path), dtype=torch.float32)
    cpu = load_model(str(path), chunk_len=16)
    gpu = load_model(str(path), device="cuda", dtype=torch.float16, chunk_len=16)
    return cpu, gpu


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_cuda_fp16_matches_cpu_fp32(pair, kernels):
    cpu, gpu = pair
    gpu.ops = select_ops(gpu.device, kernels)
    prompts = [list(range(100, 140)), [5, 6, 7]]
    sc, sg = cpu.zero_state(2), gpu.zero_state(2)
    lc, lg = cpu.forward(prompts, sc), gpu.forward(prompts, sg)
    assert rel_err(lg, lc) < 2e-2
    for tok in ([1, 2], [3, 4]):
        lc = cpu.decode(torch.tensor(tok), sc)
        lg = gpu.decode(torch.tensor(tok, device="cuda"), sg)
    assert rel_err(lg, lc) < 2e-2
    assert rel_err(sg.wkv, sc.wkv) < 2e-2


def test_cuda_graph_decode_equals_eager(pair):
    _, gpu = pair
    B = 8
    pool = gpu.zero_state(B)
    gpu.forward([[i + 1, i + 2] for i in range(B)], pool)
    eager_state = pool.clone()
    tok = torch.arange(B, device="cuda") + 10
    static_tok = tok.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream (required before capture)
        warm = pool.clone()
        gpu.decode(static_tok, warm)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gpu.decode(static_tok, pool)
    ref = eager_state.clone()
    for step in range(3):
        want = gpu.decode(tok + step, ref)
        static_tok.copy_(tok + step)
        graph.replay()
        assert torch.equal(static_out, want)
    assert all(torch.equal(a, b) for a, b in zip(pool.tensors(), ref.tensors()))


def test_decode_with_the_gate_lora_apart(pair, monkeypatch):
    """From decode_pack.LORA_APART_MIN_ROWS rows the gate's LoRA runs on a stream of its own (in a
    graph: a parallel branch) and the others stack at their own width: the stacked launch's decode
    to fp16 rounding, and its graph replays equal its eager decodes."""
    from server.model import decode_pack

    _, gpu = pair
    B = 16  # past the gemv's rows: the products are cuBLAS's
    assert gpu._decode_packs()[1].widths == (96, 32, 32, 32)
    pool = gpu.zero_state(B)
    gpu.forward([[i + 1, i + 2] for i in range(B)], pool)
    tok = torch.arange(B, device="cuda") + 10
    stacked = pool.clone()
    want = [gpu.decode(tok + step, stacked) for step in range(3)]
    monkeypatch.setattr(decode_pack, "LORA_APART_MIN_ROWS", B)
    assert gpu._decode_packs()[1].gate_apart(B) == 32
    eager = pool.clone()
    got = [gpu.decode(tok + step, eager) for step in range(3)]
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-2
    assert rel_err(eager.wkv, stacked.wkv) < 1e-2
    static_tok = tok.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream (required before capture)
        gpu.decode(static_tok, pool.clone())
    torch.cuda.current_stream().wait_stream(s)
    replayed = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gpu.decode(static_tok, replayed)
    for a, b in zip(replayed.tensors(), pool.tensors()):  # the capture ran no kernels; to be sure
        a.copy_(b)
    for step in range(3):
        static_tok.copy_(tok + step)
        graph.replay()
        assert torch.equal(static_out, got[step])
    assert all(torch.equal(a, b) for a, b in zip(replayed.tensors(), eager.tensors()))


def test_long_chunks_slots_and_lengths_on_cuda(pair):
    """Default CUDA chunking (one long chunk, lengths=/slots= handed to the kernel, no gather)
    equals the CPU fp32 reference for a ragged batch on non-contiguous slots."""
    cpu, gpu16 = pair
    gpu = type(gpu16)(gpu16.w, gpu16.shape, gpu16.name, "cuda", torch.float16)
    assert gpu.kernel_ops() and gpu._fused() and gpu.chunk_len == 4096
    prompts = [list(range(200, 300)), [5, 6, 7], list(range(1000, 1040))]
    slots = [4, 1, 2]
    pc, pg = cpu.zero_state(6), gpu.zero_state(6)
    lc, lg = cpu.forward(prompts, pc, slots=slots), gpu.forward(prompts, pg, slots=slots)
    assert rel_err(lg, lc) < 2e-2
    assert rel_err(pg.wkv, pc.wkv) < 2e-2 and rel_err(pg.att_shift, pc.att_shift) < 2e-2
    assert all(t[:, [0, 3, 5]].abs().max() == 0 for t in pg.tensors())  # untouched slots


def test_capture_in_a_fresh_process_with_large_buckets():
    """A fresh process captures buckets past the gemv range (cuBLAS's first use): the warm-up
    must have initialized every library the graphs touch, or the capture is invalidated."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from server.engine.sampler import SamplerSlots\n"
        "from server.engine.types import SamplingParams\n"
        "from server.model import load_model\n"
        "from server.model.graphs import DecodeGraphs\n"
        "m = load_model('synthetic:tiny', device='cuda', dtype=torch.float16)\n"
        "pool = m.zero_state(64)\n"
        "smp = SamplerSlots(64, m.shape.vocab_size, 'cuda')\n"
        "smp.reset(range(64), [SamplingParams()] * 64, list(range(64)))\n"
        "g = DecodeGraphs(m, pool, smp, buckets=[1, 2, 4, 8, 16, 32, 64])\n"
        "g.capture()\n"
        "tok = g.step(64, torch.ones(64, dtype=torch.long, device='cuda'))\n"
        "torch.cuda.synchronize()\n"
        "print('captured', sorted(g.graphs), tok.shape[0])\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "captured [1, 2, 4, 8, 16, 32, 64] 64" in out.stdout


@pytest.mark.parametrize("B", [1, 8, 64])
def test_pdl_launches_equal_plain_launches(pair, B):
    """Programmatic dependent launch (kernels/pdl.cuh: gemv and tmix issue loads before their
    wait; add_ln_mix and tmix their weight vectors too) changes no result: graph-captured decode
    steps with plain launches (what GPUs before sm_90 get) and with PDL give bitwise the same
    logits and states (B = 1, 8: gemv projections; 64: cuBLAS)."""
    from kernels import loader
    from server.model.graphs import DecodeGraphs

    _, gpu = pair
    lib = loader.load(gpu.device)
    pool0 = gpu.zero_state(B)
    gpu.forward([[i + 1, i + 2, i + 3] for i in range(B)], pool0)
    tok = torch.arange(B, device="cuda") + 10  # (B,)
    runs = []
    was = lib.pdl_mode(-1)
    if torch.cuda.get_device_capability(gpu.device)[0] >= 9:
        assert was == 1, "PDL should be on by default on sm_90+"
    try:
        for mode in (0, 1):
            lib.pdl_mode(mode)
            pool = pool0.clone()
            g = DecodeGraphs(gpu, pool, None, buckets=[B])
            g.capture([B])
            outs = [g.step(B, tok + step).clone() for step in range(3)]
            runs.append((torch.stack(outs), g.logits(B).clone(), [t.clone() for t in pool.tensors()]))
    finally:
        lib.pdl_mode(was)
    (t0, l0, s0), (t1, l1, s1) = runs
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))


def test_a_collection_during_a_capture_leaves_it_whole(pair, monkeypatch):
    """An earlier test's captured decode graphs, garbage in a reference cycle, meet Python's
    automatic collection while a later decode graph captures (the captured code allocates):
    graphs.capture_graph pauses the collector, so they are not destroyed inside the capture (which
    invalidated it: the GPU tests' engine start-up failed so when an earlier engine was collected
    there), and the new graph replays as the eager step computes."""
    import gc

    from server.model.graphs import DecodeGraphs

    _, gpu = pair
    B = 2
    old = DecodeGraphs(gpu, gpu.zero_state(B), None, buckets=[B])
    old.capture([B])
    holder = [{"graphs": old}]
    holder[0]["cycle"] = holder[0]  # freed only by a collection
    del old
    pool = gpu.zero_state(B)
    g = DecodeGraphs(gpu, pool, None, buckets=[B])
    begin, thresholds = torch.cuda.CUDAGraph.capture_begin, gc.get_threshold()

    def begin_then_drop(self, *a, **kw):  # inside the capture: the cycle becomes garbage, and
        begin(self, *a, **kw)  # every allocation may start a collection of every generation
        holder.clear()
        gc.set_threshold(1, 1, 1)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_drop)
    try:
        g.capture([B])
    finally:
        gc.set_threshold(*thresholds)
    monkeypatch.undo()
    gc.collect()  # the old graphs go now, outside any capture
    ref = pool.clone()
    tok = torch.arange(B, device="cuda") + 10
    got = g.step(B, tok).clone()
    want = gpu.decode(tok, ref).argmax(-1)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(pool.tensors(), ref.tensors()))


@pytest.mark.parametrize("call", ["pinned", "stream_sync"])
def test_another_threads_cuda_calls_leave_a_capture_whole(pair, monkeypatch, call):
    """Forward graphs are captured on first use while the server runs, beside copy-out threads
    that allocate pinned staging and wait on their streams: a call of that kind from another
    thread, made while a decode graph captures, neither fails nor invalidates the capture
    (graphs.capture_graph: thread-local capture mode), and the graph replays as eager decodes."""
    import threading

    from server.model.graphs import DecodeGraphs

    _, gpu = pair
    B = 2
    pool = gpu.zero_state(B)
    g = DecodeGraphs(gpu, pool, None, buckets=[B])
    inside, done, errors = threading.Event(), threading.Event(), []
    side = torch.cuda.Stream()

    def other():
        inside.wait(30)
        try:
            if call == "pinned":  # a size no cached block holds: a fresh host allocation
                torch.empty((97 << 20) + 4096, dtype=torch.uint8, pin_memory=True)
            else:  # work on a stream of its own, then wait for it (HostCopies.to_host)
                with torch.cuda.stream(side):
                    torch.ones(1024, device="cuda").sum()
                side.synchronize()
        except Exception as e:  # whatever failed, reported by the assertion below
            errors.append(e)
        finally:
            done.set()

    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_then_wait(self, *a, **kw):  # the other thread's call lands inside the capture
        begin(self, *a, **kw)
        inside.set()
        done.wait(30)

    t = threading.Thread(target=other)
    t.start()
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_wait)
    try:
        g.capture([B])
    finally:
        monkeypatch.undo()
        inside.set()
        t.join(30)
    assert done.is_set() and errors == []
    ref = pool.clone()
    tok = torch.arange(B, device="cuda") + 10
    got = g.step(B, tok).clone()
    assert torch.equal(got, gpu.decode(tok, ref).argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(pool.tensors(), ref.tensors()))
