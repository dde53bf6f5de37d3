"""`tokenmill bench report`: `bench serve` result files -> one markdown report plus PNG plots.

    tokenmill bench report results/*.json --output-dir report/

Each record of the files is one level of a run (bench/serve_results.py), named by its `label`. Writes
REPORT.md (a table per label and concurrency level, ratios against each baseline at equal
concurrency, for runs with `--tools-fraction` the TTFT of tool-carrying requests against the rest and the
longest wait, and the hardware, model, commit and command of every run) and, when matplotlib is
installed, throughput.png, latency_p95.png, ttft_dist.png and itl_dist.png.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from tokenmill.bench.serve_results import load_records

COLUMNS = (
    ("conc", "max_concurrency", "{}"), ("ok/n", None, None), ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"), ("total tok/s", "total_token_throughput", "{:.1f}"),
    ("TTFT mean", "mean_ttft_ms", "{:.1f}"), ("TTFT p50", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"), ("TPOT mean", "mean_tpot_ms", "{:.2f}"),
    ("TPOT p50", "median_tpot_ms", "{:.2f}"), ("TPOT p99", "p99_tpot_ms", "{:.2f}"),
    ("ITL p50", "median_itl_ms", "{:.2f}"), ("ITL p95", "p95_itl_ms", "{:.2f}"), ("ITL p99", "p99_itl_ms", "{:.2f}"),
    ("E2E mean", "mean_e2el_ms", "{:.0f}"), ("E2E p50", "median_e2el_ms", "{:.0f}"), ("E2E p95", "p95_e2el_ms", "{:.0f}"),
    ("E2E p99", "p99_e2el_ms", "{:.0f}"),
)


def _label(lv: dict) -> str:
    return lv.get("label") or lv["backend"]


def _row(lv: dict, goodput: bool) -> str:
    cells = [_label(lv)]
    for _, key, fmt in COLUMNS:
        if key is None:
            cells.append(f"{lv['completed']}/{lv['completed'] + lv['failed']}")
        else:
            cells.append(fmt.format(lv[key]) if key in lv else "-")
    if goodput:
        cells.append("-" if lv.get("request_goodput") is None else f"{lv['request_goodput']:.2f}")
    return "| " + " | ".join(cells) + " |"


def summary_table(records: list[dict]) -> str:
    """One row per record (a label's concurrency level); latencies in ms."""
    goodput = any(lv.get("request_goodput") is not None for lv in records)
    head = ["backend", *(c[0] for c in COLUMNS)] + (["goodput req/s"] if goodput else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_row(lv, goodput) for lv in records]
    return "\n".join(lines)


CLASS_COLUMNS = (
    ("tools ok/n", None), ("tools TTFT p50", "median_ttft_ms_tools"), ("tools TTFT p95", "p95_ttft_ms_tools"),
    ("plain TTFT p50", "median_ttft_ms_plain"), ("plain TTFT p95", "p95_ttft_ms_plain"),
    ("tools E2E p95", "p95_e2el_ms_tools"), ("plain E2E p95", "p95_e2el_ms_plain"),
    ("TTFT max", "max_ttft_ms"), ("E2E max", "max_e2el_ms"),
)


def class_table(records: list[dict]) -> str:
    """Levels whose requests were split by `--tools-fraction`: one row each, latencies in ms; the max
    columns are the longest wait of any request. Empty when no level was split."""
    rows = [(_label(lv), lv) for lv in records if "p95_ttft_ms_tools" in lv]
    if not rows:
        return ""
    head = ["backend", "conc", *(c[0] for c in CLASS_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for backend, lv in rows:
        cells = [backend, str(lv["max_concurrency"])]
        for _, key in CLASS_COLUMNS:
            cells.append(f"{lv['completed_tools']}/{lv['num_requests_tools']}" if key is None
                         else f"{lv[key]:.1f}" if key in lv else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _workload(lv: dict) -> str | None:
    return (lv.get("dataset") or {}).get("name")


def ratio_table(records: list[dict], ours: str = "tokenmill") -> str:
    """Our label against each other label at the same concurrency on the same dataset: throughput x,
    p95 E2E fraction. Levels on another workload (e.g. a fixed-length latency probe) are not compared."""
    mine = [lv for lv in records if _label(lv) == ours]
    if not mine:
        return ""
    lines = ["| vs | conc | req/s ratio | out tok/s ratio | p95 E2E ratio (ours / theirs) | TTFT p50 ratio |",
             "|---|---|---|---|---|---|"]
    by_conc = {lv["max_concurrency"]: lv for lv in mine}
    workload = _workload(mine[0])
    for lv in records:
        if _label(lv) == ours or _workload(lv) != workload:
            continue
        m = by_conc.get(lv["max_concurrency"])
        if m is None or not lv["request_throughput"] or not lv.get("p95_e2el_ms"):
            continue
        lines.append(f"| {_label(lv)} | {lv['max_concurrency']} | "
                     f"{m['request_throughput'] / lv['request_throughput']:.2f}x | "
                     f"{m['output_throughput'] / max(lv['output_throughput'], 1e-9):.2f}x | "
                     f"{m['p95_e2el_ms'] / lv['p95_e2el_ms']:.3f} | "
                     f"{m['median_ttft_ms'] / max(lv['median_ttft_ms'], 1e-9):.3f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _runs(records: list[dict]) -> dict[tuple, list[dict]]:
    """The records grouped by run: label, date and command (a sweep's levels share them)."""
    runs: dict[tuple, list[dict]] = {}
    for lv in records:
        runs.setdefault((_label(lv), lv.get("date"), lv.get("command")), []).append(lv)
    return runs


def markdown_report(records: list[dict], plots: list[str]) -> str:
    parts = ["# Online serving benchmark", ""]
    for (label, date, command), levels in _runs(records).items():
        r, d = levels[0], levels[0].get("dataset") or {}
        parts += [f"- **{label}**: model `{r['model_id']}`, hardware {r.get('hardware') or 'unknown'}, "
                  f"commit `{r.get('git_commit')}`, {date}, endpoint `{r.get('endpoint')}`, dataset "
                  f"`{d.get('name')}` ({r.get('num_prompts')} requests per level, seed {d.get('seed')}, "
                  f"ignore_eos {d.get('ignore_eos')}), request rate {r.get('request_rate')}",
                  f"  - command: `{command}`"]
    counted = [f"{_label(lv)} c={lv['max_concurrency']} ({lv['requests_without_usage']})" for lv in records
               if lv.get("requests_without_usage")]
    tokens = ("token counts from the server's usage." if not counted else
              "token counts from the server's usage, except where a server sent none: there each output chunk "
              "counts as one token, so output throughput and TPOT are off wherever a chunk carries several "
              f"(levels, requests without usage: {', '.join(counted)}).")
    parts += ["", f"Latencies in ms; throughputs per second of wall time of each level; {tokens}", "",
              summary_table(records), ""]
    ratios = ratio_table(records)
    if ratios:
        parts += ["## tokenmill against the baselines, at equal concurrency", "", ratios, ""]
    classes = class_table(records)
    if classes:
        parts += ["## Requests with tools against the rest", "", classes, ""]
    failures = [(_label(lv), lv["max_concurrency"], lv.get("distinct_errors")) for lv in records if lv["failed"]]
    if failures:
        parts += ["## Failed requests", ""] + [f"- {b} c={c}: {e}" for b, c, e in failures] + [""]
    for p in plots:
        parts += [f"![{os.path.splitext(p)[0]}]({p})", ""]
    return "\n".join(parts)


def write_plots(records: list[dict], output_dir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: writing the markdown only (pip install 'tokenmill[bench]')",
              file=sys.stderr)
        return []
    title = " / ".join(sorted({f"{r['model_id']} on {r.get('hardware') or '?'}" for r in records}))
    by_label: dict[str, list[dict]] = {}
    for lv in records:
        by_label.setdefault(_label(lv), []).append(lv)
    written = []

    def line_plot(name: str, key: str, ylabel: str, log: bool = False):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, levels in by_label.items():
            xs = [lv["max_concurrency"] for lv in levels]
            ax.plot(xs, [lv[key] for lv in levels], marker="o", label=label)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=120)
        plt.close(fig)
        written.append(name)

    def dist_plot(name: str, key: str, xlabel: str):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for lv in records:
            v = np.sort(np.asarray(lv.get(key) or [], dtype=np.float64))
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{_label(lv)} c={lv['max_concurrency']}")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of samples (CDF)")
        ax.set_title(title, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=120)
        plt.close(fig)
        written.append(name)

    line_plot("throughput.png", "request_throughput", "requests / s", log=True)
    line_plot("output_throughput.png", "output_throughput", "output tokens / s", log=True)
    line_plot("latency_p95.png", "p95_e2el_ms", "p95 end-to-end latency (ms)", log=True)
    dist_plot("ttft_dist.png", "ttfts_ms", "TTFT (ms)")
    dist_plot("itl_dist.png", "itls_ms", "inter-token latency (ms)")
    return written


def main_report(args) -> int:
    records = load_records(args.results)
    os.makedirs(args.output_dir, exist_ok=True)
    plots = [] if args.no_plots else write_plots(records, args.output_dir)
    text = markdown_report(records, plots)
    path = os.path.join(args.output_dir, "REPORT.md")
    with open(path, "w") as f:
        f.write(text)
    print(summary_table(records))
    for table in (ratio_table(records), class_table(records)):
        if table:
            print()
            print(table)
    print(f"report: {path}", file=sys.stderr)
    return 0


def add_report_args(p) -> None:
    p.add_argument("results", nargs="+", help="result JSON files of `tokenmill bench serve`")
    p.add_argument("--output-dir", default="bench_report")
    p.add_argument("--no-plots", action="store_true")
