"""The final-state copy threads (server.engine.copyout) keep neither the device copy they were
handed nor the host copy they made once it is taken: a loop variable held both (MBs each,
outside every budget; the device copy's memory not reusable) until the thread's next state.
The CUDA calls are replaced by stand-ins here; the copy itself is tested on a GPU
(test_engine_gpu.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from server.engine import copyout
from server.model.state import State


class _Event:
    def record(self, stream: object) -> None:
        pass


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(copyout.Staging, "to_host", lambda self, st, ready: State(*(t.clone() for t in st.tensors())))


def _state(n: float) -> State:
    return State(att_shift=torch.full((1, 1, 8), n), ffn_shift=torch.zeros(1, 1, 8), wkv=torch.zeros(1, 1, 1, 8, 8))


def test_the_copy_threads_let_go_of_both_copies(no_cuda):
    hc = copyout.HostCopies(torch.device("cpu"), threads=2)
    try:
        gc.collect()
        gc.disable()  # reference counting alone frees them
        try:
            sent = [_state(i) for i in range(4)]
            device_refs = [weakref.ref(s) for s in sent]
            for i, s in enumerate(sent):
                hc.submit(f"r{i}", s)
            del sent, s
            done = hc.take(wait=True)
            assert sorted(rid for rid, _ in done) == ["r0", "r1", "r2", "r3"]
            assert all(int(h.att_shift[0, 0, 0]) == int(rid[1:]) for rid, h in done)
            host_refs = [weakref.ref(h) for _, h in done]
            del done
            assert [r() for r in device_refs] == [None] * 4
            assert [r() for r in host_refs] == [None] * 4
        finally:
            gc.enable()
    finally:
        hc.close()
