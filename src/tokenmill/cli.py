"""The `tokenmill` console script: `serve`, `generate`, `ui` and `bench`."""
from __future__ import annotations

import argparse
import sys

from tokenmill.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser):
    d = EngineConfig(model="")
    p.add_argument("--backend", default="tokenmill", choices=["tokenmill", "hf", "hf-cb"],
                   help="inference backend: tokenmill, or a transformers baseline for benchmarks (hf: one "
                        "generate() at a time; hf-cb: transformers' continuous batching)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    p.add_argument("--dtype", default=d.dtype, help="auto, float32, float16 or bfloat16")
    p.add_argument("--device", default=d.device, help="auto, cuda, cuda:N or cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV-cache blocks (default: sized from --gpu-memory-utilization)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=d.cuda_graph_max_tokens,
                   help="largest step with prefill tokens run as a CUDA graph (0: decode graphs only)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
        enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens)


def _serve(args) -> int:
    if args.backend in ("hf", "hf-cb"):
        from tokenmill.server.hf_backend import run_hf_server
        return run_hf_server(args)
    from tokenmill.server.launch import run_server
    return run_server(engine_config(args), host=args.host, port=args.port,
                      served_model_names=args.served_model_name, api_key=args.api_key,
                      max_queue_len=args.max_queue_len, log_level=args.log_level,
                      engine_factory=args.engine_factory, in_process=args.engine_in_process)


def _generate(args) -> int:
    from tokenmill import LLM
    from tokenmill.sampling_params import SamplingParams

    cfg = engine_config(args)
    llm = LLM(**{k: v for k, v in vars(cfg).items() if k != "extra"})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in prompts]
    for out in llm.generate(prompts, params):
        for c in out.outputs:
            print(c.text, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from tokenmill.bench.cli import main as bench_main
        return bench_main(argv[1:])

    parser = argparse.ArgumentParser(prog="tokenmill", description="PagedAttention LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="model directory (Hugging Face layout; default: the bundled tiny model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use for the model")
    serve.add_argument("--max-queue-len", type=int, default=1024,
                       help="answer 503 with Retry-After beyond this many waiting requests")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine loop in a thread of the server process (for debugging)")
    add_engine_args(serve)

    gen = sub.add_parser("generate", help="offline one-shot generation")
    gen.add_argument("model", nargs="?", default=None, help="model directory (default: the bundled tiny model)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)

    from tokenmill.ui.launch import add_ui_args
    ui = sub.add_parser("ui", help="Chainlit chat page for a running server (needs the `ui` extra)")
    add_ui_args(ui)

    sub.add_parser("bench", help="benchmarks (see `tokenmill bench --help`)")

    args = parser.parse_args(argv)
    if args.command in ("serve", "generate") and args.model is None:
        from tokenmill.tiny import BUNDLED_MODEL_NAME, bundled_model_path
        args.model = bundled_model_path()
        if args.command == "serve" and not args.served_model_name:
            args.served_model_name = [BUNDLED_MODEL_NAME]
    if args.command == "serve":
        return _serve(args)
    if args.command == "ui":
        from tokenmill.ui.launch import run_ui
        return run_ui(args)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
