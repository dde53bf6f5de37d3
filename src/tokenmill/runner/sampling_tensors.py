"""A step's sampling tensors (`SamplingTensors`): each sampled row's parameters from its request, copied to
the device at once as packed `sampling_rows.ROW` records, with the sparse extras only some rows need (the
penalties' token counts, logit_bias with min_tokens and bad words, allowed_token_ids, a grammar's bitmask, a
thinking budget's forced `</think>`). A field no row needs is None, so `sampler.sample` skips its work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.kernels import staging
from tokenmill.runner.host_copies import HostCopies
from tokenmill.runner.sampling_rows import ROW

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.grammar_bitmask import BatchBitmask

_WORDS = ROW.itemsize // 4     # a packed row (`sampling_rows.ROW`) in 32-bit words


@dataclass
class SamplingTensors:
    """Per-row parameters; a field is None when no row needs it, so its work is skipped."""
    temperature: torch.Tensor | None          # [S] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None                # [S] integer, vocab size when disabled
    top_p: torch.Tensor | None                # [S] float32
    min_p: torch.Tensor | None                # [S] float32
    seeds: torch.Tensor | None                # [S] int64 for seeded rows
    seeded_rows: torch.Tensor | None          # [S] bool or integer (nonzero: the row has a seed)
    output_positions: torch.Tensor | None     # [S] int64
    presence_penalty: torch.Tensor | None     # [S] float32, with token tensors below
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None        # [S, V] float32 counts of generated tokens
    seen_mask: torch.Tensor | None            # [S, V] bool: token in prompt or output
    max_logprobs: int | None                  # top alternatives to return, None: no logprobs
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, token ids, values)
    token_bitmask: BatchBitmask | None = None  # the grammar-constrained rows
    # the rows limited to allowed_token_ids: ([S] bool, the limited rows; the row and token id of each entry)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the rows that may have to take one token (a thinking budget's `</think>`): (rows, token ids, [F] bool
    # whether each must, decided on the device where it waits on the token in flight)
    forced: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # what the CUDA kernel reads, every row filled (top_k = vocab size, top_p = 1, min_p = 0 where off, each
    # row's seed and position): (temperature, top_k, top_p, min_p, seeds, positions)
    kernel_params: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def from_rows(rows: np.ndarray, vocab_size: int, device: torch.device, all_greedy: bool = False,
                  max_logprobs: int | None = None, output_counts: torch.Tensor | None = None,
                  seen_mask: torch.Tensor | None = None) -> "SamplingTensors":
        """The tensors of packed `rows` (a `ROW` array, top_k = `vocab_size` where off), copied to `device`
        at once; the penalties apply where `output_counts` and `seen_mask` (on `device`) are given."""
        host = torch.from_numpy(rows.view(np.int32).reshape(len(rows), _WORDS))
        if device.type == "cuda":
            host = host.pin_memory()
        words = host.to(device, non_blocking=True)
        as_dtype = {np.dtype("<i4"): words, np.dtype("<f4"): words.view(torch.float32),
                    np.dtype("<i8"): words.view(torch.int64)}

        def field(name: str) -> torch.Tensor:
            dtype, offset = ROW.fields[name]
            return as_dtype[dtype][:, offset // dtype.itemsize]

        temperature, top_k, top_p, min_p = (field(n) for n in ("temperature", "top_k", "top_p", "min_p"))
        seeds, positions = field("seed"), field("position")
        seeded = bool(rows["seeded"].any())
        penalties = output_counts is not None
        return SamplingTensors(
            temperature=temperature, all_greedy=all_greedy,
            top_k=top_k if (rows["top_k"] < vocab_size).any() else None,
            top_p=top_p if (rows["top_p"] < 1).any() else None,
            min_p=min_p if (rows["min_p"] > 0).any() else None,
            seeds=seeds if seeded else None, seeded_rows=field("seeded") if seeded else None,
            output_positions=positions if seeded else None,
            presence_penalty=field("presence_penalty") if penalties else None,
            frequency_penalty=field("frequency_penalty") if penalties else None,
            repetition_penalty=field("repetition_penalty") if penalties else None,
            output_counts=output_counts, seen_mask=seen_mask, max_logprobs=max_logprobs,
            kernel_params=(temperature, top_k, top_p, min_p, seeds, positions))

    @staticmethod
    def dummy(rows: int, device: torch.device, greedy: bool) -> "SamplingTensors":
        """Parameters for a memory-profiling or warm-up pass: top-k and top-p set, so that their work runs."""
        packed = np.zeros(rows, dtype=ROW)
        packed["top_k"], packed["temperature"], packed["top_p"], packed["repetition_penalty"] = 50, 1.0, 0.9, 1.0
        return SamplingTensors.from_rows(packed, 2**31 - 1, device, all_greedy=greedy)   # top_k 50 is on

    @staticmethod
    def from_requests(requests: list[Request], vocab_size: int, device: torch.device,
                      prev_tokens: torch.Tensor | None = None, copies: HostCopies | None = None
                      ) -> "SamplingTensors":
        """The tensors of the rows `requests` sample (on `device`): all None but `max_logprobs` when every
        row is greedy without penalties. `prev_tokens`: the sampled tokens of the step in flight, whose
        placeholders the penalties' counts read on the device; `copies`: the runner's copies of the
        requests' tokens."""
        rows = len(requests)
        packed, flags = (copies or HostCopies()).sampling_rows(requests, vocab_size)
        most = int(flags["logprobs"].max()) if rows else -1
        max_logprobs = most if most >= 0 else None
        bias = _logit_bias(requests, device, prev_tokens)
        allowed = _allowed(requests, device)
        forced = None
        if any(r.thinking is not None for r in requests):
            from tokenmill.engine.thinking_budget import forced_rows
            forced = forced_rows(requests, device, prev_tokens)
        bitmask = None
        if any(r.grammar is not None for r in requests):
            from tokenmill.engine.grammar_bitmask import BatchBitmask
            bitmask = BatchBitmask.from_requests(requests, vocab_size, device)
        all_greedy = bool(flags["greedy"].all())
        penalties = bool(flags["penalties"].any())
        if all_greedy and not penalties:
            return SamplingTensors(None, True, None, None, None, None, None, None, None, None, None,
                                   None, None, max_logprobs, bias, bitmask, allowed, forced)
        packed["position"] = np.fromiter((r.num_output_tokens for r in requests), np.int64, rows)
        counts = seen = None
        if penalties:
            counts, seen = _penalty_tensors(requests, vocab_size, device, prev_tokens, copies)
        t = SamplingTensors.from_rows(packed, vocab_size, device, all_greedy, max_logprobs, counts, seen)
        t.logit_bias, t.token_bitmask, t.allowed, t.forced = bias, bitmask, allowed, forced
        return t


def _penalty_tensors(requests: list[Request], vocab_size: int, device: torch.device,
                     prev_tokens: torch.Tensor | None = None, copies: HostCopies | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, V] float32 counts of each row's generated tokens and the bool mask of its prompt and generated
    tokens, built on `device` from the token ids alone (a step sends 8 bytes a token, not two dense rows
    of the vocabulary), each request's ids from its int32 copy in `copies` (the runner's), which a step
    extends by what changed. A token still in flight (a placeholder, the last of its request) is read on
    the device from `prev_tokens`, the sampled tokens of the step in flight, as the input ids'
    placeholders are."""
    arrays = [a[:r.num_tokens] for r, a in zip(requests, (copies or HostCopies()).tokens(requests))]
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    prompts = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, len(requests))
    ends = np.cumsum(lengths)
    flat = np.concatenate(arrays).astype(np.int64)
    pending = [i for i, r in enumerate(requests) if r.num_pending]
    if pending:
        if prev_tokens is None:
            raise RuntimeError("penalties: a request's last token is in flight but no step in flight samples it")
        flat[ends[pending] - 1] = [-1 - requests[i].pending_row for i in pending]
    ids = torch.from_numpy(flat).to(device, non_blocking=True)
    if pending:
        staging.fill_placeholders(ids, prev_tokens)
    rows = torch.from_numpy(np.repeat(np.arange(len(requests), dtype=np.int32), lengths)
                            ).to(device, non_blocking=True).long()
    # a token is generated where its index within its row reaches the row's prompt length
    generated = torch.from_numpy(np.arange(len(flat)) - np.repeat(ends - lengths, lengths)
                                 >= np.repeat(prompts, lengths)).to(device, non_blocking=True)
    seen = torch.zeros(len(requests), vocab_size, dtype=torch.bool, device=device)
    seen[rows, ids] = True
    counts = torch.zeros(len(requests), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), generated.to(torch.float32), accumulate=True)
    return counts, seen


def _logit_bias(requests: list[Request], device: torch.device, prev_tokens: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The sparse bias of the rows that have one: row, token id and value of each entry; None when no row
    has any. A row short of its min_tokens also gets -inf on the end-of-sequence and stop token ids it may
    not sample yet (the token it samples is output number `num_output_tokens`), and a row with bad words
    -inf on each word's last token where its output ends with the rest of the word (`_bad_words`)."""
    rows, ids, values = [], [], []
    pending: list[tuple[int, int, int, int]] = []
    for i, r in enumerate(requests):
        p = r.params
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
        if r.min_tokens_ids and r.num_output_tokens < p.min_tokens:
            rows += [i] * len(r.min_tokens_ids)
            ids += r.min_tokens_ids
            values += [float("-inf")] * len(r.min_tokens_ids)
        if p.bad_words_token_ids:
            banned = _bad_words(i, r, pending)
            rows += [i] * len(banned)
            ids += banned
            values += [float("-inf")] * len(banned)
    if not rows and not pending:
        return None
    host = (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True))
    if not pending:
        return host
    if prev_tokens is None:
        raise RuntimeError("bad words: a request's last token is in flight but no step in flight samples it")
    # the bans that wait on the token in flight: -inf where it is the word's token before the last, else 0
    p_rows, p_ids, expected, in_flight = (torch.tensor(c, dtype=torch.int64).to(device, non_blocking=True)
                                          for c in zip(*pending))
    ban = torch.where(prev_tokens[in_flight].long() == expected, float("-inf"), 0.0)
    return (torch.cat((host[0], p_rows)), torch.cat((host[1], p_ids)), torch.cat((host[2], ban)))


def _bad_words(row: int, r: Request, pending: list[tuple[int, int, int, int]]) -> list[int]:
    """The tokens sample row `row` may not take for its bad words (vLLM's rule: a word's last token where
    the output ends with the tokens before it; a one-token word always). A word whose match waits only on
    the output's last token, still in flight, goes to `pending` as (row, banned id, the token that would
    complete the match, its row in the step in flight), for the device to decide."""
    banned = []
    tokens, last_pending = r.all_token_ids, bool(r.num_pending)
    for word in r.params.bad_words_token_ids:
        before = len(word) - 1
        if before > r.num_output_tokens:
            continue
        tail = tokens[len(tokens) - before:]        # the output's last `before` tokens
        if last_pending and before:
            if tail[:-1] == word[:before - 1]:
                pending.append((row, word[-1], word[-2], r.pending_row))
        elif tail == word[:before]:
            banned.append(word[-1])
    return banned


def _allowed(requests: list[Request], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`SamplingTensors.allowed` of the rows with allowed_token_ids; None when no row has them."""
    limited = [i for i, r in enumerate(requests) if r.params.allowed_token_ids is not None]
    if not limited:
        return None
    rows = np.repeat(limited, [len(requests[i].params.allowed_token_ids) for i in limited])
    ids = np.concatenate([np.asarray(requests[i].params.allowed_token_ids, np.int64) for i in limited])
    is_limited = np.zeros(len(requests), dtype=bool)
    is_limited[limited] = True
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (is_limited, rows.astype(np.int64), ids))
