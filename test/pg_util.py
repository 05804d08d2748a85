"""A throwaway PostgreSQL server for the store tests (no server needed beforehand).

`pg_cluster` (session): initdb into a fresh temporary directory, start it with pg_ctl on
127.0.0.1 and a free port (unix socket in that directory, fsync left on), stop and delete it at
the end. `pg_url` (per test): a new, empty database in that cluster, as a postgresql+asyncpg://
URL; dropped after the test. Both skip, saying why, without asyncpg or PostgreSQL's initdb.
Under root, initdb/pg_ctl run as the `postgres` system user (postgres refuses to run as root).

Import the fixtures into a test module (`from pg_util import db_url, pg_cluster, pg_url`: db_url is
both backends in turn); modules that do share one cluster per session.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from util_server import free_port


def find_pg_bin() -> str | None:
    """The directory holding initdb (and pg_ctl): PATH first, then /usr/lib/postgresql/*/bin."""
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
    return os.path.dirname(versions[-1]) if versions else None


class PgCluster:
    """One initdb'd, running PostgreSQL server in a temporary directory."""

    def __init__(self, bindir: str) -> None:
        self.bindir = bindir
        self.user = "postgres"  # the superuser initdb creates (trust auth: loopback + private socket)
        self.as_root = os.geteuid() == 0
        self.dir = tempfile.mkdtemp(prefix="rwkv-pgtest-")  # not under pytest's 0700 tmp tree
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self.port = 0
        self.running = False
        self._names = itertools.count()
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [os.path.join(self.bindir, args[0]), *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)

    def start(self) -> None:
        r = self._run("initdb", "-D", self.data, "-U", self.user, "--auth=trust", "-E", "UTF8",
                      "--no-locale", "--no-instructions")
        if r.returncode:
            raise RuntimeError(f"initdb failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        for attempt in range(3):  # the free port may be taken between the probe and the start
            self.port = free_port()
            opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.dir} "
                    "-c max_connections=100")
            r = self._run("pg_ctl", "-D", self.data, "-l", self.log, "-o", opts, "-w", "-t", "60", "start")
            if r.returncode == 0:
                self.running = True
                return
        raise RuntimeError(f"pg_ctl start failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.running:
            self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
            self.running = False
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/{database}"

    # --- databases ------------------------------------------------------------------------------
    def admin(self, sql: str) -> None:
        """Run one statement on the maintenance database (autocommit), from a thread with its own
        event loop, so it is callable from sync fixtures whatever loop pytest-asyncio runs."""
        import asyncpg

        async def go() -> None:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user=self.user, database="postgres")
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        with ThreadPoolExecutor(1) as ex:
            ex.submit(asyncio.run, go()).result()

    def create_database(self) -> str:
        name = f"t{os.getpid()}_{next(self._names)}"
        self.admin(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_lock = threading.Lock()
_cluster: PgCluster | None = None


def shared_cluster() -> PgCluster:
    """The session's one cluster (started on first use), or pytest.skip saying what is missing."""
    global _cluster
    pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install asyncpg): no PostgreSQL tests")
    bindir = find_pg_bin()
    if bindir is None or not os.path.exists(os.path.join(bindir, "pg_ctl")):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH nor under "
                    "/usr/lib/postgresql/*/bin: no PostgreSQL tests")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' system user to run PostgreSQL as")
    with _lock:
        if _cluster is None or not _cluster.running:
            c = PgCluster(bindir)
            try:
                c.start()
            except BaseException:
                c.stop()
                raise
            atexit.register(c.stop)  # a session that dies before the fixture teardown
            _cluster = c
        return _cluster


@pytest.fixture(scope="session")
def pg_cluster():
    c = shared_cluster()
    yield c
    c.stop()  # idempotent: a second module's teardown of the same cluster does nothing


@pytest.fixture
def pg_url(pg_cluster):
    """A fresh empty database for one test (postgresql+asyncpg:// URL)."""
    name = pg_cluster.create_database()
    yield pg_cluster.url(name)
    pg_cluster.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh empty database for one test, on each backend: a SQLite file path, or a new
    PostgreSQL database (needs pg_cluster and pg_url imported into the test module too)."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return request.getfixturevalue("pg_url")
