"""server.model.graph_edit's plan and edits over a fake graph (the CPU half; the driver half and
the GPU results: test_quant_gpu.py's hoisted-memset tests)."""

from __future__ import annotations

import pytest

from server.model.graph_edit import Hoist, Store32, apply_hoists, plan_hoists, store32


class FakeGraph:
    """GraphView and GraphEditor over named nodes: (kind, kernel name or memset bytes)."""

    def __init__(self, nodes: dict[str, tuple[str, str | int]], edges: list[tuple[str, str]]):
        self.info = nodes
        self.ids = {name: i + 1 for i, name in enumerate(nodes)}
        self.names = {i: name for name, i in self.ids.items()}
        self.edges = {(self.ids[a], self.ids[b]) for a, b in edges}
        self.log: list[tuple[str, str, str]] = []

    def nodes(self):
        return list(self.names)

    def kind(self, node):
        return self.info[self.names[node]][0]

    def name(self, node):
        kind, what = self.info[self.names[node]]
        return what if kind == "kernel" else ""

    def memset_bytes(self, node):
        return self.info[self.names[node]][1]

    def memset_store(self, node):
        return store32(0x1000 + 16 * node, 7, 4, self.memset_bytes(node) // 4, 1)

    def add_store_kernel(self, deps, store):
        name = f"store@{store.dst:#x}"
        self.info[name] = ("kernel", "rwkv_store_u32")
        self.ids[name] = node = max(self.names) + 1
        self.names[node] = name
        self.stores = getattr(self, "stores", []) + [(name, store)]
        self.log.append(("k", ",".join(self.names[d] for d in deps), name))
        self.edges |= {(d, node) for d in deps}
        return node

    def destroy(self, node):
        self.log.append(("x", self.names[node], ""))
        self.edges = {(a, b) for a, b in self.edges if node not in (a, b)}
        del self.info[self.names.pop(node)]

    def deps(self, node):
        return sorted(a for a, b in self.edges if b == node)

    def users(self, node):
        return sorted(b for a, b in self.edges if a == node)

    def remove_edge(self, src, dst):
        self.log.append(("-", self.names[src], self.names[dst]))
        self.edges.remove((src, dst))

    def add_edge(self, src, dst):
        self.log.append(("+", self.names[src], self.names[dst]))
        self.edges.add((src, dst))

    def named_edges(self):
        return {(self.names[a], self.names[b]) for a, b in self.edges}

    def ancestors(self, name):
        out, todo = set(), [self.ids[name]]
        while todo:
            for d in self.deps(todo.pop()):
                if d not in out:
                    out.add(d)
                    todo.append(d)
        return {self.names[a] for a in out}


KEY_GEMM = "nvjet_sm90_tst_320x64_64x4_2x1_v_bz_coopA_TNN"


def ffn_layer(memset_bytes=4, before_memset="add_ln_mix_kernel", user=KEY_GEMM):
    """One FFN as the fp8 decode graph captures it at 1,024 rows: the output projection's GEMM,
    add_ln_mix, cuBLASLt's memset, the FFN key GEMM, quant_rows, the FFN value GEMM; a LoRA
    branch joins before add_ln_mix."""
    nodes = {
        "o_gemm": ("kernel", "nvjet_sm90_ootst_128x128_128x4_1x2_h_bz_coopA_TNT"),
        "lora": ("kernel", "lora_act_kernel"),
        "k": ("kernel", before_memset),
        "memset": ("memset", memset_bytes),
        "key_gemm": ("kernel", user),
        "quant": ("kernel", "quant_rows_kernel"),
        "value_gemm": ("kernel", "nvjet_sm90_ootst_128x128_128x4_1x2_h_bz_coopA_TNT"),
    }
    edges = [("o_gemm", "k"), ("lora", "k"), ("k", "memset"), ("memset", "key_gemm"), ("key_gemm", "quant"),
             ("quant", "value_gemm")]  # fmt: skip
    return FakeGraph(nodes, edges)


def test_the_ffn_key_memset_runs_beside_the_kernel_before_it():
    g = ffn_layer()
    before = {n: g.ancestors(n) for n in ("key_gemm", "value_gemm", "quant")}
    plan = plan_hoists(g)
    assert plan == [Hoist(g.ids["memset"], g.ids["k"], (g.ids["o_gemm"], g.ids["lora"]), (g.ids["key_gemm"],))]
    apply_hoists(g, g, plan)
    assert g.named_edges() == {("o_gemm", "k"), ("lora", "k"), ("o_gemm", "memset"), ("lora", "memset"),
                               ("memset", "key_gemm"), ("k", "key_gemm"), ("key_gemm", "quant"),
                               ("quant", "value_gemm")}  # fmt: skip
    # the memset no longer waits for add_ln_mix; everything after it waits for what it did
    assert g.ancestors("memset") == {"o_gemm", "lora"}
    assert {n: g.ancestors(n) for n in before} == before
    # edges come first, the removal last: a failure midway only leaves extra orderings
    assert g.log[-1] == ("-", "k", "memset") and all(op == "+" for op, _, _ in g.log[:-1])


def test_an_edit_keeps_an_edge_that_is_already_there():
    g = ffn_layer()
    g.add_edge(g.ids["k"], g.ids["key_gemm"])
    g.log.clear()
    apply_hoists(g, g, plan_hoists(g))
    assert ("+", "k", "key_gemm") not in g.log
    assert ("k", "key_gemm") in g.named_edges()


@pytest.mark.parametrize(
    "layer",
    [
        # after a cuBLAS kernel: it may be the one that reads the workspace
        dict(before_memset="nvjet_sm90_tst_128x128_128x4_1x2_h_bz_coopA_TNT"),
        dict(before_memset="sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64"),
        # a tensor's memset before one of our kernels (not cuBLAS's workspace)
        dict(user="add_ln_mix_kernel"),
        # too large to be cuBLAS's counter
        dict(memset_bytes=4096),
    ],
)
def test_memsets_that_are_not_moved(layer):
    g = ffn_layer(**layer)
    assert plan_hoists(g) == []


def test_a_memset_with_no_or_two_predecessors_is_not_moved():
    g = ffn_layer()
    g.remove_edge(g.ids["k"], g.ids["memset"])  # a root memset
    assert plan_hoists(g) == []
    g.add_edge(g.ids["k"], g.ids["memset"])
    g.add_edge(g.ids["lora"], g.ids["memset"])  # two predecessors
    assert plan_hoists(g) == []


def test_a_memset_after_a_root_kernel_becomes_a_root():
    g = FakeGraph({"k": ("kernel", "add_ln_mix_kernel"), "m": ("memset", 4), "gemm": ("kernel", KEY_GEMM)},
                  [("k", "m"), ("m", "gemm")])  # fmt: skip
    apply_hoists(g, g, plan_hoists(g))
    assert g.named_edges() == {("k", "gemm"), ("m", "gemm")}


def test_as_kernels_a_memset_becomes_a_store_kernel_beside_the_kernel_before_it():
    g = ffn_layer()
    m = g.ids["memset"]
    before = {n: g.ancestors(n) - {"memset"} for n in ("key_gemm", "value_gemm")}
    assert apply_hoists(g, g, plan_hoists(g), as_kernels=True) == 1
    (store_name, store), = g.stores
    assert store == Store32(0x1000 + 16 * m, 7)  # the memset's address and word
    assert "memset" not in g.names.values()
    assert g.ancestors(store_name) == {"o_gemm", "lora"}
    assert {n: g.ancestors(n) - {store_name} for n in before} == before
    assert (store_name, "key_gemm") in g.named_edges() and ("k", "key_gemm") in g.named_edges()
    assert g.log[-1] == ("x", "memset", "")  # the memset goes last


def test_as_kernels_other_sizes_are_only_moved():
    g = ffn_layer(memset_bytes=8)
    assert apply_hoists(g, g, plan_hoists(g), as_kernels=True) == 0
    assert ("o_gemm", "memset") in g.named_edges() and ("k", "memset") not in g.named_edges()


def test_a_store_kernel_that_cannot_be_tied_to_its_users_is_destroyed_again():
    g = ffn_layer()

    def refuse(src, dst):
        if g.names[src].startswith("store@"):
            raise RuntimeError("cuGraphAddDependencies_v2: CUresult 1")
        FakeGraph.add_edge(g, src, dst)

    g.add_edge = refuse
    with pytest.raises(RuntimeError):
        apply_hoists(g, g, plan_hoists(g), as_kernels=True)
    assert [op for op, _, _ in g.log][-2:] == ["k", "x"]
    assert not any(name.startswith("store@") for name in g.names.values())
    assert ("k", "memset") in g.named_edges() and ("memset", "key_gemm") in g.named_edges()


@pytest.mark.parametrize(
    "args, store",
    [
        ((0x100, 0, 4, 1, 1), Store32(0x100, 0)),
        ((0x100, 0xAB, 1, 4, 1), Store32(0x100, 0xABABABAB)),
        ((0x100, 0x1234, 2, 2, 1), Store32(0x100, 0x12341234)),
        ((0x100, 0x1FF, 1, 4, 1), Store32(0x100, 0xFFFFFFFF)),  # cuMemsetD8 keeps the low byte
        ((0x102, 0, 4, 1, 1), None),  # not 4-byte aligned
        ((0x100, 0, 4, 2, 1), None),  # 8 bytes
        ((0x100, 0, 4, 1, 2), None),  # two rows
        ((0x100, 0, 8, 0, 1), None),
    ],
)
def test_store32_is_what_the_memset_writes(args, store):
    assert store32(*args) == store


def _our_kernel_names() -> set[str]:
    """The names of this project's device kernels: the CUDA sources' __global__ functions and the
    Triton kernels (@triton.jit) of server/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = set()
    for f in (root / "kernels").glob("*.cu*"):
        for head in re.findall(r"__global__\s+void\s+([^{;]*)", f.read_text()):
            names.update([n for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", head) if not n.startswith("__")][:1])
    for f in (root / "server").rglob("*.py"):
        names.update(re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+)", f.read_text()))
    return names


def test_none_of_our_kernels_passes_for_cublas():
    """CUBLAS_KERNEL tells cuBLAS's kernels from ours: one of ours taken for cuBLAS's after a
    small memset of ours would let that memset move beside the kernel before it."""
    from server.model.graph_edit import CUBLAS_KERNEL

    ours = _our_kernel_names()
    assert {"add_ln_mix_v2_kernel", "tmix_pipe_kernel", "quant_rows_kernel", "sampler_kernel", "w8_mm"} <= ours
    assert not [n for n in ours if CUBLAS_KERNEL.search(n)]
    seen = ["nvjet_sm90_qqhsh_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "nvjet_sm90_hsh_168x128_64x5_1x2_h_bz_TNN",
            "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64", "cutlass_80_tensorop_h16816gemm_256x128",
            "void splitKreduce_kernel<32, 16, int, float>"]  # fmt: skip
    assert all(CUBLAS_KERNEL.search(n) for n in seen)


LAYOUT_C = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
    printf("%zu %zu %zu %zu\n", sizeof(CUDA_KERNEL_NODE_PARAMS_v1), offsetof(CUDA_KERNEL_NODE_PARAMS_v1, sharedMemBytes),
           offsetof(CUDA_KERNEL_NODE_PARAMS_v1, kernelParams), offsetof(CUDA_KERNEL_NODE_PARAMS_v1, extra));
    printf("%zu %zu %zu\n", sizeof(CUDA_KERNEL_NODE_PARAMS_v2), offsetof(CUDA_KERNEL_NODE_PARAMS_v2, kern),
           offsetof(CUDA_KERNEL_NODE_PARAMS_v2, ctx));
    printf("%zu %zu %zu\n", sizeof(CUDA_MEMSET_NODE_PARAMS), offsetof(CUDA_MEMSET_NODE_PARAMS, elementSize),
           offsetof(CUDA_MEMSET_NODE_PARAMS, height));
    return 0;
}
"""


def test_the_driver_structs_are_laid_out_as_cuda_h_says(tmp_path):
    """graph_driver's ctypes structures against the CUDA toolkit's cuda.h, compiled by the C
    compiler (the store kernel's node parameters have not run on a GPU yet: a wrong offset there
    would hand the driver garbage)."""
    import ctypes
    import glob
    import os
    import shutil
    import subprocess

    from server.model import graph_driver as d

    cc = shutil.which("cc") or shutil.which("gcc")
    homes = [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"))]
    inc = next((f"{h}/include" for h in homes if h and os.path.exists(f"{h}/include/cuda.h")), None)
    if cc is None or inc is None:
        pytest.skip("needs a C compiler and the CUDA toolkit's cuda.h")
    (tmp_path / "layout.c").write_text(LAYOUT_C)
    subprocess.run([cc, f"-I{inc}", str(tmp_path / "layout.c"), "-o", str(tmp_path / "layout")], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split("\n")

    def ours(struct, *fields):
        return " ".join(str(v) for v in (ctypes.sizeof(struct), *(getattr(struct, f).offset for f in fields)))

    assert out[0] == ours(d._KernelParamsV1, "shared_bytes", "params", "extra")
    assert out[1] == ours(d._KernelParams, "kern", "ctx")
    assert out[2] == ours(d._MemsetParams, "element_size", "height")
