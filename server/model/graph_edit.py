"""Edits of a captured CUDA graph before it is instantiated: cuBLAS's workspace memsets moved off
the step's critical path.

cuBLASLt puts a small memset node before some of its GEMM kernels (a few bytes of its workspace,
zeroed for the kernel; the fp8 FFN key product at 1,024 rows has one in every layer). Captured
in stream order, the memset depends on the kernel before it, so the GEMM starts only after that
kernel, then the memset, each with its launch latency (docs/performance.md, "Idle time inside
the B=1,024 decode graph"). `hoist_memsets` gives each such memset its predecessor's own
dependencies instead (it then runs beside that kernel) and makes the GEMM depend on both.

When a move is safe: the memset is small (at most MAX_BYTES), every node that waits for it is a
cuBLAS kernel (so it is cuBLAS's own memset, not a tensor's), and the one node it followed is not
a cuBLAS kernel. Only cuBLAS kernels touch cuBLAS's workspace, and every earlier cuBLAS kernel of
the stream is still an ancestor of the memset (through the predecessor's dependencies), so the
workspace is zeroed after its last reader and before the next, as captured.

`plan_hoists` decides over a small graph protocol (plain Python: the CPU tests run it on a fake
graph); `DriverGraph` is that protocol over a raw `cudaGraph_t` through the CUDA driver API
(ctypes on libcuda, which every CUDA process has loaded: no extra package).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

MAX_BYTES = 64
"""The largest memset that `plan_hoists` moves (cuBLASLt's are 4 bytes)."""

CUBLAS_KERNEL = re.compile(r"nvjet|xmma|cutlass|cublas|gemmk|gemm_|splitkreduce", re.IGNORECASE)
"""Kernel names of cuBLAS / cuBLASLt (Hopper's `nvjet_*`, the `sm90_xmma_gemm_*` and CUTLASS
families, split-K reductions). A kernel of ours that matched would only make a move not happen."""


class GraphView(Protocol):
    """What `plan_hoists` reads of a graph. Nodes are opaque handles (ints)."""

    def nodes(self) -> Sequence[int]: ...
    def kind(self, node: int) -> str: ...  # "kernel", "memset", or another node type's name
    def name(self, node: int) -> str: ...  # a kernel's name ("" for other nodes)
    def memset_bytes(self, node: int) -> int: ...
    def deps(self, node: int) -> Sequence[int]: ...
    def users(self, node: int) -> Sequence[int]: ...


@dataclass(frozen=True)
class Hoist:
    """Move `memset` from after `after` to after `after`'s own dependencies (`new_deps`); the
    memset's users then also depend on `after` (`users`)."""

    memset: int
    after: int
    new_deps: tuple[int, ...]
    users: tuple[int, ...]


def _is_cublas(g: GraphView, node: int) -> bool:
    return g.kind(node) == "kernel" and CUBLAS_KERNEL.search(g.name(node)) is not None


def plan_hoists(g: GraphView) -> list[Hoist]:
    """The memsets that can move (module docstring), each with its new edges."""
    plan = []
    for m in g.nodes():
        if g.kind(m) != "memset" or g.memset_bytes(m) > MAX_BYTES:
            continue
        deps, users = list(g.deps(m)), list(g.users(m))
        if len(deps) != 1 or not users or not all(_is_cublas(g, u) for u in users):
            continue
        k = deps[0]
        if g.kind(k) != "kernel" or _is_cublas(g, k):
            continue
        plan.append(Hoist(m, k, tuple(g.deps(k)), tuple(users)))
    return plan


class GraphEditor(Protocol):
    def remove_edge(self, src: int, dst: int) -> None: ...
    def add_edge(self, src: int, dst: int) -> None: ...


def apply_hoists(g: GraphView, ed: GraphEditor, plan: Sequence[Hoist]) -> None:
    """Rewire the edges of each move: `dep -> memset` for each of after's dependencies and
    `after -> user` for each user of the memset come (unless there), then `after -> memset`
    goes. Edges are added before the one is removed, so a call that fails midway leaves a graph
    with no fewer orderings than the captured one."""
    for h in plan:
        for d in h.new_deps:
            ed.add_edge(d, h.memset)
        for u in h.users:
            if h.after not in g.deps(u):
                ed.add_edge(h.after, u)
        ed.remove_edge(h.after, h.memset)


# --- the driver API (libcuda through ctypes) ------------------------------------------------------

_KINDS = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
          7: "event_record", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}  # fmt: skip
_P, _SZ = ctypes.c_void_p, ctypes.c_size_t


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", _SZ), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", _SZ), ("height", _SZ)]  # fmt: skip


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", _P), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", _P), ("extra", _P), ("kern", _P), ("ctx", _P)]  # fmt: skip


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


class DriverError(RuntimeError):
    pass


def _ck(err: int, what: str) -> None:
    if err != 0:
        raise DriverError(f"{what}: CUresult {err}")


class DriverGraph:
    """GraphView and GraphEditor over a raw CUgraph (= cudaGraph_t, e.g. torch's
    `CUDAGraph.raw_cuda_graph()` of a graph captured with keep_graph=True). The _v2 edge calls
    (CUDA >= 12.3 drivers) read edges that carry data (programmatic launches) without failing;
    the edges this module adds are plain full dependencies."""

    CALLS = (
        "cuGraphGetNodes",
        "cuGraphNodeGetType",
        "cuGraphKernelNodeGetParams_v2",
        "cuFuncGetName",
        "cuKernelGetName",
        "cuGraphMemsetNodeGetParams",
        "cuGraphNodeGetDependencies_v2",
        "cuGraphNodeGetDependentNodes_v2",
        "cuGraphAddDependencies_v2",
        "cuGraphRemoveDependencies_v2",
    )

    def __init__(self, graph: int):
        """Raises DriverError when the driver lacks one of CALLS (before anything is read)."""
        try:
            self.graph, self.cu = graph, _libcuda()
        except OSError as e:
            raise DriverError(f"no CUDA driver library: {e}") from e
        missing = [c for c in self.CALLS if not hasattr(self.cu, c)]
        if missing:
            raise DriverError(f"the CUDA driver has no {', '.join(missing)}")

    def nodes(self) -> list[int]:
        n = _SZ(0)
        _ck(self.cu.cuGraphGetNodes(_P(self.graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        arr = (_P * n.value)()
        _ck(self.cu.cuGraphGetNodes(_P(self.graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
        return [int(arr[i] or 0) for i in range(n.value)]

    def kind(self, node: int) -> str:
        t = ctypes.c_int(-1)
        _ck(self.cu.cuGraphNodeGetType(_P(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return _KINDS.get(t.value, f"type{t.value}")

    def name(self, node: int) -> str:
        if self.kind(node) != "kernel":
            return ""
        p = _KernelParams()
        _ck(self.cu.cuGraphKernelNodeGetParams_v2(_P(node), ctypes.byref(p)), "cuGraphKernelNodeGetParams")
        s = ctypes.c_char_p()
        if p.func and self.cu.cuFuncGetName(ctypes.byref(s), _P(p.func)) == 0 and s.value:
            return s.value.decode(errors="replace")
        if p.kern and self.cu.cuKernelGetName(ctypes.byref(s), _P(p.kern)) == 0 and s.value:
            return s.value.decode(errors="replace")
        return ""

    def memset_bytes(self, node: int) -> int:
        p = _MemsetParams()
        _ck(self.cu.cuGraphMemsetNodeGetParams(_P(node), ctypes.byref(p)), "cuGraphMemsetNodeGetParams")
        return int(p.width) * int(p.element_size) * max(1, int(p.height))

    def _edges(self, fn, node: int) -> list[int]:
        n = _SZ(0)
        _ck(fn(_P(node), None, None, ctypes.byref(n)), fn.__name__)
        if n.value == 0:
            return []
        arr, data = (_P * n.value)(), (ctypes.c_uint64 * n.value)()  # CUgraphEdgeData: 8 bytes
        _ck(fn(_P(node), arr, data, ctypes.byref(n)), fn.__name__)
        return [int(arr[i] or 0) for i in range(n.value)]

    def deps(self, node: int) -> list[int]:
        return self._edges(self.cu.cuGraphNodeGetDependencies_v2, node)

    def users(self, node: int) -> list[int]:
        return self._edges(self.cu.cuGraphNodeGetDependentNodes_v2, node)

    def _edge(self, fn, src: int, dst: int) -> None:
        _ck(fn(_P(self.graph), (_P * 1)(src), (_P * 1)(dst), None, _SZ(1)), fn.__name__)

    def remove_edge(self, src: int, dst: int) -> None:
        self._edge(self.cu.cuGraphRemoveDependencies_v2, src, dst)

    def add_edge(self, src: int, dst: int) -> None:
        self._edge(self.cu.cuGraphAddDependencies_v2, src, dst)


def hoist_memsets(graph: int) -> int:
    """Apply `plan_hoists` to a raw captured graph (before it is instantiated); the number of
    memsets moved. DriverError: a driver without these calls (before any change), or a call that
    failed (apply_hoists' order keeps the graph's orderings): either way the graph can be
    instantiated as it is."""
    g = DriverGraph(graph)
    plan = plan_hoists(g)
    apply_hoists(g, g, plan)
    return len(plan)
