"""`tokenmill bench throughput`: one request set through one or more backends, one process per backend.

    python -m tokenmill.bench throughput --model preset:qwen3-4b --backend tokenmill,hf-cb --subset 64

The parent builds the request set once and hands it to each backend's own process in turn (so their GPU
memory never mixes), then prints one table with the ratios between backends and writes JSON + markdown to
`--output-dir`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

from tokenmill.bench import BACKENDS, report
from tokenmill.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig
from tokenmill.bench.provenance import git_commit
from tokenmill.bench.datasets import (load_requests, parse_range, random_requests, save_requests,
                                      sharegpt_requests, special_token_ids)
from tokenmill.bench.serve_args import DEFAULT_ENDPOINT
from tokenmill.bench.serve_args import INPUT_LEN_RANGE as SERVE_INPUT_LEN_RANGE
from tokenmill.bench.serve_args import OUTPUT_LEN_RANGE as SERVE_OUTPUT_LEN_RANGE
from tokenmill.cli_help import HelpFormatter

SUBCOMMANDS = ("throughput", "prepare", "serve", "report", "memory")

THROUGHPUT_LEN_RANGE = "100,1024"
MEMORY_MODELS = ("preset:qwen3-4b", "preset:nanbeige4.1-3b")
# `vllm bench`'s random dataset when its flags are given without a length
VLLM_RANDOM_INPUT_LEN, VLLM_RANDOM_OUTPUT_LEN = 1024, 128


def add_vllm_args(p: argparse.ArgumentParser, serve: bool) -> None:
    """`vllm bench`'s flag names, each mapped onto the option of ours with the same meaning by
    `resolve_vllm_args`, so that a vLLM user's command runs unchanged."""
    g = p.add_argument_group("vLLM's flag names", "accepted as `vllm bench` has them, with its meanings")
    g.add_argument("--dataset-name", choices=["random", "sharegpt"], default=None,
                   help="--dataset random, or --dataset FILE for sharegpt with --dataset-path FILE")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file of --dataset-name sharegpt")
    g.add_argument("--random-input-len", type=int, default=None,
                   help="random prompts of about this many tokens: --input-len-range LEN*(1-R),LEN*(1+R) "
                        f"with R the --random-range-ratio (vLLM's default: {VLLM_RANDOM_INPUT_LEN})")
    g.add_argument("--random-output-len", type=int, default=None,
                   help="likewise --output-len-range around this many output tokens "
                        f"(vLLM's default: {VLLM_RANDOM_OUTPUT_LEN})")
    g.add_argument("--random-range-ratio", type=float, default=None,
                   help="R in [0, 1): lengths uniform in [LEN*(1-R), LEN*(1+R)] (vLLM's default: 0)")
    g.add_argument("--save-result", action="store_true",
                   help="accepted for vLLM's commands; the results are always saved in --output-dir")
    g.add_argument("--result-filename", default=None,
                   help="the results' file name in --output-dir (--name plus .json)" + (
                       "; a sweep's levels are its lines" if serve else ""))
    if serve:
        g.add_argument("--save-detailed", action="store_true",
                       help="also vLLM's per-request lists: input_lens, output_lens, ttfts, itls, latencies, "
                            "start_times, generated_texts, errors")
        g.add_argument("--append-result", action="store_true",
                       help="add each level's result as a line of its file instead of replacing the file")
        g.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", default=None,
                       help="pairs kept as keys of every level's result, e.g. --metadata version=0.3.3 tp=1")
        g.add_argument("--backend", choices=["vllm", "openai", "openai-chat"], default=None,
                       help="the request format when --endpoint is not given: openai-chat is "
                            "/v1/chat/completions, the others /v1/completions (also the default where "
                            "vLLM's dataset flags are given, as vLLM's default backend)")
        g.add_argument("--ignore-eos", action="store_true",
                       help="accepted for vLLM's commands: ignore_eos is sent unless --no-ignore-eos is given")
        g.add_argument("--percentile-metrics", default=None,
                       help="accepted for vLLM's commands (names from ttft,tpot,itl,e2el): the percentiles of "
                            "every metric are reported")
        g.add_argument("--host", default="127.0.0.1", help="the server, when --base-url is not given")
        g.add_argument("--port", type=int, default=8000, help="the server's port, when --base-url is not given")


def vllm_range(length: int, ratio: float) -> str:
    """vLLM's random lengths: uniform integers in [floor(len*(1-r)), ceil(len*(1+r))], at least 1 (the
    products rounded first, so that 200 * 1.1 is 220, not 221 as a float would have it)."""
    lo, hi = round(length * (1 - ratio), 6), round(length * (1 + ratio), 6)
    return f"{max(1, math.floor(lo))},{max(1, math.ceil(hi))}"


def resolve_vllm_args(parser: argparse.ArgumentParser, args, input_len_range: str, output_len_range: str) -> None:
    """Maps vLLM's flags onto ours; our range options left unset take `input_len_range` and
    `output_len_range`. Giving both a vLLM flag and the option it maps onto is an error."""
    ratio = args.random_range_ratio
    if ratio is not None and not 0.0 <= ratio < 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1), got {ratio}")
    if (args.random_input_len, args.random_output_len, ratio) != (None, None, None):
        if args.input_len_range is not None or args.output_len_range is not None:
            parser.error("give --input-len-range/--output-len-range or vLLM's --random-input-len/"
                         "--random-output-len/--random-range-ratio, not both")
        for name in ("random_input_len", "random_output_len"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
        args.input_len_range = vllm_range(args.random_input_len or VLLM_RANDOM_INPUT_LEN, ratio or 0.0)
        args.output_len_range = vllm_range(args.random_output_len or VLLM_RANDOM_OUTPUT_LEN, ratio or 0.0)
    args.input_len_range = args.input_len_range or input_len_range
    args.output_len_range = args.output_len_range or output_len_range
    if args.dataset_name is not None:
        dataset = args.dataset_name if args.dataset_name == "random" else args.dataset_path
        if dataset is None:
            parser.error("--dataset-name sharegpt needs --dataset-path FILE")
        if args.dataset not in (parser.get_default("dataset"), dataset):
            parser.error(f"give --dataset or --dataset-name, not both ({args.dataset!r} and {dataset!r})")
        args.dataset = dataset
    if args.result_filename is not None:
        if args.name is not None:
            parser.error("give --name or --result-filename, not both")
        args.name = args.result_filename.removesuffix(".json")
    if getattr(args, "host", None) is not None:          # bench serve
        if args.base_url is None:
            args.base_url = f"http://{args.host}:{args.port}"
        if args.endpoint is None:
            # vLLM's default backend (openai, /v1/completions) where a command speaks vLLM's dataset flags
            vllm_command = any(getattr(args, k) is not None for k in (
                "dataset_name", "random_input_len", "random_output_len", "random_range_ratio"))
            args.endpoint = ("/v1/completions" if args.backend in ("vllm", "openai")
                             or (args.backend is None and vllm_command) else DEFAULT_ENDPOINT)


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


def _preset_dtype(dtype: str) -> str:
    return "bfloat16" if dtype in ("auto", None) else dtype


def _hf_config(model: str) -> dict:
    from tokenmill.models.presets import is_preset, preset_config

    if is_preset(model):
        return preset_config(model)
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def build_requests(args, hf_config: dict, model_path: str | None):
    if args.dataset == "random":
        return random_requests(args.num_prompts, parse_range(args.input_len_range),
                               parse_range(args.output_len_range), hf_config["vocab_size"],
                               special_token_ids(hf_config), args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
    try:
        return sharegpt_requests(args.dataset, tokenizer, args.num_prompts, args.seed, max_input_len=1024,
                                 max_output_len=1024)
    except ValueError as e:             # a dataset file that cannot be read
        raise SystemExit(str(e)) from None


def _child_env() -> dict:
    """This process's environment, with this copy of tokenmill first on the path of child processes."""
    env = dict(os.environ)
    src_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    return env


def _materialise(args) -> str:
    """Resolve a preset in a separate process, so this one never holds GPU memory."""
    from tokenmill.models.presets import is_preset, resolve_model_path

    if not is_preset(args.model):
        return args.model
    if args.in_process:
        return resolve_model_path(args.model, _preset_dtype(args.dtype), args.seed)
    out = subprocess.run([sys.executable, "-m", "tokenmill.bench", "prepare", "--model", args.model,
                          "--seed", str(args.seed), "--dtype", _preset_dtype(args.dtype)],
                         stdout=subprocess.PIPE, text=True, check=True, env=_child_env())
    return out.stdout.strip().splitlines()[-1]


def _run_worker(args) -> int:
    from tokenmill.bench.throughput import run_backend

    requests = load_requests(args.worker_requests)
    result = run_backend(args.backend, args, args.worker_model_path, requests, start_time=args.spawn_time)
    with open(args.worker_result, "w") as f:
        json.dump(result, f)
    return 0


def _run_child(args, argv: list[str], backend: str, model_path: str, requests_file: str, result_file: str) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.bench", *argv, "--backend", backend, "--worker-requests",
           requests_file, "--worker-result", result_file, "--worker-model-path", model_path,
           "--spawn-time", repr(time.time())]
    proc = subprocess.run(cmd, env=_child_env())
    if proc.returncode != 0 or not os.path.isfile(result_file):
        return {"backend": backend, "error": f"exit status {proc.returncode}"}
    with open(result_file) as f:
        return json.load(f)


def _weight_format(quantization: str | None, checkpoint) -> tuple[str | None, int]:
    """The projections' format the engine serves (`--quantization`, else the checkpoint's, as
    `ModelConfig.quantization` parsed it) as the roofline takes it, and the 4-bit group size."""
    method = quantization or (checkpoint.method if checkpoint is not None else None)
    return method, getattr(checkpoint, "group_size", 128)


def run_throughput(args, argv: list[str]) -> dict:
    from tokenmill.bench.roofline import Hardware, ModelCost, decode_floor_ms_per_token, roofline_floor
    from tokenmill.config import ModelConfig

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    model_path = _materialise(args)
    hf_config = _hf_config(model_path)
    requests = build_requests(args, hf_config, model_path)
    if args.subset is not None:
        requests = requests[:args.subset]
    if not requests:
        raise SystemExit("the request set is empty")

    model_config = ModelConfig.from_hf(hf_config)
    dtype_bytes = 4 if args.dtype in ("float32", "fp32", "float") else 2
    weights, group = _weight_format(args.quantization, model_config.quantization)
    cost = ModelCost.from_model_config(model_config, dtype_bytes, weights, args.kv_cache_dtype, group)
    hw = Hardware(args.memory_bandwidth, args.matmul_flops)
    floor = roofline_floor([r.prompt_len for r in requests], [r.output_len for r in requests], cost,
                           args.max_num_seqs, args.max_num_batched_tokens, hw)

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = args.model.replace("preset:", "").rstrip("/").split("/")[-1]
    name = args.name or f"throughput-{slug}-{stamp}"
    os.makedirs(args.output_dir, exist_ok=True)
    requests_file = os.path.join(args.output_dir, f"{name}.requests.json")
    save_requests(requests, requests_file)

    results = []
    for backend in backends:
        print(f"== {backend}: {len(requests)} requests", file=sys.stderr, flush=True)
        if args.in_process:
            from tokenmill.bench.throughput import run_backend
            result = run_backend(backend, args, model_path, requests)
        else:
            result = _run_child(args, argv, backend, model_path, requests_file,
                                os.path.join(args.output_dir, f"{name}.{backend}.json"))
        if "elapsed_s" in result:
            result["floor_s"] = floor.seconds
            result["measured_over_floor"] = result["elapsed_s"] / floor.seconds
            result["fraction_of_floor"] = floor.seconds / result["elapsed_s"]
            if len(requests) == 1:
                r = requests[0]
                result["floor_ms_per_output_token"] = decode_floor_ms_per_token(
                    cost, r.prompt_len + r.output_len // 2, hw)
        results.append(result)
    report.add_ratios(results)

    summary = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": next((r["hardware"] for r in results if "hardware" in r), None),
        "model": args.model,
        "model_path": model_path,
        "workload": {
            "dataset": args.dataset, "num_requests": len(requests), "seed": args.seed,
            # the ranges drawn from; a dataset file's requests keep their own lengths
            **({"input_len_range": args.input_len_range, "output_len_range": args.output_len_range}
               if args.dataset == "random" else {}),
            "subset": args.subset, "prompt_tokens": floor.total_tokens - floor.output_tokens,
            "output_tokens": floor.output_tokens,
        },
        "engine_args": {k: getattr(args, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "dtype", "block_size",
            "enforce_eager", "cuda_graph_max_tokens", "no_prefix_caching", "temperature", "top_p", "hf_batch_size", "hf_max_memory_percent")},
        "roofline": {"memory_bandwidth": hw.memory_bandwidth, "matmul_flops": hw.matmul_flops,
                     "weights": weights or args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                     "weight_bytes": cost.weight_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
                     "matmul_rate": cost.matmul_rate,
                     **floor.as_dict()},
        "results": results,
    }
    table = report.markdown_table(summary)
    print(table)
    with open(os.path.join(args.output_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.output_dir, f"{name}.md"), "w") as f:
        f.write(report.markdown_report(summary, table))
    print(f"results: {os.path.join(args.output_dir, name)}.{{json,md}}", file=sys.stderr)
    return summary


def _memory_workloads(args):
    from tokenmill.bench.memory import make_workloads

    return make_workloads((args.num_concurrent, parse_range(args.concurrent_len_range)),
                          (args.num_mixed, parse_range(args.mixed_len_range)), (args.num_long, args.long_len),
                          args.output_len, args.seed)


def run_memory(args, argv: list[str]) -> int:
    """`bench memory`: each model studied in a process of its own (its engines' GPU memory never mixes with
    another model's, and its KV-budget engine profiles a fresh device), or in this one with --in-process
    or --compute-only; one JSON, markdown and plot for all of them."""
    from tokenmill.bench.memory import study_model
    from tokenmill.bench.memory_report import concurrency_table, memory_table, write_outputs
    from tokenmill.models.presets import is_preset

    if args.replot:
        with open(args.replot) as f:
            summary = json.load(f)
        write_outputs(summary, args.output_dir, args.name or os.path.basename(args.replot).removesuffix(".json"))
        print(memory_table(summary) + "\n\n" + concurrency_table(summary))
        return 0
    workloads = _memory_workloads(args)
    if args.worker_result:
        result = study_model(args.worker_model, args.worker_model_path, workloads, args)
        with open(args.worker_result, "w") as f:
            json.dump(result, f)
        return 0
    models = [m.strip() for arg in (args.model or [",".join(MEMORY_MODELS)]) for m in arg.split(",") if m.strip()]
    name = args.name or f"memory-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for model in models:
        print(f"== {model}", file=sys.stderr, flush=True)
        if args.compute_only:
            results.append(study_model(model, None if is_preset(model) else model, workloads, args))
            continue
        path = _materialise(argparse.Namespace(**{**vars(args), "model": model}))
        if args.in_process:
            results.append(study_model(model, path, workloads, args))
            continue
        slug = model.replace("preset:", "").rstrip("/").split("/")[-1]
        result_file = os.path.join(args.output_dir, f"{name}.{slug}.json")
        cmd = [sys.executable, "-m", "tokenmill.bench", *argv, "--worker-model", model,
               "--worker-model-path", path, "--worker-result", result_file]
        proc = subprocess.run(cmd, env=_child_env())
        if proc.returncode != 0 or not os.path.isfile(result_file):
            results.append({"model": model, "error": f"exit status {proc.returncode}"})
            continue
        with open(result_file) as f:
            results.append(json.load(f))
    measured = [r["device_budget"]["hardware"] for r in results if "device_budget" in r]
    summary = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": measured[0] if measured else "none (computed, no engine run)",
        "settings": {k: getattr(args, k) for k in (
            "block_size", "max_model_len", "output_len", "seed", "dtype", "max_num_seqs",
            "max_num_batched_tokens", "gpu_memory_utilization", "gpu_gib", "overhead_gib", "compute_only")},
        "workloads": [{"name": w.name, "description": w.description, "lengths": list(w.lengths),
                       "output_len": w.output_len} for w in workloads],
        "models": results,
    }
    write_outputs(summary, args.output_dir, name)
    print(memory_table(summary) + "\n\n" + concurrency_table(summary))
    print(f"results: {os.path.join(args.output_dir, name)}.{{json,md,png}}", file=sys.stderr)
    return 1 if any("error" in r for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        argv = argv[1:]
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["throughput", *argv]
    args = parse_args(argv)
    if args.command == "prepare":
        from tokenmill.models.presets import resolve_model_path
        print(resolve_model_path(args.model, _preset_dtype(args.dtype), args.seed))
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
        return _run_worker(args)
    summary = run_throughput(args, argv)
    return 1 if any("error" in r for r in summary["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
