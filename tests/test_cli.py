"""The `tokenmill` command line and the server's logs: --version, defaults in --help, vLLM's spellings
(`serve --model`, `bench`'s --random-* flags), the separator of `generate`, the stats and request log
lines, and the start-up summary of a real `tokenmill serve`."""
import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

import tokenmill
from tokenmill import cli
from tokenmill.bench.cli import _build_parsers, parse_args, vllm_range
from tokenmill.cli.generate import GENERATE_SEPARATOR
from tokenmill.cli.server_args import chat_options, http_options
from tokenmill.cli.vllm_compat import vllm_spellings
from tokenmill.bench.datasets import parse_range, random_requests
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import stats_log
from tokenmill.tiny import bundled_model_path


# ---- --version and --help ---------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"tokenmill {importlib.metadata.version('tokenmill')}\n"


def _shown_defaults(parser: argparse.ArgumentParser) -> tuple[int, str]:
    """(options whose default --help must show, the help text with its whitespace normalised)."""
    wanted = [a for a in parser._actions
              if a.option_strings and a.help is not argparse.SUPPRESS and a.default is not argparse.SUPPRESS
              and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
    return len(wanted), " ".join(parser.format_help().split())


def test_every_help_shows_the_defaults():
    _, subs = cli.build_parser()
    _, bench_subs = _build_parsers()
    parsers = {**subs, **{f"bench {k}": v for k, v in bench_subs.items()}}
    for name, parser in parsers.items():
        wanted, text = _shown_defaults(parser)
        assert text.count("default") >= wanted, name
    _, serve = _shown_defaults(subs["serve"])
    assert "--port PORT 0 picks a free port (default: 8000)" in serve
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 256)" in serve
    assert "--enable-prefix-caching, --no-enable-prefix-caching reuse the KV blocks of equal prompt " \
           "prefixes (default: True)" in serve
    generate = _shown_defaults(subs["generate"])[1]
    assert "--max-tokens MAX_TOKENS most tokens generated per prompt (default: 64)" in generate
    assert "--port PORT (default: 8001)" in _shown_defaults(subs["ui"])[1]      # an option without a help text
    assert "--num-prompts NUM_PROMPTS (default: 256)" in _shown_defaults(bench_subs["throughput"])[1]
    assert "--input-len-range INPUT_LEN_RANGE random: inclusive prompt lengths 'LO,HI' or 'N' (default: " \
           "100,1024)" in _shown_defaults(bench_subs["serve"])[1]



# ---- the docs' flags against the parsers --------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DOCS = ["README.md", *(os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if f.endswith(".md"))]


def _doc(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every `tokenmill` command's parser by its words: serve, generate, ui, bench throughput, ..."""
    _, subs = cli.build_parser()
    bench, _ = _build_parsers()
    bench_subs = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {**{k: v for k, v in subs.items() if k != "bench"}, **{f"bench {k}": v for k, v in bench_subs.items()}}


def _documented_default(cell: str, n: int) -> list[str | None]:
    """The default column of a flag table's row, one plain value per flag of the row (None where the cell
    says it in words: "the model's", "$VLLM_API_KEY, else none")."""
    parts = [cell] if n == 1 else cell.split(", ")
    if len(parts) != n:
        return [None] * n
    values = []
    for part in parts:
        m = re.fullmatch(r"`?([^`\s']+)`?(?: s| \(.*\))?", part.strip())
        values.append(m.group(1) if m else None)
    return values


def _matches(value: str, default) -> bool:
    if value in ("off", "none"):
        return default in (None, False, "", [])
    if value == "on":
        return default is True
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(value) == default
    if isinstance(default, list):
        return [value] == default
    return value == default


def test_the_flag_tables_name_real_flags_with_their_defaults():
    """Each row of README.md's, docs/SERVER.md's and docs/UI.md's flag tables names options of its command,
    with the default that --help shows where the table gives a plain value."""
    parsers = _all_parsers()
    checked = 0
    for path, command in [("README.md", "serve"), ("docs/SERVER.md", "serve"), ("docs/UI.md", "ui")]:
        actions = parsers[command]._option_string_actions
        for line in _doc(path).splitlines():
            if not line.startswith("| `-"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            flags = re.findall(r"`(-[-\w]+)", cells[0])
            for flag, value in zip(flags, _documented_default(cells[1], len(flags))):
                assert flag in actions, f"{path}: {flag} is no option of tokenmill {command}"
                if value is not None:
                    assert _matches(value, actions[flag].default), \
                        f"{path}: {flag} defaults to {actions[flag].default!r}, the table says {cells[1]!r}"
                    checked += 1
    assert checked >= 40


def test_every_option_of_serve_generate_and_ui_is_in_the_docs():
    """An option --help shows is named in README.md or docs/*.md (BENCHMARKS.md's measurements aside)."""
    text = "".join(_doc(p) for p in USER_DOCS if not p.endswith("BENCHMARKS.md"))
    parsers = _all_parsers()
    missing = [f"{command} {flag}" for command in ("serve", "generate", "ui")
               for action in parsers[command]._actions if action.help is not argparse.SUPPRESS
               for flag in action.option_strings
               if flag.startswith("--") and flag != "--help" and not flag.startswith("--no-")
               and not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert not missing, missing


def test_the_docs_command_lines_use_options_their_command_has():
    """`tokenmill serve ...`, `tokenmill bench serve ...`, `python -m tokenmill.bench throughput ...` written
    in README.md and docs/*.md (BENCHMARKS.md's Reproduce commands included) take only options their
    command has. A command's words run to the end of its line (or its backslash-continued lines) or its
    code span, a shell operator or a comment."""
    parsers = _all_parsers()
    command = re.compile(r"(?:tokenmill|python -m tokenmill\.bench) (serve|generate|ui|bench \w+|\w+)\b"
                         r"((?:\\\n|[^`\n])*)")
    seen = 0
    for path in USER_DOCS:
        text = re.sub(r"\$\([^)]*\)", "X", _doc(path))          # `$(python -c ...)` is a value
        for m in command.finditer(text):
            name = m.group(1) if "tokenmill.bench" not in m.group(0) else f"bench {m.group(1)}"
            if name not in parsers:
                continue
            words = re.split(r"\s(?:&&|\|\|?|;|#|&|>)", m.group(2).replace("\\\n", " "))[0]
            for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", words):
                assert flag.split("=")[0] in parsers[name]._option_string_actions, \
                    f"{path}: `tokenmill {name}` has no option {flag}: {m.group(0)[:120]!r}"
            seen += 1
    assert seen >= 30

def test_the_metrics_docs_name_what_metrics_exports():
    """Every metric a scrape exports is in docs/MONITORING.md's table and docs/SERVER.md's Metrics section,
    with every label value of its reasons; every `tokenmill:` or `vllm:` name the user docs give is exported
    (the GPU gauges where pynvml is importable)."""
    from prometheus_client import generate_latest
    from tokenmill.engine import metrics
    stats = {key: 0 for key in metrics._STATS}
    stats["iteration_tokens"] = [1] * (len(metrics.ITERATION_TOKENS_BUCKETS) + 1)
    page = generate_latest(metrics.ServerMetrics("m", lambda: stats).registry).decode()
    exported = {name for name in re.findall(r"^# TYPE (\S+) ", page, re.M) if not name.endswith("_created")}
    assert len(exported) >= 35, exported
    server = _doc("docs/SERVER.md")      # its Metrics section names the swap metrics of "Preemption"
    for name, text in (("docs/MONITORING.md", _doc("docs/MONITORING.md")),
                       ("docs/SERVER.md", server.split("\n## Preemption", 1)[1].split("\n## ", 1)[0]
                        + server.split("\n## Metrics", 1)[1].split("\n## ", 1)[0])):
        missing = [m for m in sorted(exported) if not re.search(re.escape(m) + r"(?![\w:])", text)]
        assert not missing, f"{name} does not name {missing}"
        rejected = text.split("request_rejected_total{reason}", 1)[1].split("tokenmill:", 1)[0]
        for reason in metrics.REJECT_REASONS:
            assert f"`{reason}`" in rejected, f"{name}: request_rejected_total's reasons lack {reason}"
    gpu = {"tokenmill:gpu_memory_used_bytes", "tokenmill:gpu_memory_total_bytes", "tokenmill:gpu_utilization_perc"}
    named = {m for p in USER_DOCS if not p.endswith("BENCHMARKS.md")
             for m in re.findall(r"(?<![\w:])((?:tokenmill|vllm):[a-z_]+[a-z])", _doc(p))}
    assert not named - exported - gpu, sorted(named - exported - gpu)


# ---- serve --model, the log flags, generate's separator -----------------------------------------------
@pytest.fixture
def served(monkeypatch):
    """Runs `tokenmill serve ...` up to `run_server`, returning its config and keyword arguments."""
    calls = []
    import tokenmill.server.launch as launch
    monkeypatch.setattr(launch, "run_server", lambda config, **kw: calls.append((config, kw)) or 0)

    def serve(*argv):
        assert cli.main(["serve", *argv]) == 0
        return calls[-1]
    return serve


def test_serve_takes_the_model_as_vllm_does(served, capsys, tmp_path):
    model = str(tmp_path)
    assert served("--model", model)[0].model == model
    assert served(model)[0].model == model
    config, kw = served(model, "--model", model)
    assert config.model == model and kw["served_model_names"] is None       # not the bundled model's name
    with pytest.raises(SystemExit) as e:
        served(model, "--model", model + "/other")
    assert e.value.code == 2 and "the model is given twice and differently" in capsys.readouterr().err


def test_serve_log_flags_reach_the_server(served, tmp_path):
    kw = served(str(tmp_path))[1]
    assert kw["log_stats"] is True and kw["log_requests"] is False and kw["log_stats_interval"] == 10.0
    kw = served(str(tmp_path), "--disable-log-stats", "--enable-log-requests", "--log-stats-interval", "2")[1]
    assert kw["log_stats"] is False and kw["log_requests"] is True and kw["log_stats_interval"] == 2.0


def test_serve_accepts_vllm_flags_whose_effect_it_always_has(served, capsys, tmp_path):
    """Flags of a vLLM launch line that ask for what tokenmill always does, or give the value of the one way
    it has: accepted with a note (they were "unrecognized arguments")."""
    served(str(tmp_path), "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--response-role",
           "assistant", "--chat-template-content-format", "string", "--pipeline_parallel_size", "1",
           "--quantization", "gptq_marlin", "--tokenizer-mode", "auto", "--load-format", "safetensors",
           "--cpu-offload-gb", "0.0", "--max-log-len", "100", "--max_seq_len_to_capture=8192",
           "--disable-custom-all-reduce")
    err = capsys.readouterr().err
    assert "INFO tokenmill: --quantization gptq_marlin (vLLM's Marlin kernel for gptq checkpoints) is gptq here" in err
    for flag in ("--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--response-role",
                 "--chat-template-content-format", "--pipeline-parallel-size", "--tokenizer-mode", "--load-format",
                 "--cpu-offload-gb", "--max-log-len", "--max-seq-len-to-capture", "--disable-custom-all-reduce"):
        assert f"INFO tokenmill: {flag} (vLLM's) needs nothing here" in err, err


def test_serve_takes_several_api_keys_and_never_a_model_for_one(served, capsys, tmp_path):
    """vLLM's --api-key K1 K2 (nargs="+"): K2 was "unrecognized arguments", or the model. A model written after
    the keys (which nargs="+" takes as one of them) is the model where it names a file or directory, as
    `--api-key K MODEL` was before; a word there that is no model here, or a key naming a path, is refused."""
    model = str(tmp_path)
    for argv in ((model, "--api-key", "k1", "k2"), ("--api-key", "k1", "k2", model),
                 ("--api-key", "k1", "k2", model, "--port", "1"), ("--api-key", "k0", model, "--api-key", "k1", "k2"),
                 ("--model", model, "--api-key", "k1", "k2")):
        config, kw = served(*argv)
        assert config.model == model and kw["api_key"] == ["k1", "k2"], argv
    config, kw = served("--api-key", "k1", model)
    assert config.model == model and kw["api_key"] == ["k1"]
    for argv, message in ((("--api-key", "k1", "k2"), "--api-key took 'k1', 'k2' and no model was given: if 'k2' "
                                                        "is the model, it is no file or directory here"),
                          (("--api-key", "k1", "org/model", "--port", "1"), "if 'org/model' is the model"),
                          ((model, "--api-key", "k1", model), f"--api-key {model!r} names a file or directory"),
                          (("--api-key", model), f"--api-key {model!r} names a file or directory")):
        with pytest.raises(SystemExit) as e:
            served(*argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, (argv, err)


def test_serve_reads_vllms_config_file_under_the_command_line(served, capsys, tmp_path):
    """vLLM's --config FILE (YAML: option names as keys, either spelling) was "unrecognized arguments"."""
    model = str(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {model}\nport: 8123\nmax_num_seqs: 7\nenable-prefix-caching: false\n"
                      "served-model-name: [a, b]\noverride-generation-config: {temperature: 0.5}\n"
                      "max-model-len: 1K\nenforce_eager: true\nswap-space: null\n")
    engine, kw = served("--config", str(config), "--max-num-seqs", "9")
    assert (engine.model, engine.max_num_seqs, engine.enable_prefix_caching, engine.max_model_len,
            engine.enforce_eager, engine.swap_space) == (model, 9, False, 1024, True, 4.0)
    assert kw["port"] == 8123 and kw["served_model_names"] == ["a", "b"]
    assert kw["sampling_defaults"] == {"temperature": 0.5}
    other = tmp_path / "other"
    assert served(str(other), f"--config={config}")[0].model == str(other)     # the command line's model wins
    # the words either side of --config FILE stay apart: MODEL is no served name
    engine, kw = served("--served-model-name", "a", "--config", str(config), str(other))
    assert engine.model == str(other) and kw["served_model_names"] == ["a"]
    for text, message in (("bogus-flag: 1\n", "unrecognized options: --bogus-flag"),
                          ("[1, 2]\n", "must hold a mapping of option names to values, got a list"),
                          ("enable-chunked-prefill: false\n", "--no-enable-chunked-prefill is vLLM's"),
                          ("trust-remote-code: 'yes'\n", "'yes' follows no option that takes a value"),
                          ("port: [\n", "is not YAML")):
        config.write_text(text)
        with pytest.raises(SystemExit) as e:
            served(model, "--config", str(config))
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    with pytest.raises(SystemExit):
        served(model, "--config", str(tmp_path / "missing.yaml"))
    assert "missing.yaml': No such file or directory" in capsys.readouterr().err
    config.write_bytes("port: 1\n# caf\u00e9\n".encode("latin-1"))       # a traceback before
    with pytest.raises(SystemExit):
        served(model, "--config", str(config))
    assert "is not UTF-8 text (invalid continuation byte at byte 13)" in capsys.readouterr().err


def test_generate_separates_the_outputs_of_several_prompts(monkeypatch, capsys):
    class FakeLLM:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params):
            return [SimpleNamespace(outputs=[SimpleNamespace(text=f"out of {p}\nsecond line")]) for p in prompts]

    monkeypatch.setattr(tokenmill, "LLM", FakeLLM)
    model = bundled_model_path()
    assert cli.main(["generate", model, "--prompt", "a", "--prompt", "b"]) == 0
    sep = GENERATE_SEPARATOR
    assert capsys.readouterr().out == f"out of a\nsecond line\n{sep}\nout of b\nsecond line\n"
    assert cli.main(["generate", model, "--prompt", "a"]) == 0
    assert sep not in capsys.readouterr().out


# ---- bench: vLLM's flag names -------------------------------------------------------------------------
def test_vllm_random_lengths():
    assert vllm_range(1000, 0.5) == "500,1500" and vllm_range(128, 0.0) == "128,128"
    assert vllm_range(3, 0.9) == "1,6"            # floor(0.3) is 0: at least 1; ceil(5.7) is 6
    lo, hi = parse_range(vllm_range(100, 0.25))
    reqs = random_requests(200, (lo, hi), (1, 2), vocab_size=1000, seed=0)
    assert {r.prompt_len for r in reqs} <= set(range(75, 126)) and len({r.prompt_len for r in reqs}) > 20


def test_bench_serve_accepts_a_vllm_command():
    args = parse_args(["serve", "--backend", "vllm", "--model", "m", "--dataset-name", "random",
                       "--random-input-len", "1000", "--random-output-len", "100", "--random-range-ratio", "0.5",
                       "--num-prompts", "10", "--max-concurrency", "4", "--save-result", "--result-dir", "/r",
                       "--result-filename", "run1.json", "--port", "8123"])
    assert (args.input_len_range, args.output_len_range) == ("500,1500", "50,150")
    assert (args.dataset, args.output_dir, args.name) == ("random", "/r", "run1")
    assert (args.base_url, args.endpoint) == ("http://127.0.0.1:8123", "/v1/completions")
    args = parse_args(["serve", "--random-input-len", "64"])      # vLLM's default output length and ratio
    assert (args.input_len_range, args.output_len_range) == ("64,64", "128,128")
    # and vLLM's default backend: completions (chat sent the random words through the chat template)
    assert parse_args(["serve", "--dataset-name", "random"]).endpoint == "/v1/completions"
    args = parse_args(["serve", "--backend", "openai-chat", "--base-url", "http://h:1"])
    assert (args.base_url, args.endpoint) == ("http://h:1", "/v1/chat/completions")
    args = parse_args(["serve"])                                   # our own defaults, untouched
    assert (args.input_len_range, args.output_len_range, args.dataset) == ("100,1024", "100,300", "mixed-chat")
    assert args.endpoint == "/v1/chat/completions"


def test_bench_throughput_accepts_vllm_flags(tmp_path):
    args = parse_args(["throughput", "--model", "m", "--random-input-len", "200", "--random-output-len", "20",
                       "--random-range-ratio", "0.1", "--result-dir", "/r", "--save-result"])
    assert (args.input_len_range, args.output_len_range, args.output_dir) == ("180,220", "18,22", "/r")
    (tmp_path / "sg.json").write_text("[]")
    args = parse_args(["throughput", "--model", "m", "--dataset-name", "sharegpt", "--dataset-path",
                       str(tmp_path / "sg.json")])
    assert args.dataset == str(tmp_path / "sg.json") and args.input_len_range == "100,1024"


@pytest.mark.parametrize("argv, message", [
    (["--random-input-len", "8", "--input-len-range", "1,9"], "not both"),
    (["--random-range-ratio", "1.0"], "must be in [0, 1)"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "random", "--dataset", "x.json"], "--dataset or --dataset-name"),
])
def test_bench_refuses_contradicting_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["throughput", "--model", "m", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, messages", [
    (["--api-server-count", "0"], ["--api-server-count: must be at least 1", "got 0"]),
    (["--api-server-count", "-2"], ["--api-server-count: must be at least 1", "got -2"]),
    (["--data-parallel-size", "0"], ["--data-parallel-size/-dp: must be at least 1", "got 0"]),
    (["--data-parallel-size", "-1"], ["--data-parallel-size/-dp: must be at least 1", "got -1"]),
    (["--api-server-count", "2", "--engine-in-process"], ["--engine-in-process"]),
    (["-dp", "2", "--api-server-count", "2"], ["not supported together yet"]),
])
def test_serve_refuses_bad_process_counts_naming_them(argv, messages, capsys):
    """--api-server-count and --data-parallel-size (one argparse type, `cli.arg_types.at_least_one`) and the
    combinations of them that serve cannot run."""
    from tokenmill import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(m in err for m in messages)


def test_run_server_refuses_a_stream_interval_below_one():
    """The Python entry point checks what the CLI's type checks, before it binds or starts anything."""
    from tokenmill.server.launch import run_server
    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        run_server(None, stream_interval=0)


@pytest.mark.parametrize("command, argv, message", [
    ("serve", ["--max-model-len", "0"], "--max-model-len: must be at least 1 (a token of context), got 0"),
    ("serve", ["--max-model-len", "1.5K"], "'1.5K' (a binary suffix, K, takes a whole number)"),
    ("serve", ["--max-model-len", "4x"], "'4x' (an integer, or one with a suffix: 32k, 32K)"),
    ("serve", ["--max-queue-len", "0"], "--max-queue-len: must be at least 1"),
    ("serve", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be at least 1 (a token a step), got 0"),
    ("serve", ["--max-num-batched-tokens", "8q"], "'8q' (an integer, or one with a suffix: 32k, 32K)"),
    ("serve", ["--stream-interval", "0"], "--stream-interval: must be at least 1 (a token a chunk), got 0"),
    ("serve", ["--backend", "hf", "--stream-interval", "4"], "--stream-interval 4 needs --backend tokenmill"),
    ("serve", ["--port", "70000"], "--port: must be in [0, 65535]"),
    ("serve", ["--block-size", "0"], "block_size must be >= 1, got 0"),
    ("serve", ["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1], got 2.0"),
    ("serve", ["--chat-template", "/nonexistent.jinja"], "--chat-template '/nonexistent.jinja': no such file"),
    ("serve", ["--root-path", "llm"], "root_path must start with '/' and not end with one, got 'llm'"),
    ("serve", ["--root-path", "/llm/"], "root_path must start with '/'"),
    ("serve", ["--backend", "hf", "--root-path", "/llm"], "--root-path needs --backend tokenmill"),
    ("serve", ["--backend", "hf", "--hf-overrides", "{}"], "--hf-overrides needs --backend tokenmill"),
    ("serve", ["--backend", "hf-cb", "--api-key", "k"], "--api-key (or $VLLM_API_KEY) needs --backend tokenmill"),
    ("serve", ["--backend", "hf", "--enable-request-id-headers"], "--enable-request-id-headers needs --backend tokenmill"),
    ("serve", ["--backend", "hf", "--enable-tokenizer-info-endpoint"],
     "--enable-tokenizer-info-endpoint needs --backend tokenmill"),
    ("serve", ["--backend", "hf", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"],
     "--ssl-certfile (HTTPS) needs --backend tokenmill"),
    ("generate", ["--max-num-seqs", "0", "--prompt", "hi"], "max_num_seqs must be >= 1, got 0"),
    ("serve", ["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    ("serve", ["--tool-call-parser", "llama4_pythonic"],
     "unknown --tool-call-parser 'llama4_pythonic'; known: granite, hermes, llama3_json, phi4_mini_json, pythonic"),
    ("serve", ["--reasoning-parser", "bogus"], "unknown --reasoning-parser 'bogus'"),
    ("serve", ["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ("serve", ["--allowed-origins", '["http://a.example"'], "argument --allowed-origins: not a JSON list"),
    ("serve", ["--hf-overrides", "{rope_scaling: 1}"], "argument --hf-overrides: not JSON (Expecting property name"),
    ("serve", ["--hf-overrides", '["rope_scaling"]'], "argument --hf-overrides: expected a JSON object (such as "
                                                      "'{\"rope_scaling\": {...}}'), got a JSON list"),
    ("serve", ["--revision", "main"], "--revision is vLLM's and has no effect here: tokenmill loads local"),
    ("serve", ["--max_logprobs", "40"], "--max-logprobs is vLLM's and has no effect here: the logprobs limit"),
    # vLLM flags that were "unrecognized arguments", with no reason given
    ("serve", ["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is vLLM's and has no effect here: "
                                               "chunked prefill is always on"),
    ("serve", ["--lora-modules", "a=/x", "b=/y"], "--lora-modules is vLLM's and has no effect here: tokenmill "
                                                  "serves no LoRA adapters"),
    ("serve", ["--enable-lora"], "--enable-lora is vLLM's and has no effect here"),
    ("serve", ["--middleware", "m.auth"], "--middleware is vLLM's and has no effect here"),
    ("serve", ["--chat-template-content-format", "openai"], "--chat-template-content-format 'openai' is not "
                                                            "supported: a message's content reaches the chat template"),
    ("serve", ["--response-role", "bot"], "--response-role 'bot' is not supported: a chat reply's role is always "
                                          "assistant (accepted: assistant)"),
    ("serve", ["-pp", "2"], "--pipeline-parallel-size '2' is not supported: tokenmill has no pipeline parallelism"),
    ("serve", ["--tokenizer-mode", "mistral"], "--tokenizer-mode 'mistral' is not supported: the tokenizer loads as "
                                               "transformers' AutoTokenizer"),
    ("serve", ["--load-format", "pt"], "--load-format 'pt' is not supported: tokenmill reads a model directory's "
                                       "safetensors or a .gguf file"),
    ("serve", ["--load-format", "gguf"], "--load-format gguf does not match the model"),
    ("serve", ["--cpu-offload-gb", "4"], "--cpu-offload-gb '4' is not supported: every weight stays in the device's"),
    ("serve", ["--max-log-len", "1e3"], "argument --max-log-len: invalid int value: '1e3'"),
    ("serve", ["--enable-log-outputs"], "--enable-log-outputs is vLLM's and has no effect here: the request log"),
    ("serve", ["--speculative-config", '{"method": "ngram"}'], "--speculative-config is vLLM's and has no effect "
                                                               "here: tokenmill has no speculative decoding"),
    ("serve", ["-O3"], "--compilation-config (-O) is vLLM's and has no effect here: tokenmill compiles nothing"),
    # nan passed `<= 0`: the server came up and every connection hung (header timeout) or got 400 (body)
    ("serve", ["--header-timeout", "nan"], "header_timeout must be positive, got nan"),
    ("serve", ["--log-stats-interval", "0"], "--log-stats-interval: must be a positive, finite number"),
    ("serve", ["--tokenizer", "/nonexistent"], "tokenizer '/nonexistent' holds no tokenizer"),
    ("serve", ["--chat-template", "{% for m in messages %}{{ m.content }"], "--chat-template cannot be compiled"),
    ("serve", ["--chat-template", os.path.join(os.path.dirname(__file__), "data", "latin-1.jinja")],
     "latin-1.jinja' is not UTF-8 text"),
    ("serve", ["--api-key", " "], "the API key is empty"),
    ("serve", ["--api-key", "k1", ""], "the API key is empty"),
    ("serve", ["--quantization", "marlin"], "argument --quantization: invalid choice: 'marlin' (choose from 'awq', "
                                            "'gptq', 'fp8', 'awq_marlin', 'gptq_marlin')"),
    ("serve", ["--served-model-name", "a", "a"], "--served-model-name takes distinct, non-empty names"),
    ("serve", ["--seed", str(2 ** 70)], "seed must be a 64-bit integer"),
    ("serve", ["--swap-space", "1e6"], "swap_space 1e+06 GiB is more than 70% of this machine's"),
    # each core pins its own: the bound is the cores' together
    ("serve", ["--swap-space", str(0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30),
               "--data-parallel-size", "2"], "cores is"),
    # torch took these, and the engine core failed on them after the model began to load
    ("serve", ["--device", "mps"], "device 'mps' is not a device tokenmill runs on: auto, cpu, cuda or cuda:N"),
    ("serve", ["--device", "meta"], "device 'meta' is not a device tokenmill runs on"),
    # --backend was among generate's options and ignored there: `generate --backend hf` ran tokenmill
    ("generate", ["--backend", "hf"], "unrecognized arguments: --backend hf"),
])
def test_bad_engine_options_are_usage_errors(command, argv, message, capsys):
    """Options the engine's config refuses, and files that do not exist, end the command with a usage error
    naming them before anything loads (they were Python tracebacks, or a server whose every request got
    503 for --max-queue-len 0)."""
    from tokenmill import cli
    with pytest.raises(SystemExit) as e:
        cli.main([command, bundled_model_path(), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err


def test_vllm_spellings_of_cors_lists_and_the_api_key(monkeypatch):
    """vLLM's forms: CORS lists as JSON ('["https://a.example"]', mixed with words here), and the key from
    $VLLM_API_KEY, which a deployment moved from vLLM may set instead of --api-key (it ran open before)."""
    from tokenmill import cli
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    parser, _ = cli.build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                              "https://c.example", "--allowed-methods", '["GET","POST"]'])
    http = http_options(args)
    assert http.allowed_origins == ("https://a.example", "https://b.example", "https://c.example")
    assert http.allowed_methods == ("GET", "POST") and args.api_key == ["from-env"]
    assert parser.parse_args(["serve", "--api-key", "flag"]).api_key == ["flag"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert cli.build_parser()[0].parse_args(["serve"]).api_key is None
    # vLLM's launch line: options with underscores, flags whose effect is always on, its log-level name
    args = parser.parse_args(vllm_spellings([
        "serve", "--max_model_len=64", "--trust-remote-code", "/models/m", "--enable-chunked-prefill",
        "--disable-log-requests", "--uvicorn-log-level", "warning", "--max_num_seqs", "8"]))
    assert (args.model, args.max_model_len, args.max_num_seqs, args.log_level) == ("/models/m", 64, 8, "warning")
    # vLLM's human-readable context lengths
    assert [parser.parse_args(["serve", "--max-model-len", v]).max_model_len for v in ("32k", "32K", "25.6k", "1M")] \
        == [32_000, 32_768, 25_600, 1_048_576]
    assert [parser.parse_args(["serve", "--max-num-batched-tokens", v]).max_num_batched_tokens
            for v in ("16k", "16K", "2048")] == [16_000, 16_384, 2048]
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_options(parser.parse_args(["serve", "--chat-template", inline])).chat_template == inline
    # vLLM's --return-tokens-as-token-ids: the server's default, which a request's own field overrides
    from tokenmill.server.serving import Serving
    server = SimpleNamespace(return_tokens_as_token_ids=chat_options(
        parser.parse_args(["serve", "--return-tokens-as-token-ids"])).return_tokens_as_token_ids)
    assert [Serving.tokens_as_ids(server, SimpleNamespace(return_tokens_as_token_ids=v)) for v in (None, False, True)] \
        == [True, False, True]
    assert not chat_options(parser.parse_args(["serve"])).return_tokens_as_token_ids


# ---- the stats line -----------------------------------------------------------------------------------
def _stats(prompt=0, generation=0, running=0, waiting=0, usage=0.0, queries=0, hits=0):
    return {"prompt_tokens": prompt, "generation_tokens": generation, "num_running": running,
            "num_waiting": waiting, "kv_cache_usage": usage, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "num_preemptions": 0}


class FakeStats:
    def __init__(self, samples):
        self.samples = list(samples)
        self.calls = 0

    async def get_stats(self, max_age: float = 0.0):
        self.calls += 1
        return self.samples.pop(0) if len(self.samples) > 1 else self.samples[0]


def test_stats_line_has_the_interval_numbers(caplog):
    fake = FakeStats([_stats(100, 10, queries=50, hits=0), _stats(600, 210, 3, 2, 0.25, 150, 75), _stats(600, 210),
                      _stats(600, 210)])
    logger = stats_log.StatsLogger(fake.get_stats, interval=10.0)

    async def run():
        return [await logger.log_once(now=t) for t in (0.0, 10.0, 20.0, 30.0)]

    with caplog.at_level(logging.INFO, logger="tokenmill.stats"):
        lines = asyncio.run(run())
    assert lines[0] is None                   # the first sample only starts the interval
    assert lines[1] == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%")
    assert lines[2].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                               "Running: 0 reqs")          # once more: the burst is over
    assert lines[3] is None                   # idle again: silent
    assert [r.getMessage() for r in caplog.records] == lines[1:3]
    # requests swapped out, and nothing else: the engine is busy, and the line says how many wait in host memory
    swapped = FakeStats([_stats(600, 210), {**_stats(600, 210), "num_swapped": 2}])
    logger = stats_log.StatsLogger(swapped.get_stats, interval=10.0)
    line = asyncio.run(logger.log_once(now=0.0)) or asyncio.run(logger.log_once(now=10.0))
    assert line is not None and line.endswith("Prefix cache hit rate: 0.0%, Swapped: 2 reqs")


def test_stats_logger_is_silent_when_idle_and_off_when_disabled(caplog):
    async def serve():
        await asyncio.sleep(0.3)
        return "served"

    idle = FakeStats([_stats(5, 5)])
    busy = FakeStats([_stats(0, 0), _stats(10, 10, running=1)])
    off = FakeStats([_stats(0, 0), _stats(10, 10, running=1)])
    with caplog.at_level(logging.INFO, logger="tokenmill.stats"):
        assert asyncio.run(stats_log.serve_with_stats(serve(), SimpleNamespace(get_stats=idle.get_stats),
                                                      interval=0.02)) == "served"
        assert idle.calls > 3 and not caplog.records
        asyncio.run(stats_log.serve_with_stats(serve(), SimpleNamespace(get_stats=off.get_stats), enabled=False,
                                               interval=0.02))
        assert off.calls == 0 and not caplog.records
        asyncio.run(stats_log.serve_with_stats(serve(), SimpleNamespace(get_stats=busy.get_stats), interval=0.02))
    assert caplog.records and all("Running: 1 reqs" in r.getMessage() for r in caplog.records)


# ---- the request lines --------------------------------------------------------------------------------
def _output(tokens: int, finish_reason=None):
    return SimpleNamespace(finished=finish_reason is not None,
                           outputs=[SimpleNamespace(token_ids=[7] * tokens, finish_reason=finish_reason)])


async def _outputs(n: int):
    for i in range(1, n + 1):
        yield _output(i, "length" if i == n else None)


def test_request_lines_only_when_enabled(caplog):
    params = SamplingParams(temperature=0.0, max_tokens=3, seed=5)

    async def consume(gen, stop_after=None):
        outs = []
        async for out in gen:
            outs.append(out)
            if len(outs) == stop_after:
                break
        await gen.aclose()
        return outs

    with caplog.at_level(logging.INFO, logger="tokenmill.requests"):
        try:
            stats_log.enable_request_logging(False)
            gen = _outputs(3)
            assert stats_log.log_request(gen, "r0", [1, 2], params) is gen and not caplog.records
            stats_log.enable_request_logging(True)
            assert len(asyncio.run(consume(stats_log.log_request(_outputs(3), "r1", [1, 2, 3], params)))) == 3
            asyncio.run(consume(stats_log.log_request(_outputs(3), "r2", [1], params), stop_after=1))
            # closed unread (the engine never had it): no line, rather than an arrival that never ends
            asyncio.run(stats_log.log_request(_outputs(3), "r3", [1], params).aclose())
        finally:
            stats_log.enable_request_logging(False)
    messages = [re.sub(r"\d+\.\d\d s", "T s", r.getMessage()) for r in caplog.records]
    assert messages == [
        "Received request r1: 3 prompt tokens, temperature=0.0, seed=5, max_tokens=3",
        "Finished request r1: 3 tokens, finish_reason=length, T s",
        "Received request r2: 1 prompt tokens, temperature=0.0, seed=5, max_tokens=3",
        "Aborted request r2 after 1 tokens, T s",
    ]


def test_a_request_line_shows_long_values_in_brief():
    """A request's stop strings and logit_bias may run to megabytes; its log line shows a few items and
    characters of each and counts the rest (the line is written on the event loop)."""
    params = SamplingParams(max_tokens=5, stop=["x" * 1_000_000, "y"], logit_bias={i: 1.0 for i in range(50_000)},
                            stop_token_ids=list(range(20)))
    line = stats_log.params_summary(params)
    assert len(line) < 700, len(line)
    assert "stop=['xxx" in line and "stop_token_ids=[0, 1, 2, 3, 4, 5, 6, 7, ... 12 more]" in line
    assert "logit_bias={0: 1.0," in line and "... 49992 more}" in line
    assert stats_log.params_summary(SamplingParams(max_tokens=3, stop=["a"])) == \
        "temperature=1.0, max_tokens=3, stop=['a']"
    # a cache salt is a tenant's secret: neither the log line nor the params' repr shows it
    salted = SamplingParams(max_tokens=3, cache_salt="s3cret")
    assert "s3cret" not in repr(salted) and stats_log.params_summary(salted).endswith("cache_salt=(hidden)")
    names = [f"p{i}" for i in range(2_000)]
    schema = {"type": "object", "properties": {n: {"enum": list(range(100))} for n in names}, "required": names}
    line = stats_log.params_summary(SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json=schema)))
    # the schema's deeper levels are elided, not formatted and then cut
    assert len(line) < 400 and "structured_outputs=StructuredOutputsParams(json={'properties': {'p0': {...}" in line


# ---- a real server ------------------------------------------------------------------------------------
def test_serve_logs_its_startup_stats_and_requests(tmp_path):
    """`tokenmill serve --log-level info` on the bundled model: the start-up summary from the engine core's
    process, then a request's lines and a stats line in the server's."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", bundled_model_path(), "--device", "cpu", "--port", "0",
           "--log-level", "info",
           "--max-model-len", "512", "--num-kv-blocks", "64", "--log-stats-interval", "0.5",
           "--enable-log-requests"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    started, port = threading.Event(), []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if re.search(r"serving .* on http://", line):
                port.append(re.search(r":(\d+) ", line).group(1))
                started.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(pattern: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((x for x in lines if re.search(pattern, x)), None)
            if hit is not None:
                return hit
            assert proc.poll() is None, "\n".join(lines)
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n" + "\n".join(lines))

    try:
        assert started.wait(90), "\n".join(lines)
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port[0]}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            usage = json.load(urllib.request.urlopen(req, timeout=60))["usage"]
        except OSError as e:
            raise AssertionError(f"{e!r}; the server printed:\n" + "\n".join(lines)) from None
        wait_for(r"INFO tokenmill\.stats: Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
                         r"throughput: [\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: "
                         r"[\d.]+%, Prefix cache hit rate: [\d.]+%")
        wait_for(rf"INFO tokenmill\.requests: Finished request cmpl-[\w-]+-0: {usage['completion_tokens']} tokens, "
                 r"finish_reason=\w+")
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
    text = "\n".join(lines)
    for pattern in (r"INFO tokenmill\.engine: model \S+: Qwen3ForCausalLM, dtype float32, device cpu, "
                    r"max_model_len 512",
                    r"INFO tokenmill\.engine: weights: [\d.]+ MiB \([\d.]+M parameters\), loaded in [\d.]+ s",
                    r"INFO tokenmill\.engine: KV cache: 64 blocks of 16 tokens in float32, [\d.]+ MiB, 1,024 tokens; "
                    r"maximum concurrency for 512 tokens per request: 2\.00x",
                    r"INFO tokenmill\.engine: CUDA graphs: off \(device cpu\)",
                    r"INFO tokenmill\.engine: engine ready in [\d.]+ s",
                    rf"INFO tokenmill\.requests: Received request cmpl-[\w-]+-0: {usage['prompt_tokens']} prompt "
                    r"tokens, "
                    r"temperature=0(\.0)?, max_tokens=8"):
        assert re.search(pattern, text), (pattern, text)


def test_generate_refuses_bad_sampling_before_loading_and_without_a_traceback(capsys, monkeypatch):
    """`generate --max-tokens 0` loaded the model first, then ended in a SamplingParamError traceback."""
    from tokenmill import LLM, cli
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    tiny = bundled_model_path()
    assert cli.main(["generate", tiny, "--max-tokens", "0", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "tokenmill: max_tokens must be" in err and "Traceback" not in err
    # vLLM's --uvicorn-log-level critical and trace, onto ours
    parser, _ = cli.build_parser()
    assert parser.parse_args(["serve", "--uvicorn-log-level", "critical"]).log_level == "error"


def test_the_serving_line_names_the_engines_pid_when_it_runs_in_process(capsys):
    """docs/SERVER.md's `(engine pid PID)`: with --engine-in-process the engine is a thread of the server's
    process, whose pid the line names (it printed `engine pid None`)."""
    from tokenmill.server.http_server import announce
    announce("m", "::1", 8000, None)
    announce("m", "127.0.0.1", 8000, 4242, "https")
    assert capsys.readouterr().out == (f"tokenmill: serving m on http://[::1]:8000 (engine pid {os.getpid()})\n"
                                       "tokenmill: serving m on https://127.0.0.1:8000 (engine pid 4242)\n")
