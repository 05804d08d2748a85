"""The subcommands' argument checks (synth, quantize: the output path, the input checkpoint, a
synthetic checkpoint's size against this machine's memory) and the probes the start-up checks
share: whether a file can be read, how much memory the machine has. Each `*_problem` returns one
line or None, as server/checks.py's do (split from it for size)."""

from __future__ import annotations

import os


def unreadable(path: str) -> str | None:
    """Why the file `path` cannot be opened for reading ("permission denied", ...), or None. The
    open itself is the check (os.access misses ACLs and root's dropped capabilities)."""
    try:
        open(path, "rb").close()
    except OSError as exc:
        return "permission denied" if isinstance(exc, PermissionError) else (exc.strerror or str(exc))
    return None


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # (no sysconf, or no such name here)
        return None


def size_text(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / 1024**3:,.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:,.1f} MiB"


def synth_problem(preset: str, dtype_bytes: int) -> str | None:
    """Why `synth PRESET` cannot write its checkpoint (one line), or None: a spec its parser
    refuses (an unknown preset, a bad seed), or a shape whose checkpoint would not fit in this
    machine's memory. The bound is the machine's: synth draws every tensor before torch.save
    writes them, so the whole checkpoint is in memory at once; beyond, it would grow until the
    allocator fails (or the kernel kills it) after minutes of drawing weights."""
    from server.model.synthetic import parameters, parse_spec

    try:
        shape, _ = parse_spec(preset if preset.startswith("synthetic:") else f"synthetic:{preset}")
    except ValueError as exc:
        return str(exc)
    count, memory = parameters(shape), physical_memory()
    if memory is not None and (need := count * dtype_bytes) > memory:
        return (f"synth {preset}: the checkpoint would be {size_text(need)} ({count:,} values), held whole in memory "
                f"while it is written, and this machine has {size_text(memory)}")  # fmt: skip
    return None


def stdout_problem(out: str) -> str | None:
    """synth and quantize write a checkpoint file: `-` is not taken for standard output (nor made
    a file of that name by mistake)."""
    if out == "-":
        return (
            "-: the checkpoint is written to a file, not to standard output; give the output file's path "
            "(./- names a file '-')"
        )
    return None


def output_problem(path: str) -> str | None:
    """Why a file cannot be written at `path` (a folder, no folder, no permission), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path}: is a folder; give the output file's path"
    if not os.path.isdir(folder):
        return f"{path}: no folder {folder}"
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path}: cannot write it (permission denied)"
    return None


def quantize_problem(model: str, out: str) -> str | None:
    """Why `quantize MODEL OUT` cannot run (one line), or None: it reads a checkpoint file (a
    synthetic model is written to one first) and writes OUT."""
    if model.startswith("synthetic:"):
        preset = model.removeprefix("synthetic:")
        return (f"quantize reads a checkpoint file, not {model!r}: write one first with "
                f"`rwkv-server synth {preset} {preset.replace(':', '-')}.pth`, then quantize that file")  # fmt: skip
    if os.path.isdir(model):
        return f"{model}: is a folder; give the checkpoint file's path"
    if not os.path.isfile(model):
        return f"{model}: no such checkpoint file"
    if why := unreadable(model):
        return f"{model}: cannot read it ({why})"
    return output_problem(out)
