"""Sampling on the device: one batch of logits in, one token id per row out.

Greedy rows take the argmax. Random rows sample by the exponential race (argmax of p / E with
E ~ Exp(1), which draws from p exactly) over the tokens that top-k, top-p and min-p keep. For a request
with a seed, E comes from a counter-based hash of (seed, output position, token id): the draw depends on
nothing but the request itself, so it is reproducible across runs and independent of which other requests
share the batch.

One path per device: on CUDA a Triton kernel (`layers/kernels/sampling.py`) does the whole random draw in
one launch without a sort, every row's noise from that hash (a request without a seed has one from the
engine); elsewhere the torch path below, its reference, with torch's generator for rows without a seed.
Both keep the same set of tokens (the rule is stated in the kernel's module).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.runner.sampling_tensors import SamplingTensors

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
    """`logits` with the tokens min-p, top-k and top-p drop at -inf, in that order, top-p over what top-k
    keeps (vLLM's and Hugging Face's order: top-k, then the nucleus of the renormalised survivors). The
    kept set is every token at or above a cut-off value, so ties at the cut-off stay together (the rule of
    `kernels/sampling.py`): p >= min_p * p_max; the k-th largest value; the last value of the smallest
    sorted prefix whose mass reaches top_p of the top-k survivors' (the mass of the survivors strictly
    above a kept token is below top_p of theirs)."""
    if t.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * t.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if t.top_k is None and t.top_p is None:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    if t.top_k is not None:
        k = t.top_k.long().clamp(1, logits.shape[-1])
        cutoff = sorted_logits.gather(-1, k[:, None] - 1)
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
    if t.top_p is not None:
        probs = sorted_logits.softmax(-1)
        # >= 1; a row with no token left (every logit -inf) has NaN probabilities, keeps its first and draws
        # token 0, as the kernel and the rows without top-p do. A fallback: a request whose parameters leave it
        # no token is refused (`SamplingParams.check_some_token_allowed`) or, where its grammar's mask leaves
        # none, failed before its token is read (`grammar_bitmask.no_token_left`). A row without a grammar whose
        # allowed_token_ids bad words of several tokens all ban (decided on the device) reaches it, and its
        # request fails when its token is read (`step_reader.no_token_left`)
        kept = ((probs.cumsum(-1) - probs) < t.top_p[:, None]).sum(-1, keepdim=True).clamp_min(1)
        logits = logits.masked_fill(logits < sorted_logits.gather(-1, kept - 1), float("-inf"))
    return logits


def _exponential(like: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise shaped as `like` from torch's generator, by inversion: -log(U), U uniform in [0, 1).
    On the CPU a quarter of the time of `exponential_` (32 x 8,192: 1.7 against 6.5 ms on one thread). A
    U of exactly 0 (2^-24 a draw) gives +inf, so that token loses that race."""
    return torch.rand_like(like).log_().neg_()


def _random_tokens_torch(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The reference of `kernels.sampling.sample`: float32 `logits`, greedy rows by temperature 0."""
    greedy_ids = logits.argmax(-1)
    temp = t.temperature.clamp_min(1e-5)[:, None]
    scaled = _top_k_top_p_min_p(logits / temp, t)
    probs = scaled.softmax(-1)
    if t.seeds is None:
        noise = _exponential(probs)
    else:
        noise = seeded_exponential(t.seeds, t.output_positions, probs.shape[-1])
        seeded = t.seeded_rows.bool()
        if not seeded.all():
            noise = torch.where(seeded[:, None], noise, _exponential(probs))
    random_ids = (probs / noise).argmax(-1)
    return torch.where(t.temperature < 1e-5, greedy_ids, random_ids)


def _random_tokens_kernel(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    from tokenmill.layers.kernels import sampling
    if t.kernel_params is None:
        raise ValueError("sample: the kernel path needs SamplingTensors built by from_requests, from_rows or dummy")
    return sampling.sample(logits, *t.kernel_params, filtered=t.top_k is not None or t.top_p is not None)


def warm_up(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the random path's variants on `device` (logits in the model's `dtype`, and float32 after a
    bias or penalties; the kernel's two launch shapes, with top-k/top-p and without) before a request needs
    them: a compile inside a step stalls the whole batch."""
    filtered = SamplingTensors.dummy(1, device, greedy=False)
    for t in (filtered, replace(filtered, top_k=None, top_p=None)):
        for logits_dtype in dict.fromkeys((dtype, torch.float32)):
            sample(torch.zeros(1, vocab_size, dtype=logits_dtype, device=device), t)


def sample(logits: torch.Tensor, t: SamplingTensors, greedy: torch.Tensor | None = None) -> SamplerOutput:
    """`greedy`: each row's argmax of `logits` where the caller has it already (the CUDA graphs end
    with it); used as the tokens when every row is greedy and nothing else is asked of the logits."""
    if (t.all_greedy and t.output_counts is None and t.seen_mask is None and t.max_logprobs is None
            and t.logit_bias is None and t.token_bitmask is None and t.allowed is None and t.forced is None):
        if greedy is not None:
            return SamplerOutput(token_ids=greedy)
        # argmax in the logits' own dtype: every bf16/fp16 value is exact in float32, so it picks the same
        # row as the float32 argmax (first of equals), without a float copy of the logits per step
        return SamplerOutput(token_ids=logits.argmax(-1))
    if t.token_bitmask is not None:
        logits = t.token_bitmask.apply(logits)
    # logprobs are those of the model's distribution under the grammar, before allowed_token_ids, logit_bias,
    # penalties, a forced token, temperature and top-k/top-p (vLLM v1's default, "raw_logprobs")
    raw = logits
    if t.allowed is not None:
        is_limited, rows, ids = t.allowed
        # a limited row bans every token but its allowed ids; other rows ban none
        banned = is_limited[:, None].expand_as(logits).clone()
        banned[rows, ids] = False
        logits = logits.masked_fill(banned, float("-inf"))
    if t.logit_bias is not None or t.output_counts is not None or t.seen_mask is not None:
        logits = logits.float()
        if t.logit_bias is not None:
            logits = logits.index_put(t.logit_bias[:2], t.logit_bias[2], accumulate=True)
        if t.output_counts is not None or t.seen_mask is not None:
            logits = apply_penalties(logits, t)
    if t.forced is not None:
        rows, ids, must = t.forced
        # a row that must take its token keeps that one alone, at logit 0, whatever the masks, bias and
        # penalties above made of it: the budget wins over allowed_token_ids, bad words and logit_bias
        only = torch.full((len(rows), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        only[torch.arange(len(rows), device=logits.device), ids] = 0
        logits = logits.index_put((rows,), torch.where(must[:, None], only, logits[rows]))
    if t.all_greedy:
        token_ids = logits.argmax(-1)
    elif logits.is_cuda:
        # the kernel reads the logits in their own dtype (bf16 when nothing above changed them)
        token_ids = _random_tokens_kernel(logits, t)
    else:
        token_ids = _random_tokens_torch(logits.float(), t)
    out = SamplerOutput(token_ids=token_ids)
    if t.max_logprobs is not None:
        logprobs = raw.float().log_softmax(-1)
        sampled = logprobs.gather(-1, token_ids[:, None])
        top_vals, top_ids = logprobs.topk(t.max_logprobs, dim=-1) if t.max_logprobs else (
            logprobs[:, :0], token_ids[:, None][:, :0])
        out.logprobs = torch.cat((sampled, top_vals), dim=-1)
        out.logprob_token_ids = torch.cat((token_ids[:, None], top_ids), dim=-1)
        out.ranks = (logprobs > sampled).sum(-1) + 1
    return out
