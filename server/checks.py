"""The start-up checks: what `serve` (and `generate`) find wrong before anything loads, each as
one line naming the flag (the CLI prints `rwkv-server: <line>` and exits with status 2). Each
`*_problem` returns that line, or None. Split from server/cli.py for size; synth's and
quantize's argument checks are server/checks_args.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import importlib.util
import math
import os
import socket
import sys
from typing import get_type_hints

from server.checks_args import unreadable
from server.config import ABOVE_ZERO, CHOICES, UPPER_BOUNDS, Settings, redact_url

DB_SCHEMES = ("sqlite", "sqlite+aiosqlite", "postgresql", "postgres", "postgresql+asyncpg")
"""The database URL schemes the task store runs on (its migrations know SQLite and PostgreSQL)."""


def device_problem(device: str, flag: str = "--device") -> str | None:
    """Why `device` cannot be used on this machine (one line), or None. Checked before the port
    is bound, so a wrong --device ends at once with that line instead of a traceback."""
    if device in ("auto", "cpu"):
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"{flag} {device!r}: not a device (cpu, cuda, cuda:N or auto)"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"{flag} {device!r}: only cpu and cuda devices are supported"
    if not torch.cuda.is_available():
        return f"{flag} {device!r}: CUDA is not available on this machine (torch {torch.__version__}); use --device cpu"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"{flag} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def settings_problem(settings: Settings) -> str | None:
    """Why the server cannot start with these settings (one line), or None. --device only when
    --devices is empty (the engines' devices are then --devices')."""
    device = None if settings.devices.strip() else device_problem(settings.device)
    return (numbers_problem(settings) or choices_problem(settings) or model_problem(settings.resolved_model())
            or state_files_problem(settings) or device or devices_problem(settings)
            or kernels_problem(settings))  # fmt: skip


def kernels_problem(settings: Settings) -> str | None:
    """--kernels cuda (the CUDA kernels or a start-up error) on a run with no CUDA device, or None."""
    if settings.kernels == "cuda" and not any(d.startswith("cuda") for d in settings.resolved_devices()):
        return "--kernels cuda: needs a CUDA device, and this run is on cpu (use --kernels auto or torch)"
    return None


def model_problem(model: str) -> str | None:
    """A --model that is no file or one this process cannot read, or a synthetic spec its parser
    refuses (an unknown preset, a bad seed), or None."""
    if not model.startswith("synthetic:"):
        if os.path.isfile(model):
            return None if (why := unreadable(model)) is None else f"--model {model!r}: cannot read it ({why})"
        what = "is a folder" if os.path.isdir(model) else "no such file"
        return f"--model {model!r}: {what} (give an RWKV-7 .pth file or synthetic:<preset>)"
    from server.model.synthetic import parse_spec

    try:
        parse_spec(model)
    except ValueError as exc:
        return f"--model {model!r}: {exc}"
    return None


def numbers_problem(settings: Settings) -> str | None:
    """A port outside 0..65535, or another number setting out of its range (flags and environment
    alike): below 0 (none has a meaning there), 0 for those of ABOVE_ZERO, a float that is NaN
    or infinite. Or None."""
    if not 0 <= settings.port <= 65535:
        return f"--port {settings.port}: not a port (0 to 65535; 0: any free port)"
    hints = get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        if hints[f.name] in (int, float) and (problem := number_problem(f.name, getattr(settings, f.name))):
            return problem
    return None


def number_problem(name: str, value: float) -> str | None:
    """Why the int or float setting `name` cannot be `value` (one line naming its flag), or None."""
    flag = f"--{name.replace('_', '-')} {value}"
    if not math.isfinite(value):
        return f"{flag}: must be a finite number"
    if name in ABOVE_ZERO and value <= 0:
        return f"{flag}: must be more than 0"
    if value > UPPER_BOUNDS.get(name, math.inf):  # (config.UPPER_BOUNDS says why)
        return f"{flag}: must be at most {UPPER_BOUNDS[name]:,} (it sizes memory allocated at start)"
    if value < 0:
        return f"{flag}: must be 0 or more"
    return None


def devices_problem(settings: Settings) -> str | None:
    """Why --devices cannot be used here (one line), or None."""
    if not settings.devices.strip():
        return None
    try:
        devices = settings.resolved_devices()
    except ValueError as exc:
        return f"--{exc}"
    return next(filter(None, (device_problem(d, "--devices:") for d in devices)), None)


def choices_problem(settings: Settings) -> str | None:
    """A setting of CHOICES outside its values, as the environment can give it (RWKV_QUANT=int4:
    argparse checks only the flags' own values), or None. The log level is read in any case."""
    for name, options in CHOICES.items():
        value = getattr(settings, name)
        if (value.lower() if name == "log_level" else value) not in options:
            return f"--{name.replace('_', '-')} {value!r}: use one of {', '.join(options)}"
    return None


def state_files_problem(settings: Settings) -> str | None:
    """Why a --state / RWKV_STATES entry cannot be loaded, found before loading (one line), or None."""
    from server.tasks.imports import name_issue

    try:
        specs = settings.state_files()
    except ValueError as exc:
        return f"--state: {exc}"
    names = [name for name, _ in specs]
    for name, path in specs:
        if names.count(name) > 1:
            return f"--state {name}: given more than once"
        if issue := name_issue(name, new=True):
            return f"--state {name}={path}: the name: {issue}"
        if not os.path.isfile(path):
            return f"--state {name}={path}: {'is a folder' if os.path.isdir(path) else 'no such file'}"
        if why := unreadable(path):
            return f"--state {name}={path}: cannot read it ({why})"
    return None


def serve_problem(settings: Settings) -> str | None:
    """Why `serve` cannot start, beyond settings_problem (one line), or None: the API keys, the
    few-shot file, the port, the task database as far as it can be told without opening it."""
    return (api_keys_problem(settings) or few_shot_problem(settings.few_shot)
            or port_problem(settings.host, settings.port) or database_problem(settings.db))  # fmt: skip


def few_shot_problem(path: str) -> str | None:
    """A --few-shot file that cannot be read as UTF-8 text, or None. Only a path given: the
    default (empty: the project's few_shot.txt) is read when a request first asks for it."""
    if not path:
        return None
    from server.api.openai.chat_format import FewShotUnreadable, load_few_shot  # what the server will read

    try:
        load_few_shot(path)
    except FewShotUnreadable as why:
        return f"--few-shot {path}: cannot read it ({why})"
    return None


def api_keys_problem(settings: Settings) -> str | None:
    """A key file that cannot be read, or a key setting that is set but gives no key, or None."""
    try:
        settings.api_key_set()
    except ValueError as exc:
        return f"--{exc}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (one line), or None. Binds a probe socket to
    each address of `host` as asyncio's create_server (uvicorn's) will: SO_REUSEADDR on POSIX,
    so a port held only by an earlier run's closing connections (TIME_WAIT) passes as it will for
    the server, and one a process listens on does not; IPv6 sockets IPv6-only. The probe is
    closed at once; port 0 (any free port) is not probed."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r}: not an address of this machine ({exc.strerror})"
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (no IPv6): asyncio skips it too
            continue
        with probe:
            if os.name == "posix" and sys.platform != "cygwin":
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                where = f"[{addr[0]}]:{port}" if family == socket.AF_INET6 else f"{addr[0]}:{port}"
                return f"--port {port}: cannot listen on {where}: {exc.strerror}{_BIND_HINTS.get(exc.errno or 0, '')}"
    return None


_BIND_HINTS = {
    errno.EADDRINUSE: " (another process listens there: stop it or choose another --port)",
    errno.EACCES: " (ports below 1024 need privileges: choose another --port)",
    errno.EADDRNOTAVAIL: " (--host is not an address of this machine)",
}


def database_problem(db: str) -> str | None:
    """Why the task database `db` cannot be opened, as far as it can be told without opening it
    (one line naming --db with its password hidden), or None: an empty value, an unsupported URL
    scheme, the asyncpg driver missing for PostgreSQL, a URL query option asyncpg has no use for,
    a SQLite path that names a folder or cannot be created (database_open_problem opens it)."""
    shown = redact_url(db)
    if not db.strip():  # (SQLite would take it for a database in memory, lost at exit)
        return "--db '': empty; give a SQLite file path or a database URL (sqlite:// for one in memory, not kept)"
    if "://" not in db:  # a plain path: its missing folders are made at start (server.tasks.database)
        return None if db == ":memory:" else sqlite_path_problem(db, shown, make_folders=True)
    scheme, rest = db.split("://", 1)
    if scheme not in DB_SCHEMES:
        return (f"--db {shown}: unsupported database {scheme}://; use a SQLite file path, sqlite:///PATH, "
                "or postgresql://user@host/db (postgresql+asyncpg://...)")  # fmt: skip
    if scheme.startswith("postgres"):
        if importlib.util.find_spec("asyncpg") is None:
            return f"--db {shown}: PostgreSQL needs the asyncpg driver: pip install asyncpg"
        from server.tasks.pgconnect import query_problem  # libpq's options (sslmode=...) as asyncpg's

        return None if (why := query_problem(db)) is None else f"--db {shown}: {why}"
    path = rest.split("?", 1)[0][1:]  # sqlite:///rel/path, sqlite:////abs/path; sqlite:// is in memory
    return None if path in ("", ":memory:") else sqlite_path_problem(path, shown, make_folders=False)


def sqlite_path_problem(path: str, shown: str, *, make_folders: bool) -> str | None:
    """Why SQLite cannot keep its database at `path` (a folder, a folder that is a file, no
    permission to create the file and its -wal / -shm companions), or None."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        return f"--db {shown}: is a folder; give the database file's path (e.g. {os.path.join(path, 'rwkv_tasks.db')})"
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        return f"--db {shown}: the file cannot be read and written (permission denied)"
    folder = os.path.dirname(path)
    existing = folder
    while not os.path.exists(existing):  # the nearest folder that exists (or a file in the way)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"--db {shown}: {existing} is a file, not a folder"
    if existing != folder and not make_folders:
        return f"--db {shown}: no folder {folder}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--db {shown}: cannot create files in {existing} (permission denied)"
    return None


def database_open_problem(settings: Settings) -> str | None:
    """Opens the task database as the server will (connecting, migrating its schema to head) and
    closes it, before the model loads: a PostgreSQL server that refuses or does not answer, bad
    credentials, a damaged SQLite file end the start here, as a database problem. One line, or
    None. A SQLite file's tables and indexes are read through (database.read_every_tree: a
    damaged page of the tasks or their index is found here, not once the model has loaded)."""
    from server.tasks.database import Database, DatabaseDamaged

    async def open_close() -> str | None:
        db = Database(settings.db, busy_timeout=settings.db_busy_timeout)
        await db.open()
        try:
            return await db.read_only()
        finally:
            await db.close()

    try:
        read_only = asyncio.run(open_close())
    except DatabaseDamaged as exc:  # its line names the file and how to salvage it
        return f"--db {settings.db}: {exc}"
    except Exception as exc:
        cause = getattr(exc, "orig", None) or exc  # SQLAlchemy's wrapper: the driver's error
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        if "no schema has been selected" in text:
            text += " (the schema that options=-c search_path=... names must exist: CREATE SCHEMA it first)"
        return redact_url(f"--db {settings.db}: cannot open the task database: {type(cause).__name__}: {text}")
    if read_only:
        return redact_url(
            f"--db {settings.db}: the task database takes no writes ({read_only}); the server stores its tasks there"
        )
    return None
