"""`bench serve`'s flags, and the checks that parse them before the server is asked anything."""
from __future__ import annotations

import math

from tokenmill.bench.datasets import parse_range
from tokenmill.bench.serve_metrics import PERCENTILES, compute_metrics
from tokenmill.bench.serve_results import parse_metadata

DEFAULT_ENDPOINT = "/v1/chat/completions"
INPUT_LEN_RANGE, OUTPUT_LEN_RANGE = "100,1024", "100,300"


def add_serve_args(p) -> None:
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host and --port)")
    p.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                   help=f"(default: {DEFAULT_ENDPOINT}, or /v1/completions with --backend vllm or openai)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="backend name in the results (default: /v1/models owned_by)")
    p.add_argument("--dataset", default="mixed-chat", help="'mixed-chat', 'random' or a ShareGPT-format JSON file")
    p.add_argument("--tokenizer", default=None, help="tokenizer for ShareGPT output lengths")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per concurrency level")
    p.add_argument("--max-concurrency", default="1,4,8,16,32", help="comma-separated levels, run in turn")
    p.add_argument("--request-rate", default="inf", help="Poisson arrival rate (req/s), or inf")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="with a finite --request-rate, the shape of vLLM's gamma-distributed gaps: 1 Poisson, "
                        "below 1 burstier, above 1 more even, inf evenly spaced")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-range", default=None,
                   help=f"random: inclusive prompt lengths 'LO,HI' or 'N' (default: {INPUT_LEN_RANGE})")
    p.add_argument("--output-len-range", default=None,
                   help=f"random: inclusive max_tokens 'LO,HI' or 'N' (default: {OUTPUT_LEN_RANGE})")
    p.add_argument("--random-vocab-limit", type=int, default=1000, help="random completions: ids below this")
    p.add_argument("--mixed-chat-chars", default="50,1000", help="mixed-chat: inclusive prompt characters")
    p.add_argument("--mixed-chat-output-len", default="100,300", help="mixed-chat: inclusive max_tokens")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers without it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--structured-fraction", type=float, default=0.0,
                   help="this fraction of the requests asks for JSON under a schema (structured output)")
    p.add_argument("--tools-fraction", type=float, default=0.0,
                   help='chat: this fraction of the requests offers two tools (tool_choice "auto"; the server '
                        "needs --enable-auto-tool-choice); TTFT reported per class")
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default=None,
                   help="vLLM's flag: more percentiles of every metric, e.g. '25,99.9' (p50, p95 and p99 always)")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds a request may take, from connecting to the last byte of its response")
    p.add_argument("--hardware", default=None, help="hardware string for the results (default: detected)")
    p.add_argument("--output-dir", "--result-dir", default="bench_results", help="where the results go")
    p.add_argument("--name", default=None, help="results file stem (default: serve-BACKEND-time)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--client-processes", type=int, default=1,
                   help="read the streams from this many processes, the requests and concurrency dealt among "
                        "them (one process's cost per SSE chunk bounds what it can measure at high concurrency)")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:300', 'tpot:50'] -> {'ttft': 300.0, 'tpot': 50.0} (milliseconds, each 0 or more)."""
    slos = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, _, value = part.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if key not in ("ttft", "tpot", "e2el") or not ms >= 0:
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS with MS a number of milliseconds "
                                 f">= 0, got {part!r}")
            slos[key] = ms
    return slos


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """vLLM's --metric-percentiles, e.g. '25,50,99.9', added to the PERCENTILES every result has."""
    try:
        extra = [float(p) for p in (text or "").split(",") if p.strip()]
    except ValueError:
        extra = [math.nan]
    if any(not 0 <= p <= 100 for p in extra):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], got {text!r}")
    return tuple(sorted(set(PERCENTILES) | set(extra)))


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_levels(text: str) -> list[int]:
    """--max-concurrency '1,4,8' -> [1, 4, 8]."""
    try:
        levels = [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--max-concurrency takes comma-separated levels of 1 or more, got {text!r}")
    return levels


def check_sweep_args(args) -> None:
    """Refuses, naming the flag and its value, what `run_sweep` could not run, before the server is asked
    anything; `args.request_rate` becomes a float, `args.max_concurrency` the list of levels, and
    `args.goodput`, `args.metric_percentiles` and `args.metadata` their parsed values, which `run_sweep` reads."""
    args.goodput = parse_goodput(args.goodput)
    args.metric_percentiles = parse_percentiles(args.metric_percentiles)
    args.metadata = parse_metadata(args.metadata, compute_metrics([], 1.0, None, args.metric_percentiles))
    args.max_concurrency = parse_levels(args.max_concurrency)
    try:
        rate = float(args.request_rate)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise ValueError(f"--request-rate takes requests per second above 0, or inf, got {args.request_rate!r}")
    args.request_rate = rate
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be above 0, got {args.burstiness}")
    metrics = [m.strip() for m in (args.percentile_metrics or "").split(",") if m.strip()]
    if any(m not in PERCENTILE_METRICS for m in metrics):
        raise ValueError(f"--percentile-metrics takes {','.join(PERCENTILE_METRICS)}, got "
                         f"{args.percentile_metrics!r}")
    if args.ignore_eos and args.no_ignore_eos:
        raise ValueError("give --ignore-eos or --no-ignore-eos, not both")
    if args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be above 0 seconds, got {args.request_timeout}")
    for name in ("structured_fraction", "tools_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.tools_fraction > 0 and not args.endpoint.endswith("chat/completions"):
        raise ValueError("--tools-fraction needs the chat endpoint (/v1/chat/completions)")
    if args.tools_fraction > 0 and args.structured_fraction > 0:
        raise ValueError("give --tools-fraction or --structured-fraction, not both (each splits the requests "
                         "into two classes)")
    for name in ("mixed_chat_chars", "mixed_chat_output_len"):
        try:
            parse_range(getattr(args, name))
        except ValueError as e:
            raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
