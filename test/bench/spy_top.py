"""The busiest frames per thread of a py-spy raw profile (`py-spy record -f raw --threads`).

    python test/bench/spy_top.py spy.txt [--top 20]

Each line of the file is `thread (tid): name;frame;...;leaf count`. Prints the samples per thread,
then the leaf frames with the most samples (their thread named), the quickest way to see what
the engine thread or the event loop was doing.
"""

from __future__ import annotations

import argparse
from collections import Counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    leaves: Counter[tuple[str, str]] = Counter()
    threads: Counter[str] = Counter()
    with open(a.path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            threads[frames[0]] += int(n)
            leaves[(frames[0], frames[-1])] += int(n)
    for name, n in threads.most_common():
        print(f"{n:7d}  {name}")
    print()
    for (thread, leaf), n in leaves.most_common(a.top):
        print(f"{n:7d}  {thread[:40]:40s}  {leaf[:140]}")


if __name__ == "__main__":
    main()
