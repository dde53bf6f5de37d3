"""Markdown tables and a plot of `tokenmill bench memory` results (the summary dict it writes as JSON)."""
from __future__ import annotations

import os
import sys

GIB = 2**30
_STATIC = (("longest", "static, longest"), ("max_model_len", "static, max_model_len"))


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= 0.01 * GIB else f"{n / 2**20:,.2f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _studied(summary: dict) -> list[dict]:
    return [m for m in summary["models"] if "workloads" in m]


def memory_table(summary: dict) -> str:
    head = ["model", "workload", "requests", "tokens", "needed", "paged", "static, longest",
            "static, max_model_len", "paged waste", "static waste (longest / max_model_len)",
            "paged saves (vs longest / vs max_model_len)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in _studied(summary):
        for r in m["workloads"]:
            lines.append("| " + " | ".join([
                m["model"], r["workload"], f"{r['num_requests']:,}", f"{r['total_tokens']:,}",
                _gib(r["needed_bytes"]), f"{_gib(r['paged_bytes'])} ({r['source']})",
                _gib(r["static_longest_bytes"]), _gib(r["static_max_model_len_bytes"]), _pct(r["paged_waste"]),
                " / ".join(_pct(r[f"static_{k}_waste"]) for k, _ in _STATIC),
                " / ".join(_pct(r[f"paged_saving_vs_{k}"]) for k, _ in _STATIC)]) + " |")
    return "\n".join(lines)


def concurrency_table(summary: dict) -> str:
    models = _studied(summary)
    names = [r["workload"] for r in models[0]["workloads"]] if models else []
    head = (["model", "GPU", "KV budget"] + [f"{n}: paged / static" for n in names]
            + ["long, static at the model's context"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        gpus = []
        if "device_concurrency" in m:
            b = m["device_budget"]
            gpus.append((f"{b['hardware']} ({_budget_source(b)})", m["device_concurrency"]))
        g = m["gpu_computed"]
        gpus.append((f"{g['gpu_gib']:g} GiB (computed)", g))
        for label, c in gpus:
            lines.append("| " + " | ".join(
                [m["model"], label, _gib(c["kv_budget_bytes"])]
                + [f"{c[f'paged_{n}']:,} / {c['static_max_model_len']:,}" for n in names]
                + [f"{c['static_model_context']:,} ({m['model_context']:,} tokens)"]) + " |")
    return "\n".join(lines)


def _budget_source(budget: dict) -> str:
    # on the CPU the engine does not profile: its cache is a fixed size (runner/model_runner.py)
    return "measured" if budget["device"].startswith("cuda") else "the engine's fixed CPU cache"


def budget_lines(summary: dict) -> list[str]:
    out = [f"- {m['model']}: failed ({m['error']})" for m in summary["models"] if "error" in m]
    for m in _studied(summary):
        g = m["gpu_computed"]
        line = (f"- {m['model']}: weights {_gib(g['weight_bytes'])} (config, {m['checkpoint_dtype']}), "
                f"{g['kv_bytes_per_token'] / 1024:g} KiB of KV per token; {g['gpu_gib']:g} GiB GPU: "
                f"{g['gpu_gib']:g} GiB x {g['gpu_memory_utilization']:g} - weights - {g['overhead_gib']:g} GiB "
                f"allowance = {_gib(g['kv_budget_bytes'])} of KV")
        b = m.get("device_budget")
        if b is not None:
            line += (f"; {b['hardware']}: {b['num_blocks']:,} blocks = {_gib(b['kv_budget_bytes'])} of KV "
                     f"({b['dtype']}, max_num_batched_tokens {b['max_num_batched_tokens']:,}, max_num_seqs "
                     f"{b['max_num_seqs']}, gpu_memory_utilization {b['gpu_memory_utilization']:g})")
            if "overhead_bytes" in b:
                line += (f", weights {_gib(b['weight_bytes'])}, measured overhead (total x utilization - "
                         f"weights - KV) {_gib(b['overhead_bytes'])} of {_gib(b['total_bytes'])}")
        out.append(line)
    return out


def markdown_report(summary: dict, plot: str | None = None) -> str:
    s = summary["settings"]
    parts = [
        "## KV memory: paged vs static",
        "",
        f"- command: `{summary['command']}`",
        f"- commit {summary['git_commit']}, {summary['date']}, {summary['hardware']}",
        f"- block size {s['block_size']}, max_model_len {s['max_model_len']:,}, {s['output_len']} output tokens "
        f"per request, seed {s['seed']}; " + "; ".join(f"{w['name']}: {w['description']}"
                                                        for w in summary["workloads"]),
        "",
        memory_table(summary),
        "",
        "Maximum concurrency (requests resident at once; static reserves max_model_len per request):",
        "",
        concurrency_table(summary),
        "",
        *budget_lines(summary),
        "",
    ]
    if plot:
        parts += [f"![KV memory]({plot})", ""]
    return "\n".join(parts)


def write_plot(summary: dict, path: str) -> bool:
    """KV GiB per workload and model (top row) and the maximum concurrency (bottom row, static reserving
    max_model_len); False without matplotlib or results."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tokenmill[bench]'; `tokenmill bench memory "
              "--replot RESULT.json` draws it later from the JSON)", file=sys.stderr)
        return False
    models = _studied(summary)
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 7.0), squeeze=False)
    series = [("needed_bytes", "needed"), ("paged_bytes", "paged"), ("static_longest_bytes", "static, longest"),
              ("static_max_model_len_bytes", "static, max_model_len")]
    width = 0.8 / len(series)
    for col, m in enumerate(models):
        ax = axes[0][col]
        names = [r["workload"] for r in m["workloads"]]
        for k, (key, label) in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [r[key] / GIB for r in m["workloads"]], width, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"KV GiB ({m['dtype']}, {m['workloads'][0]['source']})")
        ax.set_title(m["model"], fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        gpus = ([(f"{m['device_budget']['hardware']} ({_budget_source(m['device_budget'])})",
                  m["device_concurrency"])] if "device_concurrency" in m else [])
        gpus.append((f"{m['gpu_computed']['gpu_gib']:g} GiB, computed", m["gpu_computed"]))
        bars = [(f"{g}: {kind}", [c[f"paged_{n}"] if kind == "paged" else c["static_max_model_len"] for n in names])
                for g, c in gpus for kind in ("paged", "static")]
        w2 = 0.8 / len(bars)
        for k, (label, values) in enumerate(bars):
            xs = [i + (k - (len(bars) - 1) / 2) * w2 for i in range(len(names))]
            ax.bar_label(ax.bar(xs, values, w2, label=label), fontsize=6)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("requests resident at once")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(0, 3 * max(max(v) for _, v in bars) + 1)       # room for the labels above the bars
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"KV memory, paged vs static ({summary['git_commit']}, {summary['hardware']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(summary: dict, output_dir: str, name: str) -> str:
    """NAME.json, NAME.md and, with matplotlib, NAME.png under `output_dir`; returns the markdown."""
    import json

    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot = f"{name}.png" if write_plot(summary, os.path.join(output_dir, f"{name}.png")) else None
    text = markdown_report(summary, plot)
    with open(os.path.join(output_dir, f"{name}.md"), "w") as f:
        f.write(text)
    return text
