"""Sampling on the device: one batch of logits in, one token id per row out.

Greedy rows take the argmax. Random rows sample by the exponential race (argmax of p / E with
E ~ Exp(1), which draws from p exactly). For a request with a seed, E comes from a counter-based
hash of (seed, output position, token id): the draw depends on nothing but the request itself, so it
is reproducible across runs and independent of which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.structured_output import BatchBitmask

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] that is a pure function of (seed, position, token id)."""
    row = _fmix32((seeds & _MASK32) ^ _fmix32((positions * 0x9E3779B1 + (seeds >> 32)) & _MASK32))
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = _fmix32((row[:, None] ^ ((ids[None, :] * 0x27D4EB2F) & _MASK32)) & _MASK32)
    x = _fmix32(x ^ row[:, None])
    u = (x.to(torch.float64) + 0.5) / 4294967296.0     # (0, 1)
    return -torch.log(u).to(torch.float32)


@dataclass
class SamplingTensors:
    """Per-row parameters; a field is None when no row needs it, so its work is skipped."""
    temperature: torch.Tensor | None          # [S] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None                # [S] int64, vocab size when disabled
    top_p: torch.Tensor | None                # [S] float32
    min_p: torch.Tensor | None                # [S] float32
    seeds: torch.Tensor | None                # [S] int64 for seeded rows
    seeded_rows: torch.Tensor | None          # [S] bool
    output_positions: torch.Tensor | None     # [S] int64
    presence_penalty: torch.Tensor | None     # [S] float32, with token tensors below
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None        # [S, V] float32 counts of generated tokens
    seen_mask: torch.Tensor | None            # [S, V] bool: token in prompt or output
    max_logprobs: int | None                  # top alternatives to return, None: no logprobs
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, token ids, values)
    token_bitmask: BatchBitmask | None = None  # the grammar-constrained rows

    @staticmethod
    def dummy(rows: int, device: torch.device, greedy: bool) -> "SamplingTensors":
        """Parameters for a memory-profiling or warm-up pass: top-k and top-p set, so that their work runs."""
        return SamplingTensors(
            temperature=torch.ones(rows, device=device), all_greedy=greedy,
            top_k=torch.full((rows,), 50, device=device), top_p=torch.full((rows,), 0.9, device=device),
            min_p=None, seeds=None, seeded_rows=None, output_positions=None, presence_penalty=None,
            frequency_penalty=None, repetition_penalty=None, output_counts=None, seen_mask=None,
            max_logprobs=None)

    @staticmethod
    def from_requests(requests: list[Request], vocab_size: int, device: torch.device) -> "SamplingTensors":
        """The tensors of the rows `requests` sample (on `device`): all None but `max_logprobs` when every
        row is greedy without penalties."""
        params = [r.params for r in requests]
        rows = len(requests)
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        bias = _logit_bias(params, device) if any(p.logit_bias for p in params) else None
        bitmask = None
        if any(r.grammar is not None for r in requests):
            from tokenmill.engine.structured_output import BatchBitmask
            bitmask = BatchBitmask.from_requests(requests, vocab_size, device)
        if all(p.greedy for p in params) and not any(p.needs_penalties for p in params):
            return SamplingTensors(None, True, None, None, None, None, None, None, None, None, None,
                                   None, None, max_logprobs, bias, bitmask)

        def tensor(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        temperature = tensor([0.0 if p.greedy else p.temperature for p in params])
        top_k = tensor([p.top_k or vocab_size for p in params], torch.int64) \
            if any(p.top_k for p in params) else None
        top_p = tensor([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None
        min_p = tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
        seeded = [p.seed is not None for p in params]
        seeds = positions = seeded_rows = None
        if any(seeded):
            seeds = tensor([r.seed for r in requests], torch.int64)
            positions = tensor([r.num_output_tokens for r in requests], torch.int64)
            seeded_rows = tensor(seeded, torch.bool)
        pp = fp = rp = counts = seen = None
        if any(p.needs_penalties for p in params):
            counts = torch.zeros(rows, vocab_size, dtype=torch.float32)
            seen = torch.zeros(rows, vocab_size, dtype=torch.bool)
            for i, r in enumerate(requests):
                out = torch.tensor(r.output_token_ids, dtype=torch.int64)
                counts[i].index_add_(0, out, torch.ones(len(out)))
                seen[i, torch.tensor(r.all_token_ids, dtype=torch.int64)] = True
            counts, seen = counts.to(device), seen.to(device)
            pp = tensor([p.presence_penalty for p in params])
            fp = tensor([p.frequency_penalty for p in params])
            rp = tensor([p.repetition_penalty for p in params])
        return SamplingTensors(temperature, False, top_k, top_p, min_p, seeds, seeded_rows, positions,
                               pp, fp, rp, counts, seen, max_logprobs, bias, bitmask)


def _logit_bias(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse bias of the rows that have one: row, token id and value of each entry."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    return (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # [S] int64
    logprobs: torch.Tensor | None = None      # [S, 1 + k]: sampled token first, then the top k
    logprob_token_ids: torch.Tensor | None = None
    ranks: torch.Tensor | None = None         # [S] rank of the sampled token


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.repetition_penalty is not None:
        rp = t.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(t.seen_mask, penalised, logits)
    if t.frequency_penalty is not None:
        logits = logits - t.frequency_penalty[:, None] * t.output_counts
        logits = logits - t.presence_penalty[:, None] * (t.output_counts > 0).to(logits.dtype)
    return logits


def _top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * t.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if t.top_k is None and t.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if t.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        remove |= ranks >= t.top_k[:, None]
    if t.top_p is not None:
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        remove |= (probs.cumsum(-1) - probs) >= t.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors, greedy: torch.Tensor | None = None) -> SamplerOutput:
    """`greedy`: each row's argmax of `logits` where the caller has it already (the CUDA graphs end
    with it); used as the tokens when every row is greedy and nothing else is asked of the logits."""
    if (t.all_greedy and t.output_counts is None and t.seen_mask is None and t.max_logprobs is None
            and t.logit_bias is None and t.token_bitmask is None):
        if greedy is not None:
            return SamplerOutput(token_ids=greedy)
        # argmax in the logits' own dtype: every bf16/fp16 value is exact in float32, so it picks the same
        # row as the float32 argmax (first of equals), without a float copy of the logits per step
        return SamplerOutput(token_ids=logits.argmax(-1))
    logits = logits.float()
    if t.token_bitmask is not None:
        logits = t.token_bitmask.apply(logits)
    # logprobs are those of the model's distribution under the grammar, before logit_bias, penalties,
    # temperature and top-k/top-p (vLLM v1's default, "raw_logprobs")
    raw = logits
    if t.logit_bias is not None:
        logits = logits.index_put(t.logit_bias[:2], t.logit_bias[2], accumulate=True)
    if t.output_counts is not None or t.seen_mask is not None:
        logits = apply_penalties(logits, t)
    greedy_ids = logits.argmax(-1)
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        temp = t.temperature.clamp_min(1e-5)[:, None]
        scaled = _top_k_top_p_min_p(logits / temp, t)
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        if t.seeds is not None:
            seeded = seeded_exponential(t.seeds, t.output_positions, probs.shape[-1])
            noise = torch.where(t.seeded_rows[:, None], seeded, noise)
        random_ids = (probs / noise).argmax(-1)
        token_ids = torch.where(t.temperature < 1e-5, greedy_ids, random_ids)
    out = SamplerOutput(token_ids=token_ids)
    if t.max_logprobs is not None:
        logprobs = raw.log_softmax(-1)
        sampled = logprobs.gather(-1, token_ids[:, None])
        top_vals, top_ids = logprobs.topk(t.max_logprobs, dim=-1) if t.max_logprobs else (
            logprobs[:, :0], token_ids[:, None][:, :0])
        out.logprobs = torch.cat((sampled, top_vals), dim=-1)
        out.logprob_token_ids = torch.cat((token_ids[:, None], top_ids), dim=-1)
        out.ranks = (logprobs > sampled).sum(-1) + 1
    return out
