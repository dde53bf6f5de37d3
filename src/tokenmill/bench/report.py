"""Markdown tables of throughput results, and the ratios between backends of one run."""
from __future__ import annotations


def add_ratios(results: list[dict]) -> None:
    """`output_tok_s_vs[B]`: this backend's output throughput over backend B's, same requests, same run."""
    rates = {r["backend"]: r["output_tok_s"] for r in results if r.get("output_tok_s")}
    for r in results:
        if r.get("output_tok_s"):
            r["output_tok_s_vs"] = {b: r["output_tok_s"] / v for b, v in rates.items() if b != r["backend"]}


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(summary: dict) -> str:
    results = summary["results"]
    others = [r["backend"] for r in results if r.get("output_tok_s")]
    head = ["backend", "requests", "elapsed s", "output tok/s", "total tok/s", "req/s", "ms/token (1 req)",
            "ready s", "peak KV blocks", "floor s", "measured/floor"] + [f"x {b}" for b in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        blocks = r.get("peak_blocks_used")
        if blocks is not None and r.get("num_total_blocks"):
            blocks = f"{blocks:,} / {r['num_total_blocks']:,}"
        row = [r["backend"], _fmt(r["num_requests"]), _fmt(r["elapsed_s"], 2), _fmt(r["output_tok_s"]),
               _fmt(r["total_tok_s"]), _fmt(r["requests_s"], 2), _fmt(r.get("ms_per_output_token"), 2),
               _fmt(r.get("time_to_ready_s")), _fmt(blocks), _fmt(r.get("floor_s"), 2),
               _fmt(r.get("measured_over_floor"), 2)]
        row += ["-" if b == r["backend"] else _fmt(r.get("output_tok_s_vs", {}).get(b), 2) for b in others]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_report(summary: dict, table: str | None = None) -> str:
    w = summary["workload"]
    roof = summary["roofline"]
    decode_floor = next((r["floor_ms_per_output_token"] for r in summary["results"]
                         if "floor_ms_per_output_token" in r), None)
    return "\n".join([
        f"## Offline throughput: {summary['model']}",
        "",
        f"- command: `{summary['command']}`",
        f"- commit {summary['git_commit']}, {summary['date']}, {summary['hardware']}",
        f"- workload: {w['dataset']}, {w['num_requests']} requests, "
        + (f"input {w['input_len_range']}, output {w['output_len_range']}, " if "input_len_range" in w else "")
        + f"seed {w['seed']}: {w['prompt_tokens']:,} prompt and "
        f"{w['output_tokens']:,} output tokens",
        f"- roofline floor {roof['floor_s']:.2f} s ({roof['floor_output_tok_s']:,.0f} output tok/s) at "
        f"{roof['memory_bandwidth'] / 1e12:.1f} TB/s and {roof['matmul_flops'] / 1e12:.0f} TFLOP/s"
        + (f", weights {roof['weights']} (products at {roof['matmul_rate']:g}x that), KV cache "
           f"{roof['kv_cache_dtype']}" if "weights" in roof else "")
        + (f"; batch-1 decode floor {decode_floor:.2f} ms/token" if decode_floor is not None else ""),
        "",
        table if table is not None else markdown_table(summary),
        "",
    ])
