"""A server's default instance name (server.tasks.config.server_name): two live servers never
share one (servers on one port at two addresses of one machine, on one database, each keep their
running tasks), while a restarted server (same machine, --host and --port) keeps its name and so
takes its own interrupted tasks back at once (server.tasks.lease)."""

from __future__ import annotations

import socket

import httpx
import pytest
from util_server import ServerProcess, free_port, task_result

from server.config import Settings
from server.tasks.config import TaskConfig, server_name


def test_the_default_name_holds_the_address_unless_it_is_every_address(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    assert server_name("", 8000, "0.0.0.0") == server_name("", 8000) == "gpu1:8000"  # as before
    assert server_name("", 8000, "127.0.0.1") == "gpu1/127.0.0.1:8000"
    assert server_name("", 8000, "127.0.0.2") == "gpu1/127.0.0.2:8000"
    assert server_name("", 8000, "::1") == "gpu1/[::1]:8000" and server_name("", 8000, "::") == "gpu1/[::]:8000"
    assert server_name("", 8000, "127.0.0.1") == server_name("", 8000, "127.0.0.1")  # a restart: the same
    assert server_name("api-1", 8000, "127.0.0.1") == "api-1"
    a, b = server_name("", 0, "127.0.0.1"), server_name("", 0, "127.0.0.1")  # --port 0: one of its own
    assert a != b and a.startswith("gpu1-")
    assert TaskConfig.of(Settings(host="127.0.0.2", port=9000)).instance_name == "gpu1/127.0.0.2:9000"


def test_a_long_hostname_is_shortened_not_the_address_and_port(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "h" * 100)
    names = {server_name("", port, host) for host in ("127.0.0.1", "127.0.0.2") for port in (8000, 8001)}
    assert len(names) == 4 and all(len(n) <= 72 and n.endswith((":8000", ":8001")) for n in names)


def bindable(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


class At(ServerProcess):
    """A server listening at `host` (ServerProcess's at 127.0.0.1)."""

    def __init__(self, *args, host: str, **kwargs) -> None:
        self.host = host
        super().__init__(*args, **kwargs)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--host") + 1] = self.host
        return cmd


@pytest.mark.skipif(not bindable("127.0.0.2"), reason="127.0.0.2 is not a local address here")
def test_two_servers_on_one_port_at_two_addresses_keep_their_tasks(tmp_path):
    db, port = str(tmp_path / "shared.db"), free_port()
    a = At(tmp_path / "a", host="127.0.0.1", db=db, port=port)
    b = At(tmp_path / "b", host="127.0.0.2", db=db, port=port)
    with a, b, httpx.Client(base_url=a.url, timeout=30) as ca:
        a.start()
        tid = ca.post("/v1/tasks/create", json={"prompt": "long", "max_tokens": 100000, "ignore_eos": True}).json()
        tid = tid["task_id"]
        instance = task_result(ca, tid, until=lambda r: r["completion_tokens"] > 0)["instance"]
        b.start()
        with httpx.Client(base_url=b.url, timeout=30) as cb:
            seen = cb.get(f"/v1/tasks/{tid}/get_result").json()  # B reads A's task from the database
            assert not seen["finished"] and seen["instance"] == instance, (seen, b.log_tail())
            assert "marked interrupted" not in b.log_tail(300), b.log_tail()
            assert not ca.get(f"/v1/tasks/{tid}/get_result").json()["finished"]  # still generating on A
            a.kill()  # a crash; the restart (same --host and --port: the same name) takes its task
            a.start()  # back at once, not a lease timeout (30 s) later
            back = ca.get(f"/v1/tasks/{tid}/get_result").json()
            assert back["finished"] and back["finish_reason"] == "interrupted", (back, a.log_tail())
            assert "1 task(s) were running when their server stopped" in a.log_tail(300), a.log_tail()
        assert instance.startswith(f"{socket.gethostname()[:40]}/127.0.0.1:{port}-"), instance
