"""The dashboard's static files ship with the package: every file under server/webui/static is
matched by a package-data pattern of pyproject.toml (a new kind of file needs a new pattern)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ (tomllib)")

ROOT = Path(__file__).resolve().parents[1]


def test_every_static_file_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server"]
    server_dir = ROOT / "server"
    files = [p.relative_to(server_dir).as_posix() for p in (server_dir / "webui" / "static").rglob("*") if p.is_file()]
    assert "webui/static/index.html" in files and "webui/static/js/app.js" in files
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, pat) and f.count("/") == pat.count("/")
                                           for pat in patterns)]
    assert missing == [], f"add package-data patterns for {missing}"

