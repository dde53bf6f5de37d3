"""The tables of scripts/device/bench_scheduler.sh from its `bench serve` result files.

    python lab/scheduler_summary.py RESULTS_DIR [--target-itl-ms 25]

Reads RESULTS_DIR/{itl,priority,delay,api}-*.json (one level each); the baselines are itl-baseline,
priority-fcfs, delay-0 and api-1 (one API server process), every other file of a part is a variant, compared against its part's baseline.
Latencies in ms; throughput change = variant / baseline - 1.
"""
from __future__ import annotations

import argparse
import glob
import json
import os

BASELINES = {"itl": "itl-baseline", "priority": "priority-fcfs", "delay": "delay-0", "api": "api-1"}


def _runs(directory: str, part: str) -> list[tuple[str, dict]]:
    """(name, level) of the part's runs, the baseline first; absent runs are left out."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, f"{part}-*.json"))):
        name = os.path.basename(path).removesuffix(".json")
        with open(path) as f:
            levels = [json.loads(line) for line in f if line.strip()]      # a level a line
        if levels:
            out.append((name, levels[0]))
    out.sort(key=lambda r: r[0] != BASELINES[part])
    return out


def _fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _change(lv: dict, base: dict | None, key: str) -> str:
    if base is None or lv is base or not base.get(key):
        return "-"
    return f"{lv[key] / base[key] - 1:+.1%}"


def itl_table(runs, target_ms: float) -> str:
    lines = ["| server | ok/n | req/s | out tok/s | throughput change | ITL p50 | ITL p95 | ITL p99 | "
             f"p99 <= {target_ms:g} ms | TPOT p50 | TTFT p50 | TTFT p99 | E2E p99 |", "|" + "---|" * 13]
    base = runs[0][1] if runs and runs[0][0] in BASELINES.values() else None
    for name, lv in runs:
        lines.append(f"| {name} | {lv['completed']}/{lv['num_requests']} | {lv['request_throughput']:.2f} | "
                     f"{lv['output_throughput']:,.0f} | {_change(lv, base, 'output_throughput')} | "
                     f"{lv['median_itl_ms']:.2f} | {lv['p95_itl_ms']:.2f} | {lv['p99_itl_ms']:.2f} | "
                     f"{'yes' if lv['p99_itl_ms'] <= target_ms else 'no'} | {lv['median_tpot_ms']:.2f} | "
                     f"{lv['median_ttft_ms']:.0f} | {lv['p99_ttft_ms']:.0f} | {lv['p99_e2el_ms']:.0f} |")
    return "\n".join(lines)


def priority_table(runs) -> str:
    lines = ["| server | ok/n | req/s | tools n | tools TTFT p50 | tools TTFT p95 | rest TTFT p50 | "
             "rest TTFT p95 | TTFT max (any) | E2E max (any) | tools E2E p95 | rest E2E p95 |",
             "|" + "---|" * 12]
    for name, lv in runs:
        g = lv.get
        lines.append(f"| {name} | {lv['completed']}/{lv['num_requests']} | {lv['request_throughput']:.2f} | "
                     f"{g('num_requests_tools', '-')} | {_fmt(g('median_ttft_ms_tools'), 0)} | "
                     f"{_fmt(g('p95_ttft_ms_tools'), 0)} | {_fmt(g('median_ttft_ms_plain'), 0)} | "
                     f"{_fmt(g('p95_ttft_ms_plain'), 0)} | {_fmt(g('max_ttft_ms'), 0)} | "
                     f"{_fmt(g('max_e2el_ms'), 0)} | {_fmt(g('p95_e2el_ms_tools'), 0)} | "
                     f"{_fmt(g('p95_e2el_ms_plain'), 0)} |")
    return "\n".join(lines)


def delay_table(runs) -> str:
    lines = ["| server | ok/n | rate req/s | req/s | out tok/s | throughput change | TTFT p50 | TTFT p95 | "
             "TTFT p99 | TPOT p50 | ITL p99 | E2E p50 | E2E p99 |", "|" + "---|" * 13]
    base = runs[0][1] if runs and runs[0][0] == BASELINES["delay"] else None
    for name, lv in runs:
        lines.append(f"| {name} | {lv['completed']}/{lv['num_requests']} | {lv['request_rate']} | "
                     f"{lv['request_throughput']:.2f} | {lv['output_throughput']:,.0f} | "
                     f"{_change(lv, base, 'output_throughput')} | {lv['median_ttft_ms']:.1f} | "
                     f"{lv['p95_ttft_ms']:.1f} | {lv['p99_ttft_ms']:.1f} | {lv['median_tpot_ms']:.2f} | "
                     f"{lv['p99_itl_ms']:.2f} | {lv['median_e2el_ms']:.0f} | {lv['p99_e2el_ms']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--target-itl-ms", type=float, default=25.0)
    args = p.parse_args(argv)
    sections = (("itl", "Latency target under overload", lambda r: itl_table(r, args.target_itl_ms)),
                ("api", "API server processes (--api-server-count) at high concurrency",
                 lambda r: itl_table(r, args.target_itl_ms)),
                ("priority", "Priority boosts: requests with tools against the rest", priority_table),
                ("delay", "Batching window at a Poisson rate near saturation", delay_table))
    for part, title, table in sections:
        runs = _runs(args.results, part)
        if not runs:
            continue
        print(f"## {title}\n\n{table(runs)}\n")
        for name, lv in runs:
            if lv.get("failed"):
                print(f"- {name}: {lv['failed']} failed: {'; '.join(lv.get('errors') or [])[:300]}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
