"""server.model.graph_edit's edits applied to a captured graph: `hoist_memsets` on a raw
`cudaGraph_t` (= CUgraph; torch's `CUDAGraph.raw_cuda_graph()` of a graph captured with
keep_graph=True) through `DriverGraph`, graph_edit's GraphView and GraphEditor over the CUDA
driver's graph calls by ctypes on libcuda, which every CUDA process has loaded
(docs/architecture.md says why not NVIDIA's cuda-python bindings).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import ClassVar

from server.model.graph_edit import Store32, apply_hoists, plan_hoists, store32

_KINDS = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
          7: "event_record", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}  # fmt: skip
_P, _SZ = ctypes.c_void_p, ctypes.c_size_t


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", _SZ), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", _SZ), ("height", _SZ)]  # fmt: skip


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", _P), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", _P), ("extra", _P), ("kern", _P), ("ctx", _P)]  # fmt: skip


class _KernelParamsV1(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v1 (cuGraphAddKernelNode's)
    _fields_ = [("func", _P), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", _P), ("extra", _P)]  # fmt: skip


STORE_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry rwkv_store_u32(.param .u64 dst, .param .u32 word) {
    .reg .b64 %rd<3>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [dst];
    ld.param.u32 %r1, [word];
    cvta.to.global.u64 %rd2, %rd1;
    st.global.u32 [%rd2], %r1;
    ret;
}
"""
"""The store kernel: one thread writes `word` at `dst` (PTX for any GPU from sm_70; the driver
compiles it once per context)."""


class DriverError(RuntimeError):
    """A driver without the graph calls DriverGraph needs, or one of them failed."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


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
        "cuGraphAddKernelNode",
        "cuGraphDestroyNode",
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuCtxGetCurrent",
    )
    _store_funcs: ClassVar[dict[int, int]] = {}  # CUcontext -> its rwkv_store_u32

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

    def _memset(self, node: int) -> _MemsetParams:
        p = _MemsetParams()
        _ck(self.cu.cuGraphMemsetNodeGetParams(_P(node), ctypes.byref(p)), "cuGraphMemsetNodeGetParams")
        return p

    def memset_bytes(self, node: int) -> int:
        p = self._memset(node)
        return int(p.width) * int(p.element_size) * max(1, int(p.height))

    def memset_store(self, node: int) -> Store32 | None:
        p = self._memset(node)
        return store32(int(p.dst), int(p.value), int(p.element_size), int(p.width), int(p.height))

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

    def _store_func(self) -> int:
        ctx = _P()
        _ck(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        key = int(ctx.value or 0)
        if key not in self._store_funcs:
            mod, fn = _P(), _P()
            _ck(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(STORE_PTX)), "cuModuleLoadData")
            _ck(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"rwkv_store_u32"), "cuModuleGetFunction")
            self._store_funcs[key] = int(fn.value or 0)  # the module stays loaded for the context's life
        return self._store_funcs[key]

    def add_store_kernel(self, deps: Sequence[int], store: Store32) -> int:
        dst, word = ctypes.c_uint64(store.dst), ctypes.c_uint32(store.word)
        args = (_P * 2)(ctypes.cast(ctypes.byref(dst), _P), ctypes.cast(ctypes.byref(word), _P))
        one = (ctypes.c_uint * 3)(1, 1, 1)
        params = _KernelParamsV1(self._store_func(), one, one, 0, ctypes.cast(args, _P), None)
        node, arr = _P(), (_P * max(1, len(deps)))(*deps)
        err = self.cu.cuGraphAddKernelNode(
            ctypes.byref(node), _P(self.graph), arr, _SZ(len(deps)), ctypes.byref(params)
        )
        _ck(err, "cuGraphAddKernelNode")  # (the arguments are copied into the node)
        return int(node.value or 0)

    def destroy(self, node: int) -> None:
        _ck(self.cu.cuGraphDestroyNode(_P(node)), "cuGraphDestroyNode")


def hoist_memsets(graph: int, as_kernels: bool = False) -> tuple[int, int]:
    """Apply `plan_hoists` to a raw captured graph (before it is instantiated): (memsets moved,
    of them replaced by store kernels). DriverError: a driver without these calls (before any
    change), or a call that failed (apply_hoists' order keeps the graph's orderings): either way
    the graph can be instantiated as it is."""
    g = DriverGraph(graph)
    plan = plan_hoists(g)
    return len(plan), apply_hoists(g, g, plan, as_kernels)
