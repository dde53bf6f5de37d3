"""`tokenmill bench serve`: an online benchmark of any OpenAI-compatible server, with vLLM's metrics.

    tokenmill bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions \\
        --model qwen3-4b --dataset mixed-chat --num-prompts 200 --max-concurrency 1,4,8,16,32

Definitions (as in vLLM's `benchmark_serving`, so figures compare with theirs):
- TTFT: from sending the request to the first streamed chunk that carries output: text, reasoning or a
  tool call's delta.
- ITL: from the first output chunk on, the gaps between consecutive chunks with choices (an end-of-sequence
  token's chunk, which has no text, among them), pooled over all requests.
- TPOT: per request, (latency - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2E latency: from sending to the last chunk with choices (the usage chunk and `[DONE]` after it not
  counted), so that it ends at the chunk of the last token that usage counts.
- Throughputs divide by the wall time of the level; token counts are the server's `usage`
  (`stream_options.include_usage`), never re-tokenised here. A server that sends none leaves the output
  counts unknown (a chunk may carry several tokens): such requests count their output chunks, a prompt
  of token ids its known length, and every figure that rests on them is flagged (`requests_without_usage`).
- Arrivals at `--request-rate`: Poisson, each request sent at its own time from the level's start (a late
  send delays no later one), the gaps scaled so that the last is sent at `num_prompts / rate`, as vLLM's;
  `--burstiness B` draws the gaps from vLLM's gamma distribution of shape B instead (1: Poisson; below 1
  burstier, above 1 more even, inf evenly spaced).
- Goodput: completed requests per second that meet every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`.
- A request completes when its stream carried output and ended with `data: [DONE]`; one cut short, an HTTP
  error or an error event fails, and failed requests are left out of every latency.
Each concurrency level sends `--num-prompts` requests of its own, drawn with the seed plus the level's
position (the warm-up's with the seed plus the number of levels), one level after the other: no level finds
another's prompts in the server's prefix cache. (Prompts drawn from a dataset file repeat where it holds
fewer conversations than the levels take together.)
`--structured-fraction F` puts that fraction of them (evenly spread, the same positions at every level) under
`BENCH_SCHEMA` (chat: `response_format` json_schema; completions: `structured_outputs`), and reports
the TPOT of those and of the plain ones apart. `--tools-fraction F` (chat only) likewise has that fraction
offer the model `BENCH_TOOLS` with tool_choice "auto" (the prompt stays the dataset's, so only the tools
tell the classes apart: a server's priority boost for tool-carrying requests), and reports the TTFT of
those and of the plain ones apart. Every level records the longest wait: the largest TTFT and E2E latency.
One Python process reads every stream, so its cost per SSE chunk bounds the concurrency it can measure: the
requests go through `HTTPClient`, a small HTTP/1.1 client on asyncio streams (http:// only) that takes each
network read's chunks at once and parses their data lines with orjson. `--client-processes N` deals each
level's requests and concurrency among N such processes that begin together.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import subprocess
import sys

import numpy as np

from tokenmill.bench.provenance import git_commit
from tokenmill.bench.serve_datasets import ServeRequest, build_serve_requests, dataset_summary
from tokenmill.bench.serve_levels import run_level, run_level_processes
from tokenmill.bench.serve_metrics import class_metrics, compute_metrics, detailed, tpot_of
from tokenmill.bench.serve_payload import BENCH_SCHEMA, BENCH_TOOLS, structured_indices
from tokenmill.bench.serve_results import result_path, write_record


# ----- run metadata ---------------------------------------------------------------------------------------
def detect_hardware(base_url: str, headers: dict | None = None) -> str | None:
    """The server's own report (/v1/models 'hardware', as the hf baselines give it), else this host's GPU
    when the server is on loopback."""
    import httpx
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()
        for m in data.get("data", []):
            if m.get("hardware"):
                return m["hardware"]
    except Exception:
        pass
    if any(h in base_url for h in ("127.0.0.1", "localhost", "[::1]")):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout.strip().splitlines()
            if names:
                return f"{len(names)}x {names[0]}" if len(names) > 1 else names[0]
        except (OSError, subprocess.SubprocessError):
            pass
        return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return None


def served_info(base_url: str, headers: dict | None = None) -> dict:
    import httpx
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()
        return (data.get("data") or [{}])[0]
    except Exception:
        return {}


def _round_ms(values_s, digits: int = 3) -> list[float]:
    return [round(v * 1000.0, digits) for v in values_s]


def run_sweep(args, argv: list[str], on_level=None) -> list[dict]:
    """Runs every level in turn; returns their records (bench/serve_results.py), each also handed to
    `on_level` as the level ends."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    info = served_info(args.base_url, headers)
    model = args.model or info.get("id")
    if not model:
        raise SystemExit("--model is required when the server's /v1/models cannot be read")
    chat = args.endpoint.endswith("chat/completions")
    try:
        requests = build_serve_requests(args, chat)
    except ValueError as e:            # a dataset file that cannot be read
        raise SystemExit(str(e)) from None
    if not requests:
        raise SystemExit(f"dataset {args.dataset!r} holds no conversation long enough to send: a prompt of 4 or "
                         "more characters and an answer of 4 or more tokens (characters / 4 without --tokenizer)")
    slos, percentiles = args.goodput, args.metric_percentiles
    rate, levels = args.request_rate, args.max_concurrency
    structured = structured_indices(len(requests), args.structured_fraction)
    tools = structured_indices(len(requests), args.tools_fraction)

    def drawn(seed: int) -> list[ServeRequest]:
        return build_serve_requests(argparse.Namespace(**{**vars(args), "seed": seed}), chat)

    # each level draws its own requests (the seed plus its position) and the warm-up another, so that no
    # level finds the prompts of one before it in the server's prefix cache
    if args.num_warmups:
        first = drawn(args.seed + len(levels))[0]
    for _ in range(args.num_warmups):
        warm = ServeRequest(first.prompt, min(first.max_tokens, 16), first.prompt_len)
        (result,), _ = asyncio.run(run_level(args.base_url, args.endpoint, model, [warm], 1, headers=headers,
                                             progress=False, ignore_eos=not args.no_ignore_eos,
                                             temperature=args.temperature))
        if not result.success:
            # as vLLM's initial test run: a server or flag that fails every request stops here, not after a sweep
            raise SystemExit(f"the warm-up request to {args.base_url.rstrip('/')}{args.endpoint} failed, so no "
                             f"level was run: {result.error}")
    # vLLM's run keys (bench/serve_results.py), then ours
    request_format = args.backend or ("openai-chat" if chat else "openai")
    setup = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
             "endpoint_type": request_format, "backend": request_format,
             "label": args.label or info.get("owned_by") or "server", "model_id": model,
             "tokenizer_id": args.tokenizer, "num_prompts": len(requests),
             **args.metadata}
    provenance = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "hardware": args.hardware or detect_hardware(args.base_url, headers),
        "base_url": args.base_url, "endpoint": args.endpoint,
        "dataset": {"name": args.dataset, "seed": args.seed, "ignore_eos": not args.no_ignore_eos,
                    **dataset_summary(requests)},
        "structured": {"fraction": args.structured_fraction, "requests": len(structured),
                       "schema": BENCH_SCHEMA} if structured else None,
        "tools": {"fraction": args.tools_fraction, "requests": len(tools), "tools": BENCH_TOOLS,
                  "tool_choice": "auto"} if tools else None,
        "client_processes": args.client_processes,
    }
    records = []
    for position, conc in enumerate(levels):
        if position:
            requests = drawn(args.seed + position)
            structured = structured_indices(len(requests), args.structured_fraction)
            tools = structured_indices(len(requests), args.tools_fraction)
        if args.client_processes > 1:
            results, duration = run_level_processes(
                args.client_processes, args.base_url, args.endpoint, model, requests, conc, rate, args.seed,
                not args.no_ignore_eos, args.temperature, headers, args.request_timeout, structured, tools,
                args.burstiness)
        else:
            results, duration = asyncio.run(run_level(
                args.base_url, args.endpoint, model, requests, conc, rate, args.seed, not args.no_ignore_eos,
                args.temperature, headers, args.request_timeout, not args.no_progress, structured, tools,
                burstiness=args.burstiness))
        m = {**setup, "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
             "max_concurrency": conc, **compute_metrics(results, duration, slos, percentiles)}
        if args.save_detailed:
            m.update(detailed(requests, results))
        m["seed"] = args.seed + position
        if structured:
            for part, rows in (("structured", structured), ("plain", set(range(len(results))) - structured)):
                tpots = [t for i in rows if results[i].success and (t := tpot_of(results[i])) is not None]
                m[f"median_tpot_ms_{part}"] = float(np.median(tpots)) * 1e3 if tpots else None
                m[f"output_tokens_{part}"] = sum(results[i].output_tokens for i in rows)
        if tools:
            m.update(class_metrics(results, tools, "tools"))
            m.update(class_metrics(results, set(range(len(results))) - tools, "plain"))
        ok = [r for r in results if r.success]
        m["ttfts_ms"] = _round_ms(r.ttft for r in ok)
        m["e2els_ms"] = _round_ms(r.latency for r in ok)
        m["itls_ms"] = _round_ms(g for r in ok for g in r.itl)
        m["distinct_errors"] = sorted({r.error for r in results if not r.success})[:10]
        m.update(provenance)
        records.append(m)
        print(format_level(m), file=sys.stderr, flush=True)
        if on_level is not None:       # results survive a run cut short by a time limit
            on_level(m)
    return records


def format_level(m: dict) -> str:
    return (f"{m['label']} c={m['max_concurrency']}: {m['completed']}/{m['num_requests']} ok, "
            f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} out tok/s, "
            f"TTFT p50 {m['median_ttft_ms']:.1f} ms, TPOT p50 {m['median_tpot_ms']:.2f} ms, "
            f"E2E p95 {m['p95_e2el_ms']:.0f} ms, ITL p99 {m['p99_itl_ms']:.2f} ms, TTFT max {m['max_ttft_ms']:.0f} ms, "
            f"E2E max {m['max_e2el_ms']:.0f} ms" + _structured_tpots(m) + _tool_ttfts(m) + _errors(m) + _no_usage(m))


def _no_usage(m: dict) -> str:
    n = m.get("requests_without_usage") or 0
    return (f"; WARNING: {n} request(s) without usage: their output tokens are counted as chunks, so TPOT and "
            "output throughput are off wherever a chunk carries several tokens") if n else ""


def _errors(m: dict) -> str:
    """The distinct errors of the failed requests (up to 10 kept in the record), the first one shown."""
    errors = m.get("distinct_errors") or []
    return f"; {len(errors)} distinct error(s), first: {errors[0]}" if errors else ""


def _structured_tpots(m: dict) -> str:
    if "median_tpot_ms_structured" not in m:
        return ""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
    return (f", TPOT p50 structured {fmt(m['median_tpot_ms_structured'])} / plain "
            f"{fmt(m['median_tpot_ms_plain'])} ms")


def _tool_ttfts(m: dict) -> str:
    if "p95_ttft_ms_tools" not in m:
        return ""
    return (f", TTFT p50/p95 tools {m['median_ttft_ms_tools']:.1f}/{m['p95_ttft_ms_tools']:.1f} / plain "
            f"{m['median_ttft_ms_plain']:.1f}/{m['p95_ttft_ms_plain']:.1f} ms")


def main_serve(args, argv: list[str]) -> int:
    os.makedirs(args.output_dir, exist_ok=True)
    paths, saved = [], []
    filename = args.result_filename or (f"{args.name}.json" if args.name else None)

    def save(record: dict) -> None:
        # a level's line is added to a file this run wrote before (a named file, or a level repeated)
        path = result_path(args.output_dir, filename, record)
        write_record(path, record, append=args.append_result or path in paths)
        if path not in paths:
            paths.append(path)
        saved.append(record)

    interrupted = False
    try:
        records = run_sweep(args, argv, on_level=save)
    except KeyboardInterrupt:
        # Ctrl-C: the level under way is lost, the completed ones were saved as each ended
        if not saved:
            print("interrupted before the first level completed: no results", file=sys.stderr)
            return 130
        records, interrupted = saved, True
        print(f"interrupted: the {len(records)} completed level(s) only", file=sys.stderr)
    from tokenmill.bench.report_serve import class_table, summary_table
    print(summary_table(records))
    classes = class_table(records)
    if classes:
        print()
        print(classes)
    print(f"results: {' '.join(paths)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(r["failed"] == 0 for r in records) else 1
