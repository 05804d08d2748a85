"""Load the model, tokenizer and engine (blocking; run in a thread) and describe what was loaded."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.api.services import LoadFacts, Services
from server.checks_args import size_text
from server.config import Settings
from server.engine.protocol import EngineAPI
from server.tokenizer import Tokenizer

if TYPE_CHECKING:  # (imports torch at run time)
    import torch

    from server.model.rwkv7 import RWKV7
    from server.model.state import ModelShape

log = logging.getLogger("server.load")

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

RANDOM_WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!  Model %s is a SYNTHETIC checkpoint with RANDOM weights: every output is
!!  random text. Good for tests and load tests only. For real answers start with
!!  --model /path/to/RWKV-x070-....pth (or RWKV_MODEL=...).
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name])


def model_id_of(spec: str) -> str:
    """The id clients see: the checkpoint's file name, or the synthetic spec."""
    if spec.startswith("synthetic:"):
        return spec
    return Path(spec).name


@dataclass
class Loaded:
    """A loaded model behind a started engine, and what loading found out."""

    engine: EngineAPI
    tokenizer: Tokenizer
    shape: ModelShape
    model_id: str
    facts: LoadFacts


def load_services(settings: Settings) -> Loaded:
    """Model, tokenizer and a started engine (one per device of --devices, behind a router).
    Logs progress."""
    spec = settings.resolved_model()
    if spec.startswith("synthetic:"):
        log.warning(RANDOM_WARNING, spec)
    if settings.debug_load_delay > 0:
        log.info("test hook debug_load_delay: sleeping %.1fs before loading", settings.debug_load_delay)
        time.sleep(settings.debug_load_delay)
    from server.tokenizer import get_tokenizer

    t0 = time.perf_counter()
    devices = settings.resolved_devices()
    tokenizer = get_tokenizer()
    tokenizer.encode("warm-up: the first encode builds lookup tables")  # not in a request's time
    engines: list[EngineAPI] = []
    kernel_log = _Collect()
    try:
        for device in devices:
            model = _load_model(spec, device, settings, kernel_log)
            engines.append(_start_engine(model, tokenizer, settings, device))
    except BaseException:
        for e in engines:  # the engines already started: their threads and copy threads
            e.shutdown(5.0)
        raise
    if getattr(model, "synthetic", False) and not spec.startswith("synthetic:"):
        log.warning(RANDOM_WARNING, spec)  # a file written by `rwkv-server synth`
    engine: EngineAPI = engines[0]
    if len(engines) > 1:
        from server.engine.router import EngineRouter

        engine = EngineRouter(engines, devices)
        log.info("%d engines (%s): new requests go to the least loaded", len(engines), ", ".join(devices))
    ops = getattr(model, "ops", None)
    kernels = sorted({getattr(fn, "__module__", "?") for fn in vars(ops).values()}) if ops is not None else []
    load = LoadFacts(
        seconds=round(time.perf_counter() - t0, 3),
        device=str(getattr(model, "device", devices[0])) if len(devices) == 1 else ", ".join(devices),
        kernel_modules=kernels,
        kernel_log=kernel_log.lines,
        quant=getattr(model, "quant", settings.quant),
    )
    return Loaded(
        engine=engine,
        tokenizer=tokenizer,
        shape=model.shape,
        model_id=getattr(model, "name", None) or model_id_of(spec),
        facts=load,
    )


def _device_scope(device: str) -> contextlib.AbstractContextManager[Any]:
    """The CUDA device current while a model loads and its engine captures its graphs (kernels
    launch on the calling thread's current device); nothing on the CPU."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(torch.device(device))


def _load_model(spec: str, device: str, settings: Settings, kernel_log: _Collect) -> RWKV7:
    from server.model import load_model

    log.info(
        "loading %s on %s (%s compute, %s state, %s weights) ...",
        spec,
        device,
        settings.resolved_dtype(),
        settings.resolved_state_dtype(),
        settings.quant if settings.quant != "none" else settings.resolved_dtype(),
    )
    t0 = time.perf_counter()
    logging.getLogger("rwkv.kernels").addHandler(kernel_log)
    try:
        with _device_scope(device):
            model = load_model(
                spec,
                device=device,
                dtype=torch_dtype(settings.resolved_dtype()),
                state_dtype=torch_dtype(settings.resolved_state_dtype()),
                kernels=settings.kernels,
                kernel_cache=settings.kernel_cache,
                quant=settings.quant,
                sparse_ffn=settings.sparse_ffn,
            )
    finally:
        logging.getLogger("rwkv.kernels").removeHandler(kernel_log)
    log.info("model loaded on %s in %.2fs; starting its engine ...", device, time.perf_counter() - t0)
    return model


def _start_engine(model: RWKV7, tokenizer: Tokenizer, settings: Settings, device: str) -> EngineAPI:
    from server.engine import Engine

    pool_check(model, settings, device)
    t0 = time.perf_counter()
    with _device_scope(device):
        engine = Engine(model, tokenizer, settings)
        engine.start()
    log.info("engine on %s started in %.2fs", device, time.perf_counter() - t0)
    return engine


def pool_check(model: RWKV7, settings: Settings, device: str) -> None:
    """ValueError (one line) when the engine's slot pool cannot fit in the memory left: a state
    and the sampler's vocabulary-wide rows (penalties, tokens seen) a slot, allocated as the
    engine starts. Here, not among the start-up checks: a slot's bytes depend on the model's
    shape, known once it is loaded (--max-batch's fixed bound, config.UPPER_BOUNDS, is theirs)."""
    from server.checks_args import physical_memory  # (looked up at each call: a test replaces it)

    slots = settings.resolved_max_batch(device)  # as the Engine takes it
    shape = model.shape
    each = shape.state_bytes(model.dtype, model.state_dtype) + 5 * shape.vocab_size
    memory: int | None = physical_memory()
    where = "this machine has"
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)  # free: the device's, and what torch's allocator holds unused
        memory = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        where = f"free on {device}"
    if memory is not None and (pool := slots * each) > memory:
        raise ValueError(
            f"--max-batch: a slot pool of {slots:,} slots would take {size_text(pool)} ({each:,} bytes a slot: "
            f"a state and the sampler's rows), more than the {size_text(memory)} {where}"
        )


class _Collect(logging.Handler):
    """Keeps the kernel loader's messages (builds, cache loads, fallbacks) for the facts."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def facts(services: Services) -> list[str]:
    """Human lines about what runs: shape, state size, slots, budgets, kernels, API keys."""
    s, shape, load = services.settings, services.shape, services.facts
    lines = [
        f"model      {services.model_id}",
        (
            f"shape      L={shape.n_layer} C={shape.n_embd} H={shape.n_head} N={shape.head_size} "
            f"V={shape.vocab_size} ffn={shape.ffn_dim}"
        ),
    ]
    with contextlib.suppress(Exception):  # a figure the start-up lines can do without
        per_seq = shape.state_bytes(torch_dtype(s.resolved_dtype()), torch_dtype(s.resolved_state_dtype()))
        lines.append(f"state      {_mib(per_seq)} per sequence ({s.resolved_state_dtype()} WKV)")
    if "," in load.device:  # --devices
        lines.append(f"devices    {load.device} (an engine each), compute {s.resolved_dtype()}")
    else:
        lines.append(f"device     {load.device or s.resolved_device()}, compute {s.resolved_dtype()}")
    if load.quant != "none":
        how = "" if s.quant == load.quant else ", as the checkpoint holds them"
        lines.append(f"weights    {load.quant}: the layers' r/k/v/o and FFN linears (per-channel scales{how})")
    else:
        lines.append(f"weights    {s.resolved_dtype()} (no --quant)")
    slots = s.resolved_max_batch()
    with contextlib.suppress(Exception):
        slots = services.engine.stats().slots or slots
    each = "" if slots == s.resolved_max_batch() else ", each engine's"  # one engine per device (--devices)
    lines.append(f"slots      {slots} (step budget {s.step_token_budget} tokens, queue {s.max_queue}{each})")
    talks = _mib(s.conversation_cache_bytes) if s.conversation_cache_bytes else "off"
    lines.append(
        f"caches     state LRU {_mib(s.state_cache_bytes)}, TMP states {_mib(s.tmp_state_bytes)}, "
        f"write-behind {_mib(s.write_behind_bytes)}, DB states {_mib(s.db_budget_bytes)}, "
        f"chat prefix {_mib(prefix_budget(s))}, conversations {talks}"
    )
    memory = f"in memory (not persisted; {s.db_shown()})" if s.db_in_memory() else s.db_shown()
    lines.append(f"database   {memory}")  # a URL's password never reaches the log
    if load.kernel_modules:
        lines.append(f"kernels    WKV ops from {', '.join(load.kernel_modules)}")
    lines += [f"kernels    {msg}" for msg in load.kernel_log]
    lines.append(f"API keys   {api_keys_fact(s)}")
    lines.append(f"loaded in  {load.seconds:.2f}s")
    return lines


def api_keys_fact(settings: Settings) -> str:
    """Whether /v1 routes need a key: "on (N keys)" or "off: every route is open"."""
    n = len(settings.api_key_set())
    return f"on ({n} key{'s' if n != 1 else ''})" if n else "off: every route is open"


def prefix_budget(settings: Settings) -> int:
    """Bytes of the in-memory chat-prefix state cache: 1/8 of the state LRU budget."""
    return max(settings.state_cache_bytes // 8, 0)


def _mib(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.1f} GiB"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"
