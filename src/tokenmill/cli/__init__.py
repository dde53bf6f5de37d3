"""The `tokenmill` console script: `serve`, `generate`, `ui` and `bench`.

One module a concern: `arg_types` (the options' argparse types), `engine_args` (the engine's options and the
`EngineConfig` built from them), `server_args` (the API server's HTTP and chat options), `vllm_compat`
(vLLM's flags and spellings), `config_file` (--config FILE), `serve` and `generate` (each command's checks
and run), `entry` (the parser and `main`); `ui` is `tokenmill.ui.launch`'s, `bench` `tokenmill.bench.cli`'s.
Here are re-exported the console script's `main` (pyproject.toml's entry point) and the names the tests
import from the package.
"""
from tokenmill.cli.engine_args import add_engine_args, engine_config
from tokenmill.cli.entry import build_parser, main

__all__ = ["add_engine_args", "build_parser", "engine_config", "main"]
