"""`tokenmill bench`: the parser of every subcommand (throughput, prepare, serve, report, memory) and `main`, which
hands each to the module that runs it (throughput_run.py, serve.py, report_serve.py, memory_run.py); arguments
without a subcommand are `throughput`'s.

    python -m tokenmill.bench throughput --model preset:qwen3-4b --backend tokenmill,hf-cb --subset 64
"""
from __future__ import annotations

import argparse
import os
import sys

from tokenmill.bench import BACKENDS
from tokenmill.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig
from tokenmill.bench.child_process import preset_dtype
from tokenmill.bench.datasets import parse_range
from tokenmill.bench.memory_run import MEMORY_MODELS, run_memory
from tokenmill.bench.serve_args import INPUT_LEN_RANGE as SERVE_INPUT_LEN_RANGE
from tokenmill.bench.serve_args import OUTPUT_LEN_RANGE as SERVE_OUTPUT_LEN_RANGE
from tokenmill.bench.throughput_run import run_throughput, run_worker
from tokenmill.bench.vllm_args import add_vllm_args, resolve_vllm_args, vllm_range
from tokenmill.cli_help import HelpFormatter

# vllm_range (vllm_args.py's) stays importable from here, where it was defined before that split
__all__ = ["SUBCOMMANDS", "THROUGHPUT_LEN_RANGE", "build_parser", "check_workload", "main", "parse_args",
           "vllm_range"]

SUBCOMMANDS = ("throughput", "prepare", "serve", "report", "memory")

THROUGHPUT_LEN_RANGE = "100,1024"


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="tokenmill bench", description="tokenmill benchmarks",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("throughput", help="offline throughput against Hugging Face transformers baselines",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="model directory or preset:NAME")
    p.add_argument("--backend", default="tokenmill",
                   help=f"comma-separated backends from {', '.join(BACKENDS)}; each runs in its own process")
    p.add_argument("--dataset", default="random", help="'random' or a ShareGPT-format JSON file")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for --dataset FILE (default: the model)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-range", default=None,
                   help=f"inclusive 'LO,HI' (or 'N') prompt lengths (default: {THROUGHPUT_LEN_RANGE})")
    p.add_argument("--output-len-range", default=None,
                   help=f"inclusive 'LO,HI' (or 'N') output lengths (default: {THROUGHPUT_LEN_RANGE})")
    p.add_argument("--subset", type=int, default=None, help="run every backend on the first N requests only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="tokenmill sampling temperature (the baselines decode greedily)")
    p.add_argument("--top-p", type=float, default=1.0, help="tokenmill nucleus sampling, with --temperature")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="tokenmill: KV-cache element type (auto: the model dtype; fp8: E4M3)")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="tokenmill: the weights' format, as `serve --quantization` (fp8 also quantizes a plain "
                        "model at load; default: the checkpoint's own)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=EngineConfig.cuda_graph_max_tokens,
                   help="tokenmill: steps with prefill tokens run as CUDA graphs up to this many tokens, as `serve`'s")
    p.add_argument("--swap-space", type=float, default=4.0, help="tokenmill: GiB of CPU swap space for KV blocks")
    p.add_argument("--preemption-mode", choices=["swap", "recompute"], default=None,
                   help="tokenmill: swap or recompute preempted requests (default: swap if --swap-space > 0)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="hf-static: requests per generate() batch")
    p.add_argument("--hf-static-attn-impl", default="sdpa")
    p.add_argument("--hf-cb-attn-impl", default=None,
                   help="hf-cb attention implementation (default: paged SDPA under this version's name)")
    p.add_argument("--hf-max-memory-percent", type=float, default=0.5, help="hf-cb KV cache memory fraction")
    p.add_argument("--memory-bandwidth", type=float, default=4.3e12, help="roofline: bytes/s")
    p.add_argument("--matmul-flops", type=float, default=790e12, help="roofline: FLOP/s")
    p.add_argument("--output-dir", "--result-dir", default="bench_results", help="where the results go")
    p.add_argument("--name", default=None, help="file name stem of the results (default: model-time)")
    p.add_argument("--in-process", action="store_true", help="run the backends in this process (tests)")
    p.add_argument("--no-progress", action="store_true")
    # Internal: how the parent hands one backend to a child process.
    p.add_argument("--worker-requests", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    p.add_argument("--worker-model-path", help=argparse.SUPPRESS)
    p.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    add_vllm_args(p, serve=False)

    q = sub.add_parser("prepare", help="materialise a preset model directory and print its path",
                       formatter_class=HelpFormatter)
    q.add_argument("--model", required=True)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", default="bfloat16")

    from tokenmill.bench.report_serve import add_report_args
    from tokenmill.bench.serve_args import add_serve_args
    serve = sub.add_parser("serve", help="online benchmark of an OpenAI-compatible server",
                           formatter_class=HelpFormatter)
    add_serve_args(serve)
    add_vllm_args(serve, serve=True)
    add_report_args(sub.add_parser("report", help="markdown + PNG report from `bench serve` results",
                                   formatter_class=HelpFormatter))
    return parser, {"throughput": p, "serve": serve, "memory": _add_memory_args(sub)}


def _add_memory_args(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("memory", help="KV memory of the paged cache against a static per-request cache",
                       description="KV memory of the paged cache against a static, contiguous per-request "
                                   "cache, and the maximum concurrency (see tokenmill/bench/memory.py)",
                       formatter_class=HelpFormatter)
    m.add_argument("--model", action="append", default=None,
                   help="model directory or preset:NAME, repeatable or comma-separated "
                        f"(default: {','.join(MEMORY_MODELS)})")
    m.add_argument("--num-concurrent", type=int, default=10, help="requests of the concurrent workload")
    m.add_argument("--concurrent-len-range", default="500,2000", help="its lengths (prompt + output), uniform")
    m.add_argument("--num-mixed", type=int, default=32, help="requests of the mixed workload")
    m.add_argument("--mixed-len-range", default="50,8000", help="its lengths, log-uniform")
    m.add_argument("--num-long", type=int, default=8, help="requests of the long workload")
    m.add_argument("--long-len", type=int, default=8192, help="the length of each long request")
    m.add_argument("--output-len", type=int, default=16, help="output tokens of every request")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="auto")
    m.add_argument("--device", default="auto")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--max-model-len", type=int, default=8192,
                   help="the engines' context, and what the static cache reserves per request")
    m.add_argument("--max-num-seqs", type=int, default=256, help="the KV-budget engine's (serving) setting")
    m.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the KV-budget engine's (serving) setting; a workload's engine takes at least its "
                        "prompt tokens, to prefill them in one step")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--gpu-gib", type=float, default=24.0, help="the GPU whose figures are computed")
    m.add_argument("--overhead-gib", type=float, default=2.0,
                   help="activations, CUDA context and allocator, subtracted from the computed GPU's memory")
    m.add_argument("--compute-only", action="store_true",
                   help="no engine: every figure from the formulas (paged blocks: sum of ceil((L-1)/block))")
    m.add_argument("--replot", default=None, metavar="RESULT.json",
                   help="rewrite the markdown and plot of a saved result, running nothing")
    m.add_argument("--output-dir", default="bench_results", help="where the results go")
    m.add_argument("--name", default=None, help="file name stem of the results (default: memory-time)")
    m.add_argument("--in-process", action="store_true", help="run the models in this process (tests)")
    m.add_argument("--worker-model", help=argparse.SUPPRESS)
    m.add_argument("--worker-model-path", help=argparse.SUPPRESS)
    m.add_argument("--worker-result", help=argparse.SUPPRESS)
    return m


def check_workload(parser: argparse.ArgumentParser, args, datasets: tuple[str, ...]) -> None:
    """The request set's flags, refused with the flag and its value named before a server is asked or a
    model materialised; `datasets` are the built-in names a --dataset that is no file may take."""
    if args.dataset not in datasets and not os.path.isfile(args.dataset):
        parser.error(f"--dataset {args.dataset!r} is neither {' nor '.join(map(repr, datasets))} nor a file")
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    for name in ("input_len_range", "output_len_range"):
        try:
            parse_range(getattr(args, name))
        except ValueError as e:
            parser.error(f"--{name.replace('_', '-')}: {e}")


def parse_args(argv: list[str]):
    """`tokenmill bench` arguments, with vLLM's flag names mapped onto ours."""
    parser, subs = _build_parsers()
    args = parser.parse_args(argv)
    if args.command == "serve":
        resolve_vllm_args(subs["serve"], args, SERVE_INPUT_LEN_RANGE, SERVE_OUTPUT_LEN_RANGE)
        check_workload(subs["serve"], args, ("mixed-chat", "random"))
        from tokenmill.bench.serve_args import check_sweep_args
        try:
            check_sweep_args(args)
        except ValueError as e:
            subs["serve"].error(str(e))
    elif args.command == "throughput":
        resolve_vllm_args(subs["throughput"], args, THROUGHPUT_LEN_RANGE, THROUGHPUT_LEN_RANGE)
        check_workload(subs["throughput"], args, ("random",))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        argv = argv[1:]
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["throughput", *argv]
    args = parse_args(argv)
    if args.command == "prepare":
        from tokenmill.models.presets import resolve_model_path
        print(resolve_model_path(args.model, preset_dtype(args.dtype), args.seed))
        return 0
    if args.command == "serve":
        from tokenmill.bench.serve import main_serve
        return main_serve(args, argv)
    if args.command == "report":
        from tokenmill.bench.report_serve import main_report
        return main_report(args)
    if args.command == "memory":
        return run_memory(args, argv)
    if args.worker_result:
        return run_worker(args)
    summary = run_throughput(args, argv)
    return 1 if any("error" in r for r in summary["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
