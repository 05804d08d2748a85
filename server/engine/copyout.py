"""Final states from the device to host memory, on threads of their own.

The engine thread gathers a finished slot into a batch-1 device State on its stream (so the copy
is ordered before the slot is reused) and hands it here with an event recorded after the
gather. A copy thread waits for that event on its own stream, copies into ordinary (pageable)
host memory and queues the result for `take`. The copy blocks that thread only, with the GIL
released; two threads keep a wave of streams that end together from queueing behind one.

Why not pinned host buffers: allocating one per state (cudaHostAlloc, ~21 MB for a 2.9B fp32
state) held the engine thread for longer than the copy itself, and a wave of streams ending
together then waited seconds for their last events (docs/performance.md, "Final states and the
end of a wave").
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from server.model.state import State

log = logging.getLogger("server.engine")


class HostCopies:
    def __init__(self, device: torch.device, threads: int = 2) -> None:
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
        while (item := self._todo.get()) is not None:
            request_id, device_copy, ready = item
            host: State | None
            try:
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    host = State(*(t.to("cpu") for t in device_copy.tensors()))  # blocks until copied
            except Exception:
                log.exception("copying the final state of %s to the host failed", request_id)
                host = None
            del device_copy  # complete: its device memory may be reused
            with self._cond:
                self._done.append((request_id, host))
                self._inflight -= 1
                self._cond.notify_all()
