"""`vllm bench`'s flag names, accepted by `bench throughput` and `bench serve` and mapped onto ours, so that a
vLLM user's command runs unchanged."""
from __future__ import annotations

import argparse
import math

from tokenmill.bench.serve_args import DEFAULT_ENDPOINT

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
