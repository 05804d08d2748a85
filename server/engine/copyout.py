"""Final states from the device to host memory, on threads of their own.

The engine thread gathers a finished slot into a batch-1 device State on its stream (so the copy
is ordered before the slot is reused) and hands it here with an event recorded after the
gather. A copy thread waits for that event on its own stream, copies the state into a pinned
staging buffer of its own (an asynchronous DMA), waits for it, then copies the bytes into
ordinary (pageable) host memory with numpy, outside the CUDA driver, and queues the result for
`take`. Several threads keep a wave of streams that end together from queueing behind one.

Why staging: a device-to-pageable copy runs inside the driver, which stages it through its own
pinned memory while the first touch of the new host pages faults them in; the engine thread's
launches and event records waited behind those copies (docs/performance.md, "Final states and
the end of a wave"). Why one reusable buffer per thread: allocating a pinned buffer per state
(cudaHostAlloc) held the engine thread longer than the copy itself. Why numpy for the host
copy: it copies on the calling thread with the GIL released, where torch's CPU copy would wake
its intra-op pool, whose spinning threads take cores from the engine.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from server.model.state import State

log = logging.getLogger("server.engine")


class HostCopies:
    def __init__(self, device: torch.device, threads: int = 4) -> None:
        self.device = device
        self._todo: queue.SimpleQueue[tuple[str, State, torch.cuda.Event] | None] = queue.SimpleQueue()
        self._done: list[tuple[str, State | None]] = []
        self._cond = threading.Condition()
        self._inflight = 0
        self._threads = [
            threading.Thread(
                target=self._run, args=(torch.cuda.Stream(device),), name=f"rwkv-state-copy-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, request_id: str, device_copy: State) -> None:
        """Engine thread: copy `device_copy` (batch 1, just gathered on the current stream) out."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with self._cond:
            self._inflight += 1
        self._todo.put((request_id, device_copy, ready))

    def take(self, wait: bool = False) -> list[tuple[str, State | None]]:
        """(request_id, host state) of the finished copies (all submitted ones when wait); the
        state is None when its copy failed (logged)."""
        with self._cond:
            while wait and self._inflight:
                self._cond.wait()
            done, self._done = self._done, []
        return done

    @property
    def pending(self) -> bool:
        return bool(self._inflight or self._done)

    def close(self) -> None:
        for _ in self._threads:
            self._todo.put(None)

    def _run(self, stream: torch.cuda.Stream) -> None:
        if self.device.index is not None:
            torch.cuda.set_device(self.device)
        staging = Staging(stream)
        while (item := self._todo.get()) is not None:
            request_id, device_copy, ready = item
            del item  # (else it keeps the device copy until the next state comes)
            host: State | None
            try:
                host = staging.to_host(device_copy, ready)
            except Exception:
                log.exception("copying the final state of %s to the host failed", request_id)
                host = None
            del device_copy  # complete: its device memory may be reused
            with self._cond:
                self._done.append((request_id, host))
                del host  # the taker's now (before take() can return): not kept while this thread waits
                self._inflight -= 1
                self._cond.notify_all()


class Staging:
    """One copy thread's pinned bytes (grown to the largest state it has copied) and stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.pinned = torch.empty(0, dtype=torch.uint8)

    def to_host(self, state: State, ready: torch.cuda.Event) -> State:
        """A pageable host copy of `state` (on the device), once `ready` has passed."""
        total = state.nbytes()
        if self.pinned.numel() < total:
            self.pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        views, off = [], 0
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for r in map(_bytes, state.tensors()):  # each (nbytes,) uint8, no copy when contiguous
                views.append(self.pinned[off : off + r.numel()])
                views[-1].copy_(r, non_blocking=True)  # device -> pinned: a DMA, no host faults
                off += r.numel()
        self.stream.synchronize()  # the GIL is released while it waits
        out = []
        for t, v in zip(state.tensors(), views, strict=True):
            host = torch.empty(t.shape, dtype=t.dtype)
            _bytes(host).numpy()[:] = v.numpy()  # pinned -> pageable, this thread, GIL released
            out.append(host)
        return State(*out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.contiguous().view(torch.uint8).reshape(-1)  # (nbytes,)
