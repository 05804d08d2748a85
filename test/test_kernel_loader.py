"""kernels.loader without a GPU: the generated pybind11 binding, the cache key, the no-CUDA path,
kernels="torch" (nothing built), the one-warning fallback, and (where nvcc and ninja exist) a real
build + import of the module with torch.utils.cpp_extension into a temporary cache."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import loader
from kernels.signatures import HEADERS, SIGNATURES, SOURCES

C_TYPE = {"i": "int", "ll": "long long", "f": "float", "p": "void*"}


def _decls(text: str) -> dict[str, list[str]]:
    """name -> parameter types of the extern "C" declarations of the generated binding."""
    block = re.search(r'extern "C" \{(.*?)\n\}', text, re.S).group(1)
    out = {}
    for name, params in re.findall(r"^int (\w+)\(([^)]*)\);$", block, re.M):
        out[name] = [p.strip() for p in params.split(",")] if params.strip() else []
    return out


def test_binding_declares_every_signature():
    text = loader.binding_source()
    includes = re.findall(r"#include\s*(\S+)", text)
    assert includes == ["<cstdint>", "<pybind11/pybind11.h>"]  # no <torch/extension.h>
    decls = _decls(text)
    assert list(decls) == list(SIGNATURES)
    for name, codes in SIGNATURES.items():
        assert decls[name] == [C_TYPE[c] for c in codes], name


def test_binding_defs_take_python_ints_for_pointers():
    text = loader.binding_source()
    defs = dict(re.findall(r'm\.def\("(\w+)", \[\]\(([^)]*)\)', text))
    assert list(defs) == list(SIGNATURES)
    want = {"i": "int", "ll": "long long", "f": "float", "p": "std::uintptr_t"}
    for name, codes in SIGNATURES.items():
        params = [p.strip().rsplit(" ", 1)[0] for p in defs[name].split(",")]
        assert params == [want[c] for c in codes], name
        call = re.search(rf"return {name}\((.*)\); \}}\);", text).group(1)
        args = [a.strip() for a in call.split(",")]
        assert len(args) == len(codes)
        for a, c in zip(args, codes):
            assert a.startswith("reinterpret_cast<void*>(") == (c == "p"), (name, a)


def test_binding_of_a_new_entry():
    text = loader.binding_source({"k": ["i", "ll", "f", "p"], "k2": []})
    assert _decls(text) == {"k": ["int", "long long", "float", "void*"], "k2": []}
    assert 'm.def("k", [](int a0, long long a1, float a2, std::uintptr_t a3)' in text
    assert "return k(a0, a1, a2, reinterpret_cast<void*>(a3));" in text


def _cu_definitions() -> dict[str, list[str]]:
    """name -> argument codes of the extern "C" launchers as the .cu files define them."""
    base = {"int": "i", "long long": "ll", "float": "f"}
    out = {}
    for src in SOURCES:
        text = (loader.KERNEL_DIR / src).read_text()
        for name, params in re.findall(r'extern\s+"C"\s+int\s+(\w+)\s*\(([^)]*)\)', text):
            codes = []
            for p in (p.strip() for p in params.split(",") if p.strip()):
                if "*" in p:
                    codes.append("p")
                else:
                    words = p.replace("const ", "").split()
                    codes.append(base.get(" ".join(words[:-1]), "?" + p))
            out[name] = codes
    return out


def test_signatures_match_the_cu_definitions():
    """The table and the launchers agree (a mismatch would be silent undefined behaviour)."""
    defs = _cu_definitions()
    for name, codes in SIGNATURES.items():
        assert name in defs, f"{name} is not defined in any of {SOURCES}"
        assert defs[name] == codes, name


def _kernel_copy(tmp_path: Path) -> Path:
    d = tmp_path / "kernels"
    d.mkdir()
    for name in SOURCES + HEADERS:
        shutil.copy(loader.KERNEL_DIR / name, d / name)
    return d


def test_cache_key_changes_with_source_head_size_and_arch(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "KERNEL_DIR", _kernel_copy(tmp_path))
    key = loader.build_key("9.0+PTX", 64, "torch x cuda y")
    assert key.isidentifier() and key.startswith("wkv7_sm90ptx_N64_")
    assert loader.build_key("9.0+PTX", 64, "torch x cuda y") == key  # deterministic
    assert loader.build_key("9.0+PTX", 128, "torch x cuda y") != key
    assert loader.build_key("8.0+PTX", 64, "torch x cuda y") != key
    assert loader.build_key("9.0", 64, "torch x cuda y") != key
    assert loader.build_key("9.0+PTX", 64, "torch x cuda z") != key
    assert loader.build_key("9.0+PTX", 64, "torch x cuda y", binding="// other") != key
    for name in SOURCES + HEADERS:
        f = loader.KERNEL_DIR / name
        old = f.read_bytes()
        f.write_bytes(old + b"\n// edited\n")
        assert loader.build_key("9.0+PTX", 64, "torch x cuda y") != key, name
        f.write_bytes(old)
    assert loader.build_key("9.0+PTX", 64, "torch x cuda y") == key


def test_arch_list_and_gencode():
    assert loader.arch_list((9, 0)) == "9.0+PTX"
    assert loader._gencode("9.0+PTX") == (
        "-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90")


def _no_build(*a, **k):
    raise AssertionError("load() must not build here")


def test_load_without_cuda_returns_none_and_builds_nothing(tmp_path, monkeypatch, caplog):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loader, "_mods", {})
    monkeypatch.setattr(loader, "build", _no_build)
    with caplog.at_level(logging.INFO, logger="rwkv.kernels"):
        assert loader.load(cache_root=tmp_path / "cache") is None
        assert loader.load(cache_root=tmp_path / "cache") is None
    assert not (tmp_path / "cache").exists()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CUDA is not available" in warnings[0].getMessage()


def test_kernels_torch_builds_nothing_even_with_a_gpu(monkeypatch):
    """kernels="torch": the model's ops are the pure-torch ones and nothing is built or loaded, so
    the sampler (loaded_any) finds no module either."""
    import torch

    from server.model import ops
    from server.model.rwkv7 import OP_NAMES, select_ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # even with a GPU
    monkeypatch.setattr(loader, "_mods", {})
    monkeypatch.setattr(loader, "_keys", {})
    monkeypatch.setattr(loader, "build", _no_build)
    chosen = select_ops(torch.device("cuda"), "torch")
    assert all(getattr(chosen, n) is getattr(ops, n) for n in OP_NAMES)
    assert loader._mods == {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert loader.loaded_any("cuda") is None  # and it never builds


def test_unknown_kernels_value_is_refused_before_loading(monkeypatch):
    import torch

    from server.model import load_model
    from server.model.rwkv7 import select_ops

    with pytest.raises(ValueError, match="kernels must be one of auto, torch, cuda"):
        select_ops(torch.device("cpu"), "0")
    monkeypatch.setattr("server.model.checkpoint.read_checkpoint", _no_build)  # refused before the read
    with pytest.raises(ValueError, match="not 'fast'"):
        load_model("/nonexistent.pth", kernels="fast")


def test_loaded_any_finds_a_loaded_module_by_capability(monkeypatch):
    """The sampler's lookup: a module another spelling of the device loaded ("cuda:0" vs "cuda"),
    whatever its head size; never a build."""
    import torch

    mod = object()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(loader, "_mods", {((9, 0), 32): mod})
    monkeypatch.setattr(loader, "_keys", {("cuda", 32): ((9, 0), 32)})
    monkeypatch.setattr(loader, "build", _no_build)
    assert loader.loaded_any("cuda") is mod
    assert loader.loaded_any("cuda:0") is mod
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert loader.loaded_any("cuda:1") is None  # another GPU model: nothing loaded for it


def test_import_is_light(tmp_path):
    code = (
        "import sys; import kernels.loader as L; import server.model.cuda_ops; "
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'imported at import'; "
        f"assert L.load(cache_root={str(tmp_path / 'cache')!r}) is None; "
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'imported without CUDA'"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert not (tmp_path / "cache").exists()


def _fake_gpu(monkeypatch, calls, outcome):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(loader, "_mods", {})

    def fake_build(arch_list, head_size, *a, **k):
        calls.append(arch_list)
        return outcome(arch_list)

    monkeypatch.setattr(loader, "build", fake_build)


def test_compile_error_logs_one_warning_and_falls_back(monkeypatch, caplog):
    calls = []
    out = ("Error building extension 'wkv7_x': [1/5] /usr/local/cuda/bin/nvcc " + "-I/x " * 200 + "\n"
           "FAILED: wkv7_decode.cuda.o\n"
           "/work/kernels/wkv7_decode.cu(12): error: identifier \"oops\" is undefined\n"
           "1 error detected in the compilation of \"wkv7_decode.cu\".\n"
           "ninja: build stopped: subcommand failed.\n")

    def fail(arch_list):
        raise RuntimeError(out)

    _fake_gpu(monkeypatch, calls, fail)
    with caplog.at_level(logging.INFO, logger="rwkv.kernels"):
        assert loader.load(head_size=64) is None
        assert loader.load(head_size=64) is None  # cached: no second build, no second warning
    assert calls == ["9.0+PTX"]  # a real compile error: no PTX retry
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert 'error: identifier "oops" is undefined' in warnings[0]
    assert "-I/x -I/x" not in warnings[0]  # not the long command line


def test_unknown_arch_retries_with_generic_ptx(monkeypatch):
    calls = []
    mod = object()

    def outcome(arch_list):
        if arch_list == "9.0+PTX":
            raise RuntimeError("nvcc fatal   : Unsupported gpu architecture 'compute_90'")
        return mod, "key", True

    _fake_gpu(monkeypatch, calls, outcome)
    assert loader.load() is mod
    assert calls == ["9.0+PTX", loader.FALLBACK_ARCH_LIST]


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


@pytest.mark.slow
def test_cpp_extension_builds_and_imports_the_module(tmp_path, monkeypatch):
    """A real build (nvcc + ninja, ~10 s on 2 cores) into a temporary cache; runs on a CPU
    machine too: with a CPU-only torch, CUDA_HOME is pointed at the toolkit and torch's CUDA
    libraries (which the module does not use) are stubbed for the link."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME): the kernel build cannot be tried here")
    import torch
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja not found: torch.utils.cpp_extension cannot build")
    cuda_home = Path(nvcc).resolve().parents[1]
    extra = None
    if torch.version.cuda is None:  # CPU torch: no libc10_cuda / libtorch_cuda to link against
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda_home))
        stubs = tmp_path / "stubs"
        stubs.mkdir()
        for lib in ("c10_cuda", "torch_cuda"):
            subprocess.run(["gcc", "-shared", "-x", "c", "-", "-o", str(stubs / f"lib{lib}.so")],
                           input=b"", check=True)  # fmt: skip
        extra = ["-Wl,--as-needed", f"-L{stubs}", f"-Wl,-rpath,{cuda_home / 'lib64'}"]
    root = tmp_path / "cache"
    mod, key, built = loader.build("9.0+PTX", 64, root=root, extra_ldflags=extra)
    assert built and (root / key / f"{key}.so").exists()
    # the arch is the loader's own -gencode flags: torch adds none (it would read TORCH_CUDA_ARCH_LIST)
    ninja = (root / key / "build.ninja").read_text()
    assert sorted(set(re.findall(r"-gencode=\S+", ninja))) == sorted(loader.arch_flags("9.0+PTX"))
    assert (root / key / "binding.cpp").read_text() == loader.binding_source()
    for name, codes in SIGNATURES.items():
        fn = getattr(mod, name)
        rc = fn(*[0.0 if c == "f" else 0 for c in codes])  # all sizes 0: nothing is launched
        assert isinstance(rc, int), name
        with pytest.raises(TypeError):
            fn(*[0] * (len(codes) - 1))
    mod2, key2, built2 = loader.build("9.0+PTX", 64, root=root, extra_ldflags=extra)
    assert key2 == key and not built2 and mod2 is not None  # the cached build


@pytest.mark.slow
def test_head_size_dependent_sources_compile_for_head_size_32(tmp_path):
    """The kernels are templated on the build's head size; a kernel that only supports 64 must
    drop out of a head-size-32 build (its launcher returns -2), not break it. nvcc alone, no GPU."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME): the kernel sources cannot be compiled here")
    for name in SOURCES:
        text = (loader.KERNEL_DIR / name).read_text()
        if "wkv7_common.cuh" not in text and "wkv7_tmix" not in text:
            continue  # no head size in it
        cmd = [nvcc, "-arch=sm_90", *loader.nvcc_flags(32), "-c", str(loader.KERNEL_DIR / name),
               "-o", str(tmp_path / f"{name}.o")]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        assert run.returncode == 0, f"{name} at head size 32:\n{run.stderr[-2000:]}"
