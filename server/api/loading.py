"""Load the model, tokenizer and engine (blocking; run in a thread) and describe what was loaded."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from server.api.deps import Services
from server.config import Settings

log = logging.getLogger("server.load")

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

RANDOM_WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!  Model %s is a SYNTHETIC checkpoint with RANDOM weights: every output is
!!  random text. Good for tests and load tests only. For real answers start with
!!  --model /path/to/RWKV-x070-....pth (or RWKV_MODEL=...).
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


def model_id_of(spec: str) -> str:
    """The id clients see: the checkpoint's file name, or the synthetic spec."""
    if spec.startswith("synthetic:"):
        return spec
    return Path(spec).name


def load_services(settings: Settings) -> Services:
    """Model, tokenizer and a started engine. Logs progress and the facts."""
    spec = settings.resolved_model()
    if spec.startswith("synthetic:"):
        log.warning(RANDOM_WARNING, spec)
    if settings.debug_load_delay > 0:
        log.info("test hook debug_load_delay: sleeping %.1fs before loading", settings.debug_load_delay)
        time.sleep(settings.debug_load_delay)
    from server.engine import Engine
    from server.model import load_model
    from server.tokenizer import get_tokenizer

    device, dtype = settings.resolved_device(), settings.resolved_dtype()
    log.info("loading %s on %s (%s compute, %s state) ...", spec, device, dtype, settings.state_dtype)
    t0 = time.perf_counter()
    kernel_log = _Collect()
    logging.getLogger("rwkv.kernels").addHandler(kernel_log)
    try:
        model = load_model(spec, device=device, dtype=torch_dtype(dtype),
                           state_dtype=torch_dtype(settings.state_dtype), kernels=settings.kernels,
                           kernel_cache=settings.kernel_cache)
    finally:
        logging.getLogger("rwkv.kernels").removeHandler(kernel_log)
    t_model = time.perf_counter() - t0
    log.info("model loaded in %.2fs", t_model)
    t1 = time.perf_counter()
    tokenizer = get_tokenizer()
    tokenizer.encode("warm-up: the first encode builds lookup tables")  # not in a request's time
    log.info("tokenizer ready in %.2fs; starting the engine ...", time.perf_counter() - t1)
    t2 = time.perf_counter()
    engine = Engine(model, tokenizer, settings)
    engine.start()
    log.info("engine started in %.2fs", time.perf_counter() - t2)
    services = Services(settings=settings, model=model, tokenizer=tokenizer, engine=engine,
                        model_id=getattr(model, "name", None) or model_id_of(spec))
    services.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    services.extra["kernel_log"] = kernel_log.lines
    return services


class _Collect(logging.Handler):
    """Keeps the kernel loader's messages (builds, cache loads, fallbacks) for the facts."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def facts(services: Services) -> list[str]:
    """Human lines about what runs: shape, state size, slots, budgets, kernels."""
    s, model = services.settings, services.model
    lines = [f"model      {services.model_id}"]
    shape = getattr(model, "shape", None)
    if shape is not None:
        lines.append(f"shape      L={shape.n_layer} C={shape.n_embd} H={shape.n_head} N={shape.head_size} "
                     f"V={shape.vocab_size} ffn={shape.ffn_dim}")
        try:
            per_seq = shape.state_bytes(torch_dtype(s.resolved_dtype()), torch_dtype(s.state_dtype))
            lines.append(f"state      {_mib(per_seq)} per sequence ({s.state_dtype} WKV)")
        except Exception:  # noqa: BLE001
            pass
    lines.append(f"device     {getattr(model, 'device', s.resolved_device())}, compute {s.resolved_dtype()}")
    slots = s.resolved_max_batch()
    try:
        slots = services.engine.stats().slots or slots
    except Exception:  # noqa: BLE001
        pass
    lines.append(f"slots      {slots} (step budget {s.step_token_budget} tokens, queue {s.max_queue})")
    lines.append(f"caches     state LRU {_mib(s.state_cache_bytes)}, DB states {_mib(s.db_budget_bytes)}, "
                 f"chat prefix {_mib(prefix_budget(s))}")
    lines.append(f"database   {s.db}")
    ops = getattr(model, "ops", None)
    if ops is not None:
        mods = sorted({getattr(fn, "__module__", "?") for fn in vars(ops).values()})
        lines.append(f"kernels    WKV ops from {', '.join(mods)}")
    for msg in services.extra.get("kernel_log", []):
        lines.append(f"kernels    {msg}")
    lines.append(f"loaded in  {services.extra.get('load_seconds', 0):.2f}s")
    return lines


def prefix_budget(settings: Settings) -> int:
    """Bytes of the in-memory chat-prefix state cache: 1/8 of the state LRU budget."""
    return max(settings.state_cache_bytes // 8, 0)


def _mib(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.1f} GiB"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"
