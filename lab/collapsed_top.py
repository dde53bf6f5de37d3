"""The top functions of a sampling profile in collapsed-stack form (`py-spy record --format raw`):
by self samples (the frame on top) and by inclusive samples (anywhere on the stack, once per sample).

    python lab/collapsed_top.py profile.txt [N]
"""
from __future__ import annotations

import re
import sys
from collections import Counter


def _name(frame: str) -> str:
    # py-spy frames read "function (path/to/file.py:line)"; group by function and file, not line
    m = re.match(r"(.*) \((.*?):\d+\)$", frame.strip())
    if not m:
        return frame.strip()
    func, path = m.groups()
    parts = path.split("/")
    return f"{func} ({'/'.join(parts[-2:])})"


def top(path: str, n: int = 25) -> str:
    own, incl = Counter(), Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            k = int(count)
            frames = [_name(x) for x in stack.split(";") if x]
            total += k
            if frames:
                own[frames[-1]] += k
            for name in set(frames):
                incl[name] += k
    out = [f"{total} samples"]
    for title, counter in (("self", own), ("inclusive", incl)):
        out += ["", f"| {title} % | function |", "|---|---|"]
        out += [f"| {100 * c / max(total, 1):.1f} | {name} |" for name, c in counter.most_common(n)]
    return "\n".join(out)


if __name__ == "__main__":
    print(top(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25))
