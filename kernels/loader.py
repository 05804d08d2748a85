"""Build and load the WKV-7 CUDA kernels at first use (never at import).

The kernels are plain CUDA C++ with a C ABI (no torch headers): `nvcc` builds one shared
library in a few seconds, which is loaded with ctypes and called with raw pointers on torch's
current stream (so the launches are captured by CUDA graphs like any torch op). All dtype
combinations are compiled into one library; the build is cached per (GPU arch, head size,
sources, nvcc version) under ~/.cache/rwkv-server/kernels/<key>/ (RWKV_KERNEL_CACHE overrides).
Build order: exact arch machine code (sm_90 on the H200), then a generic PTX fallback that the
driver compiles at load. Any failure (no nvcc, no CUDA, a compile error) is logged once and
`load()` returns None, so callers keep the pure-torch path. RWKV_KERNELS=0 (or =torch, as the model
reads it) disables the kernels.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from kernels.signatures import HEADERS, SIGNATURES, SOURCES

log = logging.getLogger("rwkv.kernels")

KERNEL_DIR = Path(__file__).resolve().parent
DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

_lock = threading.Lock()
_libs: dict[tuple, ctypes.CDLL | None] = {}
_CTYPES = {"i": ctypes.c_int, "ll": ctypes.c_longlong, "f": ctypes.c_float, "p": ctypes.c_void_p}


def cache_root() -> Path:
    env = os.environ.get("RWKV_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rwkv-server" / "kernels"


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((KERNEL_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def build_key(arch: tuple[int, int], head_size: int, nvcc_version: str) -> str:
    tag = hashlib.sha256(nvcc_version.encode()).hexdigest()[:6]
    return f"wkv7-sm{arch[0]}{arch[1]}-N{head_size}-{_source_hash()}-nvcc{tag}"


def _arch_flags(arch: tuple[int, int]) -> list[list[str]]:
    cc = f"{arch[0]}{arch[1]}"
    return [
        [f"-gencode=arch=compute_{cc},code=sm_{cc}"],  # this GPU's own machine code
        ["-gencode=arch=compute_75,code=compute_75"],  # generic PTX, compiled by the driver
    ]


def _compile(nvcc: str, out: Path, arch: tuple[int, int], head_size: int) -> list[str]:
    base = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-DRWKV_HEAD_SIZE={head_size}"]
    srcs = [str(KERNEL_DIR / s) for s in SOURCES]
    errors = []
    for flags in _arch_flags(arch):
        cmd = base + flags + ["-o", str(out)] + srcs
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            return flags
        errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
    raise RuntimeError("nvcc failed:\n" + "\n".join(errors))


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, codes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [_CTYPES[c] for c in codes], ctypes.c_int
    return lib


def _build_or_load(arch: tuple[int, int], head_size: int) -> ctypes.CDLL:
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME)")
    key = build_key(arch, head_size, _nvcc_version(nvcc))
    d = cache_root() / key
    d.mkdir(parents=True, exist_ok=True)
    lib_path = d / "libwkv7.so"
    with open(d / "lock", "w") as lock:  # one builder per key across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib_path.exists():
            log.info("WKV-7 kernels: loaded cached %s", lib_path)
            return _open(lib_path)
        t0 = time.perf_counter()
        tmp = d / f"libwkv7.{os.getpid()}.tmp.so"
        flags = _compile(nvcc, tmp, arch, head_size)
        os.replace(tmp, lib_path)
        log.info("WKV-7 kernels: built %s (%s) in %.1fs", lib_path, " ".join(flags), time.perf_counter() - t0)
    return _open(lib_path)


def load(device=None, head_size: int = 64) -> ctypes.CDLL | None:
    """The kernel library for this CUDA device and head size, building it if needed; None if
    the kernels cannot be used here (the reason is logged once)."""
    if os.environ.get("RWKV_KERNELS", "auto") in ("0", "torch"):
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        arch = torch.cuda.get_device_capability(device)
    except Exception:  # pragma: no cover - broken CUDA install
        return None
    key = (arch, head_size)
    with _lock:
        if key not in _libs:
            try:
                _libs[key] = _build_or_load(arch, head_size)
            except Exception as e:
                log.warning("WKV-7 kernels unavailable, using the pure-torch path: %s", e)
                _libs[key] = None
        return _libs[key]
