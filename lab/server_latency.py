"""The server's own latencies over a benchmark level: the difference of two /metrics snapshots (taken
before and after the level) in the means of its time to first token, inter-token latency, end-to-end
latency and queue time, to set beside what the client measured (`bench serve`): the part of a request's
wait that a client sees but the server does not lies in the client or the sockets between.

    curl -s URL/metrics > before.txt; tokenmill bench serve ...; curl -s URL/metrics > after.txt
    python lab/server_latency.py before.txt after.txt
"""
from __future__ import annotations

import re
import sys

NAMES = (("TTFT", "time_to_first_token_seconds"), ("ITL", "inter_token_latency_seconds"),
         ("E2E", "e2e_request_latency_seconds"), ("queue", "request_queue_time_seconds"))


def totals(text: str) -> dict[str, float]:
    """Sum over label sets of each histogram's _sum and _count."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^tokenmill:(\w+?_seconds_(?:sum|count))(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def report(before: str, after: str) -> str:
    a, b = totals(before), totals(after)
    parts = []
    for label, name in NAMES:
        n = b.get(f"{name}_count", 0.0) - a.get(f"{name}_count", 0.0)
        s = b.get(f"{name}_sum", 0.0) - a.get(f"{name}_sum", 0.0)
        if n > 0:
            parts.append(f"{label} mean {1e3 * s / n:.1f} ms ({int(n)})")
    return "server-side: " + (", ".join(parts) if parts else "no requests between the snapshots")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        first = f.read()
    with open(sys.argv[2]) as f:
        second = f.read()
    print(report(first, second))
