"""Per process of a GC_LOG_DIR (lab/gc_log/sitecustomize.py): the logged collections between two unix
times, their count, total and longest pause by generation, as a markdown table.

    python lab/gc_log/summary.py DIR START END
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict


def main() -> int:
    folder, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    print("| pid | generation | collections | total ms | longest ms |")
    print("|---|---|---|---|---|")
    for name in sorted(os.listdir(folder)):
        by_gen = defaultdict(list)
        with open(os.path.join(folder, name)) as f:
            for line in f:
                t, gen, ms, _ = line.split()
                if start <= float(t) <= end:
                    by_gen[int(gen)].append(float(ms))
        for gen in sorted(by_gen):
            p = by_gen[gen]
            print(f"| {name[:-4]} | {gen} | {len(p)} | {sum(p):.1f} | {max(p):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
