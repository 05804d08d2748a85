"""The state files named by `--state NAME=PATH` / RWKV_STATES, loaded at start as public templates."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from server.api.loading import torch_dtype
from server.config import Settings
from server.tasks.errors import TaskError
from server.tasks.imports import STATE_OPERATOR, template_from_state

if TYPE_CHECKING:
    from server.model.state import ModelShape
    from server.tasks import TaskManager

log = logging.getLogger("server.states")
MAX_TEMPLATES = 100_000


async def load_state_files(tm: TaskManager, settings: Settings, shape: ModelShape) -> list[str]:
    """Make each named file the public read-only template `_NAME` (replacing the one an earlier
    start loaded), and drop the templates earlier starts loaded from files no longer named.
    ValueError naming the file (and key) when one cannot be used: the start fails."""
    from server.model.state_file import read_state_file

    specs = settings.state_files()
    names = {name for name, _ in specs}
    shift, wkv = torch_dtype(settings.resolved_dtype()), torch_dtype(settings.resolved_state_dtype())
    files = []  # every file read and checked before any template changes: a refused start leaves them all
    for name, path in specs:
        source = f"--state {name}={path}"
        sf = await asyncio.to_thread(
            read_state_file,
            path,
            shape,
            source=source,
            shift_dtype=shift,
            wkv_dtype=wkv,
            max_pending=settings.max_prompt_tokens,
        )
        files.append((name, path, source, sf))
    await _drop_unnamed(tm, names)
    for name, path, source, sf in files:
        try:
            await template_from_state(tm, name, sf.state, pending=sf.pending, operator=True)
        except TaskError as exc:
            raise ValueError(f"{source}: {exc.message}") from None
        log.info(
            "state %s: loaded %s (%s, %s) as template _%s",
            name,
            path,
            sf.dtype,
            "full export" if sf.full else "tuned state, zero token shift",
            name,
        )
    return sorted(names)


async def _drop_unnamed(tm: TaskManager, names: set[str]) -> None:
    """Delete the operator templates of names this start does not name, unless another server
    shares the database: its --state may name them (a replica started without --state deleted
    the templates the others serve); they go at a start with no replica alive."""
    if tm.lease.peers:
        log.info("state files: %d other server(s) share the database; operator templates not named "
                 "here are kept (they may name them)", len(tm.lease.peers))  # fmt: skip
        return
    listed = await tm.list(None, kind="template", limit=MAX_TEMPLATES)
    for item in listed["tasks"]:
        if item.get("parent_id") == STATE_OPERATOR and item["task_id"][1:] not in names:
            await tm.delete(item["task_id"], None, force=True)
            log.info("state %s: no longer named at start; template %s deleted", item["task_id"][1:], item["task_id"])
