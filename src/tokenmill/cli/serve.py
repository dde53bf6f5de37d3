"""`tokenmill serve`: its --api-key words, the checks of its arguments before the model loads, and the
server's start (or a transformers baseline's)."""
from __future__ import annotations

import argparse
import os
import sys

from tokenmill.cli.engine_args import engine_config
from tokenmill.cli.server_args import chat_options, generation_defaults, http_options
from tokenmill.cli.vllm_compat import VLLM_FIXED, VLLM_HONOURED, VLLM_REFUSED, VLLM_SHORT, _vllm_dest
from tokenmill.config import swap_space_limit
from tokenmill.quant.formats import QUANTIZATION_ALIASES


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


def _fixed_value(value: str, values: tuple[str, ...]) -> bool:
    """`value` is one of `values`, numbers compared as numbers (--cpu-offload-gb 0.0 is 0)."""
    if value in values:
        return True
    try:
        return any(float(value) == float(v) for v in values)
    except ValueError:
        return False


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
    host, limit = swap_space_limit()
    if dp > 1 and args.swap_space * dp > limit:
        # each core pins its own swap space: the engine config's bound is one core's
        parser.error(f"--swap-space {args.swap_space:g} GiB for each of --data-parallel-size {dp} cores is "
                     f"{args.swap_space * dp:g} GiB, more than 70% of this machine's {host:.1f} GiB of memory "
                     f"({limit:.1f} GiB)")
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
