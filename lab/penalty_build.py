"""The host side of a penalised step's sampling tensors, per step, on the CPU: the dense build that ran
before f748757 (two [rows, vocabulary] tensors filled on the host, then copied to the device) against the
flat token ids that `runner/sampling_tensors._penalty_tensors` sends now (each request's int32 copy grown by one
token a step), qwen3-4b's vocabulary, half prompt and half generated tokens a row.

    python lab/penalty_build.py [--tokens 1024]

Prints per row count: ms of host work a step and the bytes each sends to the device.
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.runner.host_copies import HostCopies
from tokenmill.sampling_params import SamplingParams

VOCAB = 151936


def dense(requests):
    counts = torch.zeros(len(requests), VOCAB, dtype=torch.float32)
    seen = torch.zeros(len(requests), VOCAB, dtype=torch.bool)
    for i, r in enumerate(requests):
        out = torch.tensor(r.all_token_ids[r.num_prompt_tokens:], dtype=torch.int64)
        counts[i].index_add_(0, out, torch.ones(len(out)))
        seen[i, torch.tensor(r.all_token_ids, dtype=torch.int64)] = True
    return counts.numel() * 4 + seen.numel()


def flat(requests, copies):
    for r in requests:
        r.all_token_ids.append(5)                 # the step's new token
    arrays = [a[:r.num_tokens] for r, a in zip(requests, copies.tokens(requests))]
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    prompts = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, len(requests))
    ids = np.concatenate(arrays).astype(np.int64)
    rows = np.repeat(np.arange(len(requests), dtype=np.int32), lengths)
    generated = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths) >= \
        np.repeat(prompts, lengths)
    return ids.nbytes + rows.nbytes + generated.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    rng = random.Random(0)
    print("| rows | dense build, ms | to the device, MB | ids, ms | to the device, MB |")
    print("|---|---|---|---|---|")
    for num_rows in (64, 256):
        requests = []
        for i in range(num_rows):
            r = Request(str(i), [rng.randrange(VOCAB) for _ in range(args.tokens // 2)],
                        SamplingParams(frequency_penalty=0.5), 1 << 20, 0)
            r.all_token_ids += [rng.randrange(VOCAB) for _ in range(args.tokens // 2)]
            requests.append(r)
        t0 = time.perf_counter()
        for _ in range(3):
            dense_bytes = dense(requests)
        dense_ms = 1e3 * (time.perf_counter() - t0) / 3
        copies = HostCopies()
        flat(requests, copies)
        t0 = time.perf_counter()
        for _ in range(20):
            flat_bytes = flat(requests, copies)
        flat_ms = 1e3 * (time.perf_counter() - t0) / 20
        print(f"| {num_rows} | {dense_ms:.2f} | {dense_bytes / 1e6:.1f} | {flat_ms:.2f} | {flat_bytes / 1e6:.2f} |")


if __name__ == "__main__":
    main()
