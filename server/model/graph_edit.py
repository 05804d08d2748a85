"""Edits of a captured CUDA graph before it is instantiated: cuBLAS's workspace memsets moved off
the step's critical path.

cuBLASLt puts a small memset node before some of its GEMM kernels (a few bytes of its workspace,
zeroed for the kernel; the fp8 FFN key product at 1,024 rows has one in every layer). Captured
in stream order, the memset depends on the kernel before it, so the GEMM starts only after that
kernel, then the memset, each with its launch latency (docs/performance.md, "Idle time inside
the B=1,024 decode graph"). The edit gives each such memset its predecessor's own
dependencies instead (it then runs beside that kernel) and makes the GEMM depend on both.

When a move is safe: the memset is small (at most MAX_BYTES), every node that waits for it is a
cuBLAS kernel (so it is cuBLAS's own memset, not a tensor's), and the one node it followed is not
a cuBLAS kernel. Only cuBLAS kernels touch cuBLAS's workspace, and every earlier cuBLAS kernel of
the stream is still an ancestor of the memset (through the predecessor's dependencies), so the
workspace is zeroed after its last reader and before the next, as captured.

Moved, a memset node still costs a few microseconds on the GEMM's path (docs/performance.md: the
executor's memset-to-kernel hand-off). With `as_kernels`, a moved memset that fills 4 aligned bytes
becomes a one-thread kernel node storing the same word (`STORE_PTX`, compiled by the driver), and
the memset node goes: kernel-to-kernel hand-offs are the cheap ones.

`plan_hoists` decides over a small graph protocol (plain Python: the CPU tests run it on a fake
graph); `server.model.graph_driver` applies them to a raw `cudaGraph_t` through the CUDA driver
API (`hoist_memsets`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_BYTES = 64
"""The largest memset that `plan_hoists` moves (cuBLASLt's are 4 bytes)."""

CUBLAS_KERNEL = re.compile(r"nvjet|xmma|cutlass|cublas|gemmk|gemm_|splitkreduce", re.IGNORECASE)
"""Kernel names of cuBLAS / cuBLASLt (Hopper's `nvjet_*`, the `sm90_xmma_gemm_*` and CUTLASS
families, split-K reductions). None of this project's kernels may match (test_graph_edit checks):
one taken for cuBLAS's after a small memset of ours would let that memset move."""


@dataclass(frozen=True)
class Store32:
    """What a 4-byte memset writes, as one 32-bit store: its address and word."""

    dst: int
    word: int


def store32(dst: int, value: int, element_size: int, width: int, height: int) -> Store32 | None:
    """The memset (cuMemsetD8/D16/D32-style: `width` elements of `element_size` bytes, each
    `value`) as a 32-bit store, when it fills exactly 4 aligned bytes; else None."""
    if element_size not in (1, 2, 4) or element_size * width != 4 or height > 1 or dst % 4:
        return None
    mask = (1 << 8 * element_size) - 1  # the element's bits of value, repeated over the word
    return Store32(dst, (value & mask) * (0xFFFFFFFF // mask))


class GraphView(Protocol):
    """What `plan_hoists` reads of a graph. Nodes are opaque handles (ints)."""

    def nodes(self) -> Sequence[int]: ...
    def kind(self, node: int) -> str: ...  # "kernel", "memset", or another node type's name
    def name(self, node: int) -> str: ...  # a kernel's name ("" for other nodes)
    def memset_bytes(self, node: int) -> int: ...
    def memset_store(self, node: int) -> Store32 | None: ...  # store32 of a memset node
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
    def add_store_kernel(self, deps: Sequence[int], store: Store32) -> int: ...  # the new node
    def destroy(self, node: int) -> None: ...  # the node and its edges


def apply_hoists(g: GraphView, ed: GraphEditor, plan: Sequence[Hoist], as_kernels: bool = False) -> int:
    """Carry out each move; returns how many memsets became store kernels (as_kernels).
    A move: `dep -> memset` for each of after's dependencies and `after -> user` for each user of
    the memset come (unless there), then `after -> memset` goes. A store kernel: the kernel node
    after the new dependencies, `kernel -> user` and `after -> user` for each user, then the
    memset node goes. Whatever is added comes before what is removed, so a call that fails midway
    leaves a graph with no fewer orderings than the captured one (a store kernel that could not
    be tied to its users is destroyed again: left loose it could run beside them)."""
    kernels = 0
    for h in plan:
        for u in h.users:
            if h.after not in g.deps(u):
                ed.add_edge(h.after, u)
        store = g.memset_store(h.memset) if as_kernels else None
        if store is None:
            for d in h.new_deps:
                ed.add_edge(d, h.memset)
            ed.remove_edge(h.after, h.memset)
            continue
        node = ed.add_store_kernel(h.new_deps, store)
        try:
            for u in h.users:
                ed.add_edge(node, u)
        except BaseException:
            ed.destroy(node)
            raise
        ed.destroy(h.memset)
        kernels += 1
    return kernels
