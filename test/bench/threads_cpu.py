"""CPU seconds per thread of a running process over a window: which threads of the server burn
the CPU (the event loop, the engine thread, encoders, torch's intra-op pool, SQLite threads).

    python test/bench/threads_cpu.py --match 'server.cli' --every 2 &   # then run the bench

Reads /proc/<pid>/task/*/stat (utime + stime) and comm every window until the process ends;
prints the cores busy in all, the number of busy threads and the busiest threads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time


def sample(pid: int) -> dict[int, tuple[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def find(pattern: str, timeout: float) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        pids = [int(p) for p in r.stdout.split() if int(p) != os.getpid()]
        if pids:
            return max(pids)
        time.sleep(0.5)
    raise SystemExit(f"threads_cpu: no process matches {pattern!r}")


def report(s0: dict[int, tuple[str, float]], s1: dict[int, tuple[str, float]], wall: float, pid: int,
           top: int) -> str:
    """One line: cores busy in all, how many threads were busy, then the busiest threads
    (`main` is the process's first thread: the server's event loop)."""
    per = {tid: (name, (cpu - s0.get(tid, (name, 0.0))[1]) / wall) for tid, (name, cpu) in s1.items()}
    total = sum(c for _, c in per.values())
    busy = sum(1 for _, c in per.values() if c > 0.05)
    best = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    parts = [f"{'main' if tid == pid else tid} {c:.2f}" for tid, (_, c) in best if c > 0.005]
    return f"{total:5.2f} cores, {busy:2d} threads > 0.05 | " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int)
    ap.add_argument("--match", default="server.cli", help="pgrep -f pattern (the newest match)")
    ap.add_argument("--every", type=float, default=2.0, help="seconds per window")
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    pid = a.pid or find(a.match, 600)
    t0, s0 = time.monotonic(), sample(pid)
    while True:  # one line per window until the process ends
        time.sleep(a.every)
        try:
            t1, s1 = time.monotonic(), sample(pid)
        except FileNotFoundError:
            return
        print(f"[{time.strftime('%H:%M:%S')}] pid {pid}: {report(s0, s1, t1 - t0, pid, a.top)}", flush=True)
        t0, s0 = t1, s1


if __name__ == "__main__":
    main()
