"""`bench serve`'s result files, in the shape of `vllm bench serve --save-result`'s, so that a script
written for vLLM's files reads ours.

A record is one concurrency level, as a vLLM result is one run: vLLM's keys at the top, with vLLM's
meanings and units (`date` as %Y%m%d-%H%M%S, `backend` the request format `openai` or `openai-chat`,
`label`, `model_id`, `duration` in seconds, throughputs per second, `mean_ttft_ms`, `p99_itl_ms`, ...;
with `--save-detailed` the per-request lists `input_lens`, `ttfts`, `itls`, ... in seconds), `--metadata`
pairs among them, then ours under names vLLM does not use (provenance, the per-level extras, the latency
samples in ms).

A file named by `--result-filename` (or `--name`) holds the run's records one per line, a level's line
written as the level ends: one level is one JSON object, as vLLM's file; a sweep is JSON lines, as vLLM's
`--append-result` leaves a file of several runs. Without a name, each level goes to a file of its own under
vLLM's default name, `{label}-{request_rate}qps-concurrency{N}-{model}-{date}.json`. `--append-result`
adds to a file's records instead of replacing them.
"""
from __future__ import annotations

import json
import os

# vLLM's run keys, in the order its file has them; `--metadata` pairs come after num_prompts
SETUP_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts")
TRAFFIC_KEYS = ("request_rate", "burstiness", "max_concurrency")
# vLLM's per-request lists, kept with --save-detailed; a failed request has 0 output and its error
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts", "errors")
# ours: the run's provenance and the level's extras
OWN_KEYS = ("seed", "distinct_errors", "ttfts_ms", "e2els_ms", "itls_ms", "goodput_slos_ms", "good_requests",
            "command", "git_commit", "hardware", "base_url", "endpoint", "dataset", "structured", "tools",
            "client_processes")
CLASS_SUFFIXES = ("_structured", "_plain", "_tools")


def parse_metadata(items: list[str] | None, metric_keys) -> dict[str, str]:
    """vLLM's `--metadata KEY=VALUE ...` -> {KEY: VALUE} (strings, as vLLM keeps them); a key the record
    has itself (`metric_keys`: the level's metrics') is refused, where vLLM would let one of the two overwrite
    the other."""
    own = {*SETUP_KEYS, *TRAFFIC_KEYS, *DETAILED_KEYS, *OWN_KEYS, *metric_keys}
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--metadata takes KEY=VALUE pairs, got {item!r}")
        if key in own or key.endswith(CLASS_SUFFIXES):
            raise ValueError(f"--metadata {item!r}: {key!r} is a key of the result itself")
        pairs[key] = value.strip()
    return pairs


def result_path(output_dir: str, filename: str | None, record: dict) -> str:
    """`filename` in `output_dir`, else vLLM's default name for the record's run."""
    if filename is None:
        filename = (f"{record['label']}-{record['request_rate']}qps-concurrency{record['max_concurrency']}-"
                    f"{record['model_id'].split('/')[-1]}-{record['date']}.json")
    return os.path.join(output_dir, filename)


def write_record(path: str, record: dict, append: bool) -> None:
    """The record as one line of `path`: the file replaced, or with `append` added after a newline (as vLLM's
    --append-result adds it)."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        if append and f.tell():
            f.write("\n")
        f.write(json.dumps(record, ensure_ascii=False))


def load_records(paths: list[str]) -> list[dict]:
    """The records of result files: a JSON object each, or one a line."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            records += [json.loads(line) for line in text.splitlines() if line.strip()]
    return records
