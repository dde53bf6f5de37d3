"""`--config FILE` (vLLM's): a YAML file of options, read under the command line's."""
from __future__ import annotations

import argparse
import json

from tokenmill.cli.vllm_compat import vllm_spellings


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
    except UnicodeDecodeError as e:
        parser.error(f"--config {path!r} is not UTF-8 text ({e.reason} at byte {e.start})")
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
