"""A very short headless Locust smoke run of test/locustfile.py (every user class, no failures).
The real load test is the README's 50-user, 60 s run."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from util_server import running_server

ROOT = Path(__file__).resolve().parents[1]


def test_locustfile_smoke(tmp_path):
    with running_server(tmp_path) as srv:
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "test" / "locustfile.py"), "--headless",
               "-u", "6", "-r", "6", "-t", "6s", "--host", srv.url, "--csv", str(tmp_path / "loc"),
               "--only-summary", "--stop-timeout", "10"]
        env = {**os.environ, "LOCUST_MAX_TOKENS": "8"}
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "loc_stats.csv") as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    agg = rows[("", "Aggregated")]
    assert int(agg["Failure Count"]) == 0, rows
    kinds = {t for t, _ in rows}
    assert {"TTFT", "TOK/S"} <= kinds, kinds
    names = {n for _, n in rows}
    assert "/v1/chat/completions [stream]" in names and "/v1/tasks/create" in names
